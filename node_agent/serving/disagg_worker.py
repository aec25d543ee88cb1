"""The internal endpoints of disaggregated workers (``--role prefill`` and ``--role decode``).

A request crosses them like this (the router drives it):

1. router -> decode ``POST /internal/decode`` {request_id, params}: the decode worker parks the
   request under a ticket and streams NDJSON back; its first line is ``{"kv_address", "ticket"}``.
2. router -> prefill ``POST /internal/prefill`` {prompt, chat, params, cache_salt, kv_address,
   ticket}: the prefill worker computes the prompt's KV (prefill formats), then sends the pages
   over the KV transport (kv_transport.py) to ``kv_address``; the decode worker verifies every
   page's checksum, allocates fresh tagged pages, converts to its KV format and acknowledges.
3. decode -> router: ``{"chunk": ...}`` lines as tokens come, or one ``{"error": ...}`` line.

``GET /internal/state`` reports readiness and free KV capacity for the router's choices;
``GET /ready`` is the pod's readiness probe.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagoda.node_agent.engine.handoff import KVPayload
from pagoda.node_agent.engine.sequence import CapacityError, RequestError, SamplingParams
from pagoda.node_agent.serving.async_engine import AsyncEngine, EngineDead, QueueFull, RequestFailed
from pagoda.node_agent.serving.backend import StreamChunk
from pagoda.node_agent.serving.kv_transport import TcpKVReceiver, TcpKVSender, TransferError
from pagoda.node_agent.serving.local_backend import busy_error, request_error
from pagoda.node_agent.serving.metrics import ServeMetrics
from pagoda.node_agent.serving.protocol import ApiError

log = logging.getLogger("pagoda.disagg")

KV_WAIT_S = 120.0


def params_to_json(p: SamplingParams) -> dict[str, Any]:
    return {
        "max_tokens": p.max_tokens,
        "temperature": p.temperature,
        "top_k": p.top_k,
        "top_p": p.top_p,
        "seed": p.seed,
        "stop": list(p.stop),
        "stop_token_ids": list(p.stop_token_ids),
        "ignore_eos": p.ignore_eos,
    }


def params_from_json(d: dict[str, Any]) -> SamplingParams:
    p = SamplingParams(**{k: d[k] for k in params_to_json(SamplingParams()) if k in d})
    p.validate()
    return p


@dataclass
class _Parked:
    """A decode request waiting for its KV pages."""

    request_id: str
    params: SamplingParams
    payload: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    accepted: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


def default_advertise_host(bind: str) -> str:
    if bind not in ("0.0.0.0", "::", ""):
        return bind
    with contextlib.suppress(OSError):
        return socket.gethostbyname(socket.gethostname())
    return "127.0.0.1"


class DisaggWorker:
    """Prefill or decode side of the handoff, over a local AsyncEngine."""

    def __init__(
        self,
        role: str,
        engine: AsyncEngine,
        metrics: ServeMetrics,
        kv_port: int = 0,
        kv_host: str = "127.0.0.1",
        advertise_host: str | None = None,
    ) -> None:
        self.role = role
        self.engine = engine
        self.metrics = metrics
        self.sender = TcpKVSender()
        self.parked: dict[str, _Parked] = {}
        self.receiver: TcpKVReceiver | None = None
        if role == "decode":
            self.receiver = TcpKVReceiver(
                kv_host,
                kv_port,
                self._on_payload,
                advertise_host or default_advertise_host(kv_host),
                self._on_bad_payload,
            )

    async def start(self) -> None:
        if self.receiver is not None:
            addr = await self.receiver.start()
            log.info("decode worker receives KV pages on %s", addr)

    async def stop(self) -> None:
        if self.receiver is not None:
            await self.receiver.stop()

    # ------------------------------------------------------------------ routes

    def routes(self, app: FastAPI) -> None:
        @app.get("/ready")
        async def ready() -> JSONResponse:
            ok = self.engine.ready and (self.receiver is None or bool(self.receiver.address))
            return JSONResponse({"ready": ok, "role": self.role}, status_code=200 if ok else 503)

        @app.get("/internal/state")
        async def state() -> dict[str, Any]:
            return self.state()

        if self.role == "prefill":

            @app.post("/internal/prefill")
            async def prefill(request: Request) -> JSONResponse:
                return await self.prefill(await request.json(), request)

        else:

            @app.post("/internal/decode")
            async def decode(request: Request) -> StreamingResponse:
                body = await request.json()
                try:
                    params = params_from_json(body.get("params") or {})
                except (RequestError, TypeError) as exc:
                    raise request_error(exc) from exc
                rid = str(body.get("request_id") or uuid.uuid4().hex)
                ticket = uuid.uuid4().hex
                self.parked[ticket] = _Parked(rid, params)
                return StreamingResponse(
                    self._decode_stream(ticket, float(body.get("timeout_s") or KV_WAIT_S)),
                    media_type="application/x-ndjson",
                )

    def state(self) -> dict[str, Any]:
        snap = self.engine.snapshot()
        free = sum((p.num_pages - p.num_used) * p.page_size for p in snap.pools)
        return {
            "role": self.role,
            "ready": self.engine.ready,
            "kv_capacity_tokens": snap.kv_capacity_tokens,
            "kv_free_tokens": free,
            "running": snap.running,
            "waiting": snap.waiting,
            "inflight": self.engine.num_inflight + len(self.parked),
            "kv_address": self.receiver.address if self.receiver else None,
        }

    # ------------------------------------------------------------------ prefill side

    async def prefill(self, body: dict[str, Any], request: Request) -> JSONResponse:
        try:
            params = params_from_json(body.get("params") or {})
            stream = await self.engine.submit(
                body["prompt"],
                params,
                chat=bool(body.get("chat")),
                cache_salt=str(body.get("cache_salt") or ""),
                prefill_only=True,
                request_id=body.get("request_id"),
            )
        except (RequestError, TypeError, KeyError) as exc:
            err = request_error(exc, "messages" if body.get("chat") else "prompt")
            return JSONResponse(err.body(), status_code=err.status)
        except (QueueFull, EngineDead, CapacityError) as exc:
            err = busy_error(exc)
            return JSONResponse(err.body(), status_code=err.status, headers=err.headers)
        try:
            out = await stream.final()
        except RequestFailed as exc:
            return _error(500, f"prefill failed: {exc}", "request_failed")
        except asyncio.CancelledError:
            stream.abort()
            raise
        payload: KVPayload | None = getattr(out, "kv_payload", None)
        if out.finish_reason != "prefilled" or payload is None:
            return JSONResponse({"status": "finished", "chunk": StreamChunk.of(out).to_json()})
        try:
            stats = await self.sender.send(str(body["kv_address"]), str(body["ticket"]), payload)
        except TransferError as exc:
            self.metrics.kv_transfer_failures.labels(self.metrics.pool, "send").inc()
            return _error(502, str(exc), "kv_transfer_failed")
        m = self.metrics
        m.kv_transfer_pages.labels(m.pool, "sent").inc(stats.pages)
        m.kv_transfer_bytes.labels(m.pool, "sent").inc(stats.bytes)
        m.kv_transfer_seconds.labels(m.pool, "sent").observe(stats.seconds)
        return JSONResponse(
            {
                "status": "handed_off",
                "num_prompt_tokens": len(out.prompt_token_ids),
                "num_cached_tokens": out.num_cached_tokens,
                "pages": stats.pages,
            }
        )

    # ------------------------------------------------------------------ decode side

    async def _on_payload(self, ticket: str, payload: KVPayload) -> None:
        parked = self.parked.get(ticket)
        if parked is None or parked.payload.done():
            raise TransferError(f"no decode request waits for ticket {ticket}")
        m = self.metrics
        m.kv_transfer_pages.labels(m.pool, "received").inc(payload.num_pages)
        parked.payload.set_result(payload)
        await asyncio.wait_for(asyncio.shield(parked.accepted), 30)  # raises the engine's refusal

    def _on_bad_payload(self, error: str, ticket: str | None) -> None:
        self.metrics.kv_transfer_failures.labels(self.metrics.pool, "receive").inc()
        parked = self.parked.get(ticket or "")
        if parked is not None and not parked.payload.done():
            parked.payload.set_exception(TransferError(error))

    async def _decode_stream(self, ticket: str, wait_s: float) -> AsyncIterator[bytes]:
        parked = self.parked[ticket]
        stream = None
        try:
            yield _line({"kv_address": self.receiver.address if self.receiver else "", "ticket": ticket})
            try:
                payload = await asyncio.wait_for(parked.payload, wait_s)
            except TimeoutError:
                yield _line(_error_body(504, f"no KV pages arrived within {wait_s:.0f}s", "kv_timeout"))
                return
            except TransferError as exc:
                yield _line(_error_body(502, f"KV handoff failed: {exc}", "kv_transfer_failed"))
                return
            try:
                stream = await self.engine.submit_prefilled(
                    payload, parked.params, request_id=parked.request_id
                )
            except Exception as exc:
                parked.accepted.set_exception(exc)
                err = busy_error(exc) if isinstance(exc, QueueFull | EngineDead) else _api(exc)
                yield _line(err.body())
                return
            parked.accepted.set_result(True)
            try:
                async for out in stream:
                    yield _line({"chunk": StreamChunk.of(out).to_json()})
            except RequestFailed as exc:
                yield _line(_error_body(500, f"the request failed: {exc}", "request_failed"))
        finally:
            self.parked.pop(ticket, None)
            if not parked.accepted.done():
                parked.accepted.set_exception(RequestFailed("the decode request went away"))
                parked.accepted.exception()  # retrieved: a late payload's handler may never ask
            if stream is not None:
                stream.abort()  # no-op when finished; frees the pages when the router went away


def _api(exc: Exception) -> ApiError:
    if isinstance(exc, CapacityError):
        return busy_error(exc)
    if isinstance(exc, RequestError):
        return request_error(exc)
    return ApiError(500, f"{type(exc).__name__}: {exc}", code="request_failed", type_="server_error")


def _error_body(status: int, message: str, code: str) -> dict[str, Any]:
    return {
        "error": {"message": message, "type": "server_error", "param": None, "code": code, "status": status}
    }


def _error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse(_error_body(status, message, code), status_code=status)


def _line(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, separators=(",", ":")) + "\n").encode()
