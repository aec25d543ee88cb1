"""The supervisor of ``pagoda serve --disaggregated``, with cheap fake children (no model): restart
with backoff, giving up on a child that cannot start, reset after a stable run, clean shutdown."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from pagoda.node_agent.cli.serve import child_args
from pagoda.node_agent.cli.supervisor import (
    INTERNAL_TOKEN_ENV,
    INTERNAL_TOKEN_FILE_ENV,
    TENANT_SECRET_ENV,
    ChildSpec,
    RestartPolicy,
    Supervisor,
    child_env,
)

pytestmark = pytest.mark.timeout(60)

PY = sys.executable
# appends "PID MONOTONIC" to argv[1], then sleeps argv[2] seconds and exits with code argv[3]
LOGGED = (
    "import os, sys, time\n"
    "open(sys.argv[1], 'a').write(f'{os.getpid()} {time.monotonic()}\\n')\n"
    "time.sleep(float(sys.argv[2]))\n"
    "sys.exit(int(sys.argv[3]))\n"
)


def logged(path: Path, sleep_s: float, code: int) -> list[str]:
    return [PY, "-I", "-c", LOGGED, str(path), str(sleep_s), str(code)]


def starts(path: Path) -> list[tuple[int, float]]:
    rows = [line.split() for line in path.read_text().splitlines()]
    return [(int(pid), float(t)) for pid, t in rows]


def test_restarts_with_doubling_backoff_then_gives_up_keeping_the_others_running(tmp_path, capsys):
    crash, calm = tmp_path / "crash", tmp_path / "calm"
    policy = RestartPolicy(
        initial_backoff_s=0.1, max_backoff_s=0.4, stable_after_s=30, max_failures=5, poll_s=0.02
    )
    sup = Supervisor(
        [ChildSpec("crasher", logged(crash, 0, 3)), ChildSpec("calm", logged(calm, 600, 0))], policy
    )
    assert sup.run() == 1
    assert [(r.name, r.exit_code, r.delay_s, r.failures) for r in sup.restarts] == [
        ("crasher", 3, 0.1, 1),
        ("crasher", 3, 0.2, 2),
        ("crasher", 3, 0.4, 3),
        ("crasher", 3, 0.4, 4),
    ]
    crash_starts = starts(crash)
    assert len(crash_starts) == 5  # the first start and four restarts, then the fifth failure gives up
    gaps = [b[1] - a[1] for a, b in zip(crash_starts, crash_starts[1:], strict=False)]
    assert all(gap >= r.delay_s for gap, r in zip(gaps, sup.restarts, strict=True)), gaps
    (calm_pid, _), *more = starts(calm)
    assert not more, "the healthy child was restarted"
    assert not psutil.pid_exists(calm_pid), "the healthy child outlived the supervisor"
    out, err = capsys.readouterr()
    assert out.count("restarted crasher") == 4
    assert "crasher exited with code 3; it failed 5 times in a row" in err and "giving up" in err


def test_a_child_that_stayed_up_long_enough_restarts_from_the_first_backoff(tmp_path):
    path = tmp_path / "flaky"
    policy = RestartPolicy(initial_backoff_s=0.05, stable_after_s=0.2, max_failures=2, poll_s=0.02)
    sup = Supervisor([ChildSpec("flaky", logged(path, 0.3, 1))], policy)  # up 0.3 s > 0.2 s: stable
    result: list[int] = []
    runner = threading.Thread(target=lambda: result.append(sup.run()))
    runner.start()
    deadline = time.monotonic() + 30
    while len(sup.restarts) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    sup.request_stop()
    runner.join(30)
    assert result == [0]
    assert len(sup.restarts) >= 3
    assert {(r.delay_s, r.failures) for r in sup.restarts} == {(0.05, 1)}


# a supervisor of one plain child and one that ignores SIGTERM (it must be killed after stop_timeout_s)
SUPERVISED = """
import sys
from pagoda.node_agent.cli.supervisor import ChildSpec, RestartPolicy, Supervisor
py = sys.executable
stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('armed', flush=True); time.sleep(600)"
kids = [ChildSpec("plain", [py, "-c", "import time; time.sleep(600)"]), ChildSpec("stubborn", [py, "-c", stubborn])]
sys.exit(Supervisor(kids, RestartPolicy(stop_timeout_s=1)).run())
"""  # noqa: E501


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_or_sigint_stops_every_child_and_exits_0(signum):
    sup = subprocess.Popen([PY, "-c", SUPERVISED], stdout=subprocess.PIPE, text=True)
    children: list[psutil.Process] = []
    try:
        lines = []
        for line in sup.stdout:  # the ready line, then the stubborn child's
            lines.append(line)
            if line.strip() == "armed":
                break
        assert lines[0].strip() == "pagoda supervisor: ready"
        children = psutil.Process(sup.pid).children()
        assert len(children) == 2
        sup.send_signal(signum)
        assert sup.wait(30) == 0
        _, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, f"children left running: {alive}"
    finally:
        if sup.poll() is None:
            sup.kill()
        for c in children:
            if c.is_running():
                c.kill()


def test_children_get_generated_secrets_by_environment_unless_given():
    env = child_env({"PATH": "/bin"}, None, None)
    again = child_env({"PATH": "/bin"}, None, None)
    assert len(env[INTERNAL_TOKEN_ENV]) >= 40 and len(env[TENANT_SECRET_ENV]) >= 40
    assert env[INTERNAL_TOKEN_ENV] != again[INTERNAL_TOKEN_ENV]
    assert env[TENANT_SECRET_ENV] != again[TENANT_SECRET_ENV]
    assert env["PATH"] == "/bin"
    given = child_env({INTERNAL_TOKEN_ENV: "tok", TENANT_SECRET_ENV: "salt"}, None, None)
    assert given[INTERNAL_TOKEN_ENV] == "tok" and given[TENANT_SECRET_ENV] == "salt"
    assert INTERNAL_TOKEN_ENV not in child_env({INTERNAL_TOKEN_FILE_ENV: "/run/t"}, None, None)
    assert INTERNAL_TOKEN_ENV not in child_env({}, "/run/t", None)
    assert child_env({TENANT_SECRET_ENV: "env"}, None, "flag")[TENANT_SECRET_ENV] == "flag"


def test_child_command_lines_carry_no_tenant_secret(monkeypatch):
    argv = ["pagoda", "serve", "--disaggregated", "--tenant-secret", "s3cret", "--port", "9000"]
    monkeypatch.setattr(sys, "argv", [*argv, "--tenant-secret=other", "--dtype", "float32"])
    cmd = child_args(argparse.Namespace(), "decode", 9002, ["--kv-port", "9100"])
    assert not any("s3cret" in x or "other" in x or "tenant" in x for x in cmd)
    assert " ".join(cmd[-9:]) == "serve --dtype float32 --role decode --port 9002 --kv-port 9100"
