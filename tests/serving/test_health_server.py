"""The tensor-parallel follower's /health server: its answers, and the connection limits every
``pagoda serve`` server has (a silent peer timed out with 408, a peer over its cap refused)."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from pagoda.node_agent.serving.api.health_server import HealthServer
from pagoda.node_agent.serving.api.http_limits import HttpLimits
from pagoda.node_agent.serving.launch import free_port

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def health():
    state = {"joined": False}
    limits = HttpLimits(head_timeout_s=0.5, keep_alive_s=1.0, max_connections_per_client=4)
    port = free_port()
    server = HealthServer("127.0.0.1", port, lambda: state["joined"], limits).start()
    try:
        yield f"http://127.0.0.1:{port}", state, port
    finally:
        server.stop()


def test_health_answers_503_until_the_ranks_joined_then_200(health) -> None:
    url, state, _ = health
    r = httpx.get(url + "/health")
    assert r.status_code == 503 and r.json() == {"status": "not ready"}
    state["joined"] = True
    r = httpx.get(url + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert httpx.get(url + "/ready").status_code == 404
    assert httpx.post(url + "/health", content=b"x").status_code == 405


def test_a_silent_peer_is_timed_out_and_one_over_its_cap_refused(health) -> None:
    url, state, port = health
    state["joined"] = True
    silent = socket.create_connection(("127.0.0.1", port), timeout=5)
    t0 = time.monotonic()
    answer = silent.recv(4096)  # nothing sent: the head timeout answers and closes
    assert answer.startswith(b"HTTP/1.1 408") and time.monotonic() - t0 < 3
    assert silent.recv(4096) == b""
    silent.close()
    held = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(4)]
    try:
        extra = socket.create_connection(("127.0.0.1", port), timeout=5)
        assert extra.recv(4096).startswith(b"HTTP/1.1 503")  # over the per-client cap of 4
        extra.close()
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 5
    while True:  # the closed ones give their places back
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline
        time.sleep(0.05)
