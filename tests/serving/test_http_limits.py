"""Connection limits of the HTTP servers (http_limits.py): a connection that sends nothing or only
part of a request head is closed at the head timeout, and connections over the per-address cap
are refused while another address is still served."""

from __future__ import annotations

import itertools
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import pytest
import uvicorn

from pagoda.node_agent.serving.api.http_limits import HttpLimits, uvicorn_config
from pagoda.node_agent.serving.launch import free_port

from .apps import read_response, serve_args

pytestmark = [pytest.mark.serve, pytest.mark.timeout(60)]

GET = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"


async def tiny_app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@contextmanager
def server(limits: HttpLimits) -> Iterator[tuple[int, uvicorn.Server]]:
    port = free_port()
    srv = uvicorn.Server(uvicorn_config(tiny_app, "127.0.0.1", port, "warning", limits, lifespan="off"))
    thread = threading.Thread(target=srv.run, name="uvicorn-limits-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the test server did not start"
        time.sleep(0.02)
    try:
        yield port, srv
    finally:
        srv.should_exit = True
        thread.join(10)


def connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))
    return s


def closed_after(s: socket.socket) -> tuple[bytes, float]:
    """What the server sends until it closes, and how long that took."""
    t0 = time.monotonic()
    data = b""
    while chunk := s.recv(4096):
        data += chunk
    return data, time.monotonic() - t0


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le"])
def test_silent_or_partial_heads_are_closed_at_the_head_timeout(sent: bytes) -> None:
    with server(HttpLimits(head_timeout_s=0.5, keep_alive_s=30)) as (port, _), connect(port) as s:
        s.sendall(sent)
        data, took = closed_after(s)
    assert data.startswith(b"HTTP/1.1 408")
    assert took < 8  # the configured 0.5 s, with room for a loaded machine; the default read hangs


def test_a_keep_alive_connection_trickling_a_second_head_is_closed() -> None:
    """After one answered request, a second head sent a byte at a time (each byte would reset a
    keep-alive timer) still has to arrive whole within the head timeout."""
    with server(HttpLimits(head_timeout_s=1.0, keep_alive_s=30)) as (port, _), connect(port) as s:
        s.sendall(GET)
        assert read_response(s).startswith("HTTP/1.1 200")
        s.settimeout(0.05)
        got: bytes | None = None
        deadline = time.monotonic() + 15
        for byte in itertools.cycle(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000):
            try:
                s.sendall(bytes([byte]))
                got = s.recv(4096)  # the 408, or the close
                break
            except TimeoutError:
                assert time.monotonic() < deadline, "the trickling connection was never closed"
            except OSError:
                got = b""
                break
    assert got == b"" or got.startswith(b"HTTP/1.1 408")


def test_connections_over_the_per_address_cap_are_refused_and_others_served() -> None:
    limits = HttpLimits(head_timeout_s=30, max_connections_per_client=2, max_connections=4)
    with server(limits) as (port, srv), ExitStack() as held:
        counts = srv.config.http_protocol_class.counts
        for _ in range(2):
            held.enter_context(connect(port))  # idle, held open
        while counts.total < 2:
            time.sleep(0.01)
        with connect(port) as third:
            data, _ = closed_after(third)
        assert data.startswith(b"HTTP/1.1 503")
        with connect(port, "127.0.0.2") as other:  # another address is still served
            other.sendall(GET)
            assert read_response(other).startswith("HTTP/1.1 200")
        for _ in range(2):
            held.enter_context(connect(port, "127.0.0.3"))
        while counts.total < 4:
            time.sleep(0.01)
        with connect(port, "127.0.0.4") as over_total:
            data, _ = closed_after(over_total)
        assert data.startswith(b"HTTP/1.1 503")
        assert counts.refused == 2


def test_every_role_gets_the_limits_and_only_the_public_api_a_per_address_cap() -> None:
    from pagoda.node_agent.cli.serve import PUBLIC_CONNECTIONS_PER_CLIENT, http_limits_from_args

    for role in ("both", "router"):
        lim = http_limits_from_args(serve_args("--role", role, "--http-head-timeout", "3"))
        assert lim.head_timeout_s == 3 and lim.max_connections_per_client == PUBLIC_CONNECTIONS_PER_CLIENT
    for role in ("prefill", "decode"):
        lim = http_limits_from_args(serve_args("--role", role))
        assert lim.max_connections_per_client is None and lim.max_connections == 4096
    lim = http_limits_from_args(serve_args("--role", "decode", "--http-max-connections-per-client", "9"))
    assert lim.max_connections_per_client == 9
    with pytest.raises(ValueError, match="head_timeout_s"):
        http_limits_from_args(serve_args("--http-head-timeout", "0"))
