"""Starting ``pagoda serve`` processes locally and waiting for them to be ready."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time

AGENT_MODULE = "pagoda.node_agent.cli.main"  # the ``pagoda`` command, run as ``python -m``


def agent_command(*args: str) -> list[str]:
    """``python -P -m pagoda.node_agent.cli.main ARGS`` with this interpreter."""
    return [sys.executable, "-P", "-m", AGENT_MODULE, *args]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def is_ready(url: str, timeout: float = 2, path: str = "/ready") -> bool:
    """Whether ``url``/ready (or ``path``) answers 200 now."""
    import httpx

    try:
        return httpx.get(url + path, timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def wait_ready(url: str, procs: list[subprocess.Popen], timeout: float = 300, path: str = "/ready") -> None:
    """Poll ``url``/ready (or ``path``) until 200; RuntimeError if one of ``procs`` exits first (with
    the end of its stderr when that is a pipe) or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                tail = p.stderr.read().decode(errors="replace")[-2000:] if p.stderr else ""
                raise RuntimeError(f"a worker exited with code {p.returncode} before it was ready: {tail}")
        if is_ready(url, path=path):
            return
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {timeout:.0f}s")


def start_server(
    engine_argv: list[str], port: int, disaggregated: bool = False, timeout: float = 600
) -> subprocess.Popen:
    """``pagoda serve --port PORT ENGINE_ARGV`` (``--disaggregated``: router + both workers), ready."""
    cmd = agent_command("serve", "--port", str(port), *engine_argv)
    if disaggregated:
        cmd.append("--disaggregated")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    try:
        wait_ready(f"http://127.0.0.1:{port}", [proc], timeout=timeout)
    except BaseException:
        stop([proc])
        raise
    if disaggregated:
        time.sleep(1.0)  # the router's first health poll
    return proc


def stop(procs: list[subprocess.Popen], timeout: float = 10, hurry: threading.Event | None = None) -> None:
    """SIGTERM every process still running, then wait; kill the ones still running ``timeout`` seconds
    after the SIGTERM (one deadline for all), or as soon as ``hurry`` is set, and reap them."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        while p.poll() is None:
            if time.monotonic() >= deadline or (hurry is not None and hurry.is_set()):
                p.kill()
                break
            time.sleep(0.05)
        p.wait()
