"""A replica's shutdown reaps every rank it started, even one stopped by SIGSTOP (which ignores
SIGTERM until continued): terminate_children escalates to SIGKILL."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from types import SimpleNamespace

from pagoda.node_agent.engine.parallel.group import ParallelGroup


def test_a_stopped_rank_is_killed_and_reaped():
    child = mp.get_context("spawn").Process(target=time.sleep, args=(120,), daemon=True)
    child.start()
    try:
        os.kill(child.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        ParallelGroup.terminate_children(SimpleNamespace(children={1: child}), grace_s=0.3)
        assert child.exitcode == -signal.SIGKILL  # SIGTERM did nothing to the stopped process
        assert time.monotonic() - t0 < 5
    finally:
        if child.exitcode is None:
            child.kill()
            child.join()
