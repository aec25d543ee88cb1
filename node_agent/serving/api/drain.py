"""Graceful drain: what every ``pagoda serve`` server (both, router, prefill, decode) does on SIGTERM.

The first SIGTERM (or SIGINT) starts a drain: the server keeps listening but admits nothing new
(``/health`` and ``/ready`` answer 503 ``{"status": "draining"}``, every other path but
``/metrics`` a 503 OpenAI-shaped ``draining`` error with ``Retry-After``; on a decode worker that
refuses new ``/internal/decode`` requests, so no new KV handoff is set up there), while the
requests already running, streams included, go on. When none is left, or ``--drain-timeout``
seconds have passed, the server stops and exits 0; a request still running at the deadline is
ended explicitly: an SSE error event (``drain_timeout``) on a stream, an NDJSON error line on a
worker's internal stream, a 503 when no response had started. A second SIGTERM or SIGINT exits at
once (code 128 + the signal's number). ``pagoda_draining`` is 1 while it drains.

``DrainGate`` is the ASGI middleware that refuses and counts requests; ``DrainingServer`` is the
uvicorn server whose signal handler starts the drain instead of uvicorn's own shutdown (which
would close the listening socket first and cut streams after its grace period).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
from dataclasses import dataclass
from types import FrameType

import uvicorn
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagoda.node_agent.serving.api.errors import RETRY_AFTER_S, ApiError
from pagoda.node_agent.serving.api.http_limits import HttpLimits, uvicorn_config
from pagoda.node_agent.serving.api.metrics import ServeMetrics
from pagoda.node_agent.serving.api.protocol import sse

log = logging.getLogger("pagoda.drain")

DEFAULT_DRAIN_TIMEOUT_S = 30.0
PROBES = frozenset({"/health", "/ready"})  # answer "draining" while draining
UNCOUNTED = frozenset({"/health", "/ready", "/metrics", "/internal/state"})  # never wait for these
CUT_SCOPE_KEY = "pagoda.drain_cut"  # set in a request's ASGI scope when the drain deadline cuts it
POLL_S = 0.05
CUT_GRACE_S = 5.0  # for requests ended at the deadline to send their error


def draining_error() -> ApiError:
    """The refusal of a new request while the server drains."""
    return ApiError(
        503,
        "the server is shutting down and takes no new requests; retry (another replica will answer)",
        code="draining",
        type_="server_error",
        headers={"Retry-After": str(RETRY_AFTER_S), "Connection": "close"},
    )


def deadline_error(timeout_s: float) -> ApiError:
    """The end of a request still running at the drain deadline."""
    return ApiError(
        503,
        f"the server shut down before this request finished (drain timeout {timeout_s:g} s); retry it",
        code="drain_timeout",
        type_="server_error",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


@dataclass(eq=False)
class _Flight:
    """One request the drain waits for."""

    task: asyncio.Task
    scope: Scope | None = None
    started: bool = False  # its response headers went out
    ended: bool = False  # its last body chunk went out
    content_type: str = ""
    cut: bool = False  # cancelled at the deadline (the gate sends the error ending)


class Drain:
    """The drain state of one server: whether it drains, and the requests in flight."""

    def __init__(
        self, metrics: ServeMetrics | None = None, timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    ) -> None:
        if not timeout_s >= 0:
            raise ValueError(f"--drain-timeout must be >= 0 seconds, got {timeout_s}")
        self.metrics = metrics
        self.timeout_s = timeout_s
        self.draining = False
        self.flights: set[_Flight] = set()

    @property
    def inflight(self) -> int:
        return len(self.flights)

    def begin(self) -> bool:
        """Stop admitting; False when already draining."""
        if self.draining:
            return False
        self.draining = True
        if self.metrics is not None:
            self.metrics.draining.labels(self.metrics.pool).set(1)
        log.warning(
            "draining: no new requests; waiting up to %g s for %d in flight", self.timeout_s, self.inflight
        )
        return True

    async def run(self) -> int:
        """Wait for the requests in flight up to the timeout, then end the rest with an error (waiting
        up to CUT_GRACE_S for them to send it); the number ended so."""
        self.begin()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        while self.flights and loop.time() < deadline:
            await asyncio.sleep(min(POLL_S, max(0.0, deadline - loop.time())))
        left = list(self.flights)
        if left:
            log.warning("drain timeout (%g s): ending %d request(s) still running", self.timeout_s, len(left))
            if self.metrics is not None:
                self.metrics.drain_cut.labels(self.metrics.pool).inc(len(left))
        for f in left:
            f.cut = True
            if f.scope is not None:
                f.scope[CUT_SCOPE_KEY] = True
            f.task.cancel()
        end = loop.time() + CUT_GRACE_S
        while self.flights and loop.time() < end:
            await asyncio.sleep(POLL_S)
        return len(left)


class DrainGate:
    """ASGI middleware: refuses new requests while draining and tracks the ones in flight."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if self.drain.draining and path != "/metrics":
            if path in PROBES:
                response = JSONResponse({"status": "draining"}, status_code=503)
            else:
                err = draining_error()
                response = JSONResponse(err.body(), status_code=503, headers=err.headers)
            await response(scope, receive, send)
            return
        if path in UNCOUNTED:
            await self.app(scope, receive, send)
            return
        task = asyncio.current_task()
        assert task is not None
        flight = _Flight(task, scope)

        async def watch(message: Message) -> None:
            if message["type"] == "http.response.start":
                flight.started = True
                for k, v in message.get("headers", []):
                    if k.lower() == b"content-type":
                        flight.content_type = v.decode("latin-1").lower()
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                flight.ended = True
            await send(message)

        self.drain.flights.add(flight)
        try:
            await self.app(scope, receive, watch)
        except asyncio.CancelledError:
            if not flight.cut:
                raise
            task.uncancel()
            with contextlib.suppress(Exception):
                await self._end(flight, scope, receive, send)
        finally:
            self.drain.flights.discard(flight)

    async def _end(self, flight: _Flight, scope: Scope, receive: Receive, send: Send) -> None:
        """The explicit ending of a request cut at the deadline."""
        err = deadline_error(self.drain.timeout_s)
        if not flight.started:
            await JSONResponse(err.body(), status_code=err.status, headers=err.headers)(scope, receive, send)
            return
        if flight.ended:
            return
        if "text/event-stream" in flight.content_type:
            body = sse(err.body())
        elif "ndjson" in flight.content_type:
            body = (json.dumps(err.body(), separators=(",", ":")) + "\n").encode()
        else:
            body = b""
        await send({"type": "http.response.body", "body": body, "more_body": False})


class DrainingServer(uvicorn.Server):
    """uvicorn's server with the drain as its answer to SIGTERM/SIGINT (a second one: exit at once)."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Signal handler (main thread; also callable from another thread, as tests do)."""
        if self.drain.draining or self._loop is None:
            print(f"pagoda serve: signal {sig} while draining: exiting now", file=sys.stderr, flush=True)
            os._exit(128 + int(sig))
        self.drain.begin()
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain_then_stop())

    async def _drain_then_stop(self) -> None:
        try:
            await self.drain.run()
        finally:
            self.should_exit = True


def serve(
    app: ASGIApp, drain: Drain, host: str, port: int, log_level: str, limits: HttpLimits | None = None
) -> int:
    """Run ``app`` until drained after SIGTERM/SIGINT: 0, or 1 when the server failed to start
    (``limits``: its connection limits, http_limits.py)."""
    config = uvicorn_config(app, host, port, log_level, limits, timeout_graceful_shutdown=5)
    server = DrainingServer(config, drain)
    server.run()
    return 0 if server.started else 1
