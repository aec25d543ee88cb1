"""`pagoda serve --disaggregated` starts router, prefill and decode workers with their shared secrets in
the environment (never on a command line), and a SIGTERM to it stops all of them (no orphaned workers)."""

from __future__ import annotations

import signal
import subprocess
import sys

import psutil
import pytest

from pagoda.node_agent.cli.supervisor import INTERNAL_TOKEN_ENV, TENANT_SECRET_ENV
from pagoda.node_agent.serving.launch import wait_ready

from .live import free_port

pytestmark = [pytest.mark.slow, pytest.mark.serve, pytest.mark.timeout(300)]


def test_workers_share_secrets_by_environment_and_sigterm_stops_every_worker():
    port = free_port()
    cmd = [sys.executable, "-P", "-m", "pagoda.node_agent.cli.main", "serve", "--disaggregated", "--port", str(port),
           "--dtype", "float32", "--kv-memory", "16MiB", "--max-model-len", "256", "--tenant-secret", "flag-secret"]  # fmt: skip
    parent = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    children: list[psutil.Process] = []
    try:
        wait_ready(f"http://127.0.0.1:{port}", [parent], timeout=240)
        children = psutil.Process(parent.pid).children(recursive=True)
        assert len(children) >= 3  # router, prefill and decode workers
        envs = [c.environ() for c in children]
        tokens = {e.get(INTERNAL_TOKEN_ENV) for e in envs}
        assert len(tokens) == 1 and None not in tokens  # one generated token for all of them
        assert {e.get(TENANT_SECRET_ENV) for e in envs} == {"flag-secret"}
        for c in children:
            line = " ".join(c.cmdline())
            assert "flag-secret" not in line and tokens.isdisjoint(line.split())
        parent.send_signal(signal.SIGTERM)
        parent.wait(timeout=30)
        gone, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, f"workers left running: {[p.pid for p in alive]}"
    finally:
        if parent.poll() is None:
            parent.kill()
        for child in children:  # never leave workers behind, even when the test fails
            if child.is_running():
                child.kill()
