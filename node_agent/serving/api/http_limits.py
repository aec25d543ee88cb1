"""Connection-level limits of every ``pagoda serve`` HTTP server (router, both, prefill, decode).

uvicorn's own settings carry the keep-alive idle limit (``timeout_keep_alive``) and the largest
request head (``h11_max_incomplete_event_size``). What it lacks is added by ``GuardedH11``, its
h11 protocol with three more rules, all applied before any byte reaches the app (so before the
API key is checked):

- **head timeout**: a connection must deliver a whole request head within ``head_timeout_s`` of
  opening, and of the end of its previous response; otherwise it gets a 408 and is closed (a
  partial head or silence no longer holds a connection open);
- **per-client cap**: at most ``max_connections_per_client`` open connections per peer address;
- **total cap**: at most ``max_connections`` open connections in all.

A connection over a cap is answered 503 at once and closed. Request bodies are timed by the API
layer (``--body-timeout``, a 408). The limits are set by ``--http-*`` flags (docs/serving.md).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("pagoda.http")

TIMEOUT_RESPONSE = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
BUSY_RESPONSE = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nretry-after: 1\r\nconnection: close\r\n\r\n"
)


@dataclass
class HttpLimits:
    """The connection limits of one server (``None`` for a cap: none)."""

    head_timeout_s: float = 10.0  # a whole request head, from connect or the previous response
    keep_alive_s: float = 5.0  # an idle keep-alive connection is closed after this
    max_head_bytes: int = 64 << 10  # request line + headers
    max_connections: int | None = 4096
    max_connections_per_client: int | None = 256

    def __post_init__(self) -> None:
        for name in ("head_timeout_s", "keep_alive_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("max_head_bytes", "max_connections", "max_connections_per_client"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")


@dataclass
class ConnectionCounts:
    """Open connections, per peer address and in all (event-loop thread only)."""

    limits: HttpLimits
    per_client: Counter[str] = field(default_factory=Counter)
    total: int = 0
    refused: int = 0
    timed_out: int = 0

    def admit(self, peer: str) -> bool:
        lim = self.limits
        if lim.max_connections is not None and self.total >= lim.max_connections:
            return False
        cap = lim.max_connections_per_client
        if cap is not None and self.per_client[peer] >= cap:
            return False
        self.per_client[peer] += 1
        self.total += 1
        return True

    def release(self, peer: str) -> None:
        self.total -= 1
        self.per_client[peer] -= 1
        if self.per_client[peer] <= 0:
            del self.per_client[peer]


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with a request-head timeout and connection caps (``counts``: set on
    the subclass ``guarded_protocol`` makes)."""

    counts: ConnectionCounts

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._peer = ""
        self._admitted = False
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._peer = self.client[0] if self.client else ""
        if not self.counts.admit(self._peer):
            self.counts.refused += 1
            log.info("refused a connection from %s: connection cap reached", self._peer or "?")
            transport.write(BUSY_RESPONSE)
            transport.close()
            return
        self._admitted = True
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        if self._admitted:
            self._admitted = False
            self.counts.release(self._peer)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._admitted:
            return
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # a whole head arrived
            self._disarm_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm_head_timer()  # the next request's head has the same deadline

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        self._head_timer = self.loop.call_later(self.counts.limits.head_timeout_s, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        self.counts.timed_out += 1
        log.info(
            "closed a connection from %s: no request head within %g s",
            self._peer or "?",
            self.counts.limits.head_timeout_s,
        )
        self.transport.write(TIMEOUT_RESPONSE)
        self.transport.close()


def guarded_protocol(limits: HttpLimits) -> type[GuardedH11]:
    """A protocol class for ``uvicorn.Config(http=...)``, with its own connection counts."""
    return type("GuardedH11Server", (GuardedH11,), {"counts": ConnectionCounts(limits)})


def uvicorn_config(
    app: Any, host: str, port: int, log_level: str, limits: HttpLimits | None = None, **kw: Any
) -> uvicorn.Config:
    """The uvicorn config every ``pagoda serve`` server runs with: its limits applied."""
    limits = limits or HttpLimits()
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=guarded_protocol(limits),
        timeout_keep_alive=limits.keep_alive_s,  # type: ignore[arg-type]  # a float works (call_later)
        h11_max_incomplete_event_size=limits.max_head_bytes,
        **kw,
    )
