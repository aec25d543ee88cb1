"""The engine is built off the main thread, so the engine thread's OpenMP pool is the process's only
one (docs/serving.md#one-openmp-pool): a pool left on the main thread puts every pool's workers to
sleep between parallel regions once the process holds more workers than cores."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pagoda.node_agent.serving.worker.async_engine import build_off_main

PROBE = """
import os, sys, time, torch
from pagoda.node_agent.serving.worker.async_engine import build_off_main
torch.set_num_threads(2)
def tasks(): return len(os.listdir('/proc/self/task'))
def work():
    a = torch.randn(1500, 1500)
    return float((a @ a).sum())
base = tasks()
build_off_main(work) if sys.argv[1] == 'off' else work()
for _ in range(60):
    if tasks() <= base:
        break
    time.sleep(0.05)
print(base, tasks())
"""


def threads_after(where: str) -> tuple[int, int]:
    """OS threads of a fresh process before and after one parallel matmul run ``where``."""
    env = {**os.environ, "PYTHONSAFEPATH": "1", "OMP_NUM_THREADS": "2"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, where], capture_output=True, text=True, env=env, timeout=120, check=True
    )
    base, after = out.stdout.split()
    return int(base), int(after)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through Linux's /proc")
def test_a_build_off_the_main_thread_leaves_no_openmp_pool_behind() -> None:
    base, after = threads_after("off")
    assert after == base, f"{after - base} OpenMP worker(s) outlived the build thread"
    base, after = threads_after("main")  # the control: the same work on the main thread keeps one
    assert after > base, "a parallel matmul on the main thread left no worker: the probe measures nothing"


def test_build_off_main_returns_the_engine_from_another_thread() -> None:
    seen: list[str] = []

    def factory() -> object:
        seen.append(threading.current_thread().name)
        return "engine"

    assert build_off_main(factory) == "engine"  # type: ignore[arg-type]
    assert seen and seen[0] != threading.main_thread().name


def test_build_off_main_raises_the_factory_s_error_on_the_caller() -> None:
    def factory() -> object:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        build_off_main(factory)  # type: ignore[arg-type]
