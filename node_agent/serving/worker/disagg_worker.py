"""The internal endpoints of disaggregated workers (``--role prefill`` and ``--role decode``).

A request crosses them like this (the router drives it):

1. router -> decode ``POST /internal/decode`` {request_id, params, timeout_s}: the decode worker
   parks the request under a ticket and streams NDJSON back; its first line is
   ``{"kv_address", "ticket", "grant"}`` (grant: internal_auth.InternalAuth.grant of both).
2. router -> prefill ``POST /internal/prefill`` {prompt, chat, params, cache_salt, request_id,
   kv_address, ticket, grant}: the prefill worker checks the grant (403 otherwise: pages only go
   where a decode worker asked for them), computes the prompt's KV (prefill formats), then sends
   the pages over the KV transport (kv_transport.py) to ``kv_address``; the decode worker checks
   the header's MAC, claims the ticket (once), checks every field against its limits, verifies
   every page's checksum, allocates fresh tagged pages, converts to its KV format and acknowledges.
3. decode -> router: ``{"chunk": ...}`` lines as tokens come, or one ``{"error": ...}`` line (a
   failed handoff fails the parked request at once; no pages within its timeout: ``kv_timeout``).

Every ``/internal/*`` request must prove the internal token (401 missing, 403 wrong; checked
before the body is read); bodies are validated (400 JSON). ``GET /internal/state`` reports
readiness and free KV capacity for the router's choices; ``GET /ready`` is the pod's readiness
probe and needs no token.
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
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagoda.node_agent.engine.handoff import KVPayload
from pagoda.node_agent.params import CapacityError, RequestError, SamplingParams, params_from_json
from pagoda.node_agent.serving.api.api_server import read_body
from pagoda.node_agent.serving.api.backend import ChatFormat, StreamChunk
from pagoda.node_agent.serving.api.errors import RETRY_AFTER_S, ApiError, RequestFailed, request_error
from pagoda.node_agent.serving.api.internal_auth import InternalAuth
from pagoda.node_agent.serving.api.metrics import ServeMetrics
from pagoda.node_agent.serving.worker.async_engine import AsyncEngine, EngineDead, QueueFull
from pagoda.node_agent.serving.worker.kv_limits import KVLimits
from pagoda.node_agent.serving.worker.kv_transport import TcpKVReceiver, TcpKVSender, TransferError
from pagoda.node_agent.serving.worker.local_backend import busy_error, retry_after
from pagoda.node_agent.serving.worker.queue_deadline import QueueTimeout

log = logging.getLogger("pagoda.disagg")

KV_WAIT_S = 120.0
MAX_ID_CHARS = 256


# JSON types of the sampling parameters on the internal plane (bool is no int here)
def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


def _opt(body: dict[str, Any], key: str, types: tuple[type, ...], default: Any = None) -> Any:
    """An optional field of a checked JSON type (bool is never an int here)."""
    v = body.get(key, default)
    if v is not default and type(v) not in types:
        raise _bad(f"{key} has the wrong JSON type ({type(v).__name__})", key)
    return v


def _req_str(body: dict[str, Any], key: str, max_chars: int = MAX_ID_CHARS) -> str:
    v = body.get(key)
    if type(v) is not str or not 1 <= len(v) <= max_chars:
        raise _bad(f"{key} must be a string of 1..{max_chars} characters", key)
    return v


MESSAGE_KEYS = {
    "role": (str,),
    "content": (str,),
    "name": (str,),
    "tool_call_id": (str,),
    "tool_calls": (list,),
}


def _is_messages(x: Any) -> bool:
    """Chat messages as the router sends them: ``[{"role": str, "content": str, ...}, ...]``
    (tool calls and tool results too), or ``{"messages": [...], "tools": [...]}``."""
    if type(x) is dict and set(x) == {"messages", "tools"} and type(x["tools"]) is list:
        return _is_messages(x["messages"]) and all(type(t) is dict for t in x["tools"])
    return (
        type(x) is list
        and bool(x)
        and all(
            type(m) is dict
            and {"role", "content"} <= set(m)
            and all(k in MESSAGE_KEYS and type(v) in MESSAGE_KEYS[k] for k, v in m.items())
            for m in x
        )
    )


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


async def json_object(request: Request, limit: int) -> dict[str, Any]:
    """The request body as a JSON object (413 beyond ``limit`` bytes, 400 when not an object)."""
    raw = await read_body(request, limit)
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise ApiError(400, f"the body is not valid JSON: {str(exc)[:200]}", code="invalid_json") from exc
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    return body


@dataclass
class _Parked:
    """A decode request waiting for its KV pages."""

    request_id: str
    params: SamplingParams
    claimed: bool = False  # a handoff presented this ticket (it is single-use)
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
        auth: InternalAuth,
        kv_port: int = 0,
        kv_host: str = "127.0.0.1",
        advertise_host: str | None = None,
        max_body_bytes: int = 1 << 20,
        kv_frame_timeout_s: float = 10.0,
        kv_deadline_s: float = 60.0,
        kv_max_handoffs: int = 8,
        chat_format: ChatFormat | None = None,
        kv_limits: dict[str, Any] | None = None,
    ) -> None:
        self.role = role
        self.chat_format = chat_format or ChatFormat()  # reported to the router, which parses replies
        self.engine = engine
        self.metrics = metrics
        self.auth = auth
        self.max_body_bytes = 2 * max_body_bytes + (64 << 10)  # the router re-encodes the prompt
        self.sender = TcpKVSender(auth)
        self.parked: dict[str, _Parked] = {}
        self.receiver: TcpKVReceiver | None = None
        if role == "decode":
            limits = KVLimits.for_engine(
                engine.engine,
                frame_timeout_s=kv_frame_timeout_s,
                handoff_deadline_s=kv_deadline_s,
                max_handoffs=kv_max_handoffs,
                **(kv_limits or {}),  # the connection caps, auth deadline, value bound (kv_limits.py)
            )
            self.receiver = TcpKVReceiver(
                kv_host,
                kv_port,
                self._on_payload,
                auth,
                limits,
                self._claim,
                advertise_host or default_advertise_host(kv_host),
                self._on_bad_payload,
                self._on_kv_auth_failure,
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
        async def state(request: Request) -> JSONResponse:
            if (refusal := self.auth.refuse(request, self.metrics)) is not None:
                return refusal
            return JSONResponse(self.state())

        if self.role == "prefill":

            @app.post("/internal/prefill")
            async def prefill(request: Request) -> JSONResponse:
                if (refusal := self.auth.refuse(request, self.metrics)) is not None:
                    return refusal
                return await self.prefill(await json_object(request, self.max_body_bytes), request)

        else:

            @app.post("/internal/decode")
            async def decode(request: Request) -> Response:
                if (refusal := self.auth.refuse(request, self.metrics)) is not None:
                    return refusal
                body = await json_object(request, self.max_body_bytes)
                try:
                    params = params_from_json(_opt(body, "params", (dict,), {}))
                except RequestError as exc:
                    raise request_error(exc) from exc
                rid = _opt(body, "request_id", (str,)) or uuid.uuid4().hex
                if len(rid) > MAX_ID_CHARS:
                    raise _bad(f"request_id must have at most {MAX_ID_CHARS} characters", "request_id")
                wait = _opt(body, "timeout_s", (int, float)) or KV_WAIT_S
                if not 0 < wait <= KV_WAIT_S:
                    raise _bad(f"timeout_s must be in (0, {KV_WAIT_S:.0f}]", "timeout_s")
                ticket = uuid.uuid4().hex
                self.parked[ticket] = _Parked(rid, params)
                return StreamingResponse(
                    self._decode_stream(ticket, float(wait)), media_type="application/x-ndjson"
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
            "max_sequences": self.engine.engine.config.max_num_seqs,
            "inflight": self.engine.num_inflight + len(self.parked),
            "kv_address": self.receiver.address if self.receiver else None,
            "chat_format": self.chat_format.to_json(),
            "kv_receiver": self.receiver.counts() if self.receiver else None,
        }

    # ------------------------------------------------------------------ prefill side

    async def prefill(self, body: dict[str, Any], request: Request) -> JSONResponse:
        # the grant first: pages only go to a decode worker that asked for them under this ticket
        ticket, kv_address = _req_str(body, "ticket"), _req_str(body, "kv_address")
        grant = body.get("grant")
        if type(grant) is not str or not self.auth.check_grant(ticket, kv_address, grant):
            m = self.metrics
            m.auth_failures.labels(m.pool, "internal", "bad_grant").inc()
            err = ApiError(
                403,
                "the decode worker's grant for this ticket and kv_address is missing or wrong",
                param="grant",
                code="bad_grant",
                type_="authentication_error",
            )
            return JSONResponse(err.body(), status_code=403)
        chat = _opt(body, "chat", (bool,), False)
        salt = _opt(body, "cache_salt", (str,), "")
        rid = _opt(body, "request_id", (str,))
        if rid is not None and not 1 <= len(rid) <= MAX_ID_CHARS:
            raise _bad(f"request_id must be a string of 1..{MAX_ID_CHARS} characters", "request_id")
        prompt = body.get("prompt")
        if chat and not _is_messages(prompt):
            raise _bad("messages must be a non-empty list of {role, content, ...} objects", "messages")
        if not chat and type(prompt) not in (str, list):
            raise _bad("prompt must be a string or a list of token ids", "prompt")
        try:
            params = params_from_json(_opt(body, "params", (dict,), {}))
            stream = await self.engine.submit(
                prompt, params, chat=chat, cache_salt=salt, prefill_only=True, request_id=rid
            )
        except (RequestError, TypeError, KeyError, ValueError) as exc:
            err = request_error(exc, "messages" if chat else "prompt")
            return JSONResponse(err.body(), status_code=err.status)
        except (QueueFull, EngineDead, CapacityError) as exc:
            err = busy_error(exc)
            return JSONResponse(err.body(), status_code=err.status, headers=err.headers)
        except Exception as exc:  # still a JSON answer
            log.exception("prefill submit failed")
            return _error(500, f"prefill failed: {type(exc).__name__}: {exc}"[:500], "request_failed")
        try:
            out = await stream.final()
        except QueueTimeout as exc:  # the router passes it on as it is: 503, Retry-After
            body = _error_body(503, str(exc), "queue_timeout")
            return JSONResponse(body, status_code=503, headers={"Retry-After": retry_after(exc)})
        except RequestFailed as exc:
            return _error(500, f"prefill failed: {exc}", "request_failed")
        except asyncio.CancelledError:
            stream.abort()
            raise
        payload: KVPayload | None = getattr(out, "kv_payload", None)
        if out.finish_reason != "prefilled" or payload is None:
            return JSONResponse({"status": "finished", "chunk": StreamChunk.of(out).to_json()})
        try:
            stats = await self.sender.send(kv_address, ticket, payload)
        except TransferError as exc:
            self.metrics.kv_transfer_failures.labels(self.metrics.pool, "send").inc()
            if exc.reason == "busy":  # the decode worker has no room now: the client may retry
                err = ApiError(
                    429,
                    f"the decode worker is full ({exc}); retry later",
                    code="decode_full",
                    type_="rate_limit_error",
                    headers={"Retry-After": str(RETRY_AFTER_S)},
                )
                return JSONResponse(err.body(), status_code=429, headers=err.headers)
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
                **_lead(out),
            }
        )

    # ------------------------------------------------------------------ decode side

    def _claim(self, ticket: str) -> str | None:
        """Claim a parked ticket for one handoff: None, or "unknown" / "replayed"."""
        parked = self.parked.get(ticket)
        if parked is None:
            return "unknown"
        if parked.claimed:
            return "replayed"
        parked.claimed = True
        return None

    async def _on_payload(self, ticket: str, payload: KVPayload) -> None:
        parked = self.parked.get(ticket)
        if parked is None or parked.payload.done():
            raise TransferError(f"no decode request waits for ticket {ticket}", "refused")
        m = self.metrics
        m.kv_transfer_pages.labels(m.pool, "received").inc(payload.num_pages)
        parked.payload.set_result(payload)
        try:
            await asyncio.wait_for(asyncio.shield(parked.accepted), 30)  # raises the engine's refusal
        except (CapacityError, QueueFull) as exc:
            raise TransferError(str(exc), "busy") from exc

    def _on_bad_payload(self, reason: str, error: str, ticket: str | None) -> None:
        """A refused handoff: counted; the request parked under a claimed ticket fails at once."""
        self.metrics.kv_transfer_failures.labels(self.metrics.pool, reason).inc()
        parked = self.parked.get(ticket or "")
        if parked is not None and not parked.payload.done():
            parked.payload.set_exception(TransferError(error, reason))

    def _on_kv_auth_failure(self, reason: str) -> None:
        self.metrics.auth_failures.labels(self.metrics.pool, "kv", reason).inc()

    async def _decode_stream(self, ticket: str, wait_s: float) -> AsyncIterator[bytes]:
        parked = self.parked[ticket]
        stream = None
        try:
            addr = self.receiver.address if self.receiver else ""
            yield _line({"kv_address": addr, "ticket": ticket, "grant": self.auth.grant(ticket, addr)})
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
            except QueueTimeout as exc:  # the router ends the client's request with this error
                body = _error_body(503, str(exc), "queue_timeout")
                body["error"]["retry_after_s"] = exc.retry_after_s
                yield _line(body)
            except RequestFailed as exc:
                yield _line(_error_body(500, f"the request failed: {exc}", "request_failed"))
        finally:
            self.parked.pop(ticket, None)
            if not parked.accepted.done():
                parked.accepted.set_exception(RequestFailed("the decode request went away"))
                parked.accepted.exception()  # retrieved: a late payload's handler may never ask
            if stream is not None:
                stream.abort()  # no-op when finished; frees the pages when the router went away


def _lead(out) -> dict[str, Any]:
    """What the router prepends to the decode worker's stream: the first token's logprobs entry
    (sampled here) and the prompt logprobs, when the request asked (docs/logprobs.md)."""
    keys = ("logprobs", "prompt_logprobs", "prompt_text")
    return {k: getattr(out, k) for k in keys if getattr(out, k, None) is not None}


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
