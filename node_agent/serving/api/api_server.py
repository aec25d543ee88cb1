"""The OpenAI-compatible HTTP API (FastAPI): completions, chat completions, models, health, metrics.

``create_app`` builds the app over a Backend: the local engine (``--role both``) or the router
(``--role router``). Every accepted request ends with a result, a final SSE chunk and ``[DONE]``,
or an explicit error; a client that disconnects has its requests aborted (their pages freed).
On SIGTERM the server drains (drain.py): no new requests, the running ones finish or end with an
explicit error at ``--drain-timeout``.

Every answer that is not a success is OpenAI-shaped JSON, whatever failed: API errors, HTTP
errors (404, 405), validation errors and unexpected exceptions (500 ``internal_error``, logged with
the traceback, no internals in the message). With API keys configured, every path but the probes
(/health, /ready, /metrics) needs ``Authorization: Bearer KEY`` and is refused with 401 before
its body is read; the key's tenant salts the prefix cache (see tenancy.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from pagoda.node_agent.serving.api.auth import ApiKeys
from pagoda.node_agent.serving.api.backend import Backend, GenRequest, Handle, StreamChunk
from pagoda.node_agent.serving.api.chat_output import ChatReader
from pagoda.node_agent.serving.api.chat_plan import plan_chat
from pagoda.node_agent.serving.api.drain import CUT_SCOPE_KEY, DEFAULT_DRAIN_TIMEOUT_S, Drain, DrainGate
from pagoda.node_agent.serving.api.errors import ApiError, RequestFailed
from pagoda.node_agent.serving.api.logprobs import Gathered, Shaper
from pagoda.node_agent.serving.api.metrics import ServeMetrics
from pagoda.node_agent.serving.api.prompt_limits import check_prompt_bytes
from pagoda.node_agent.serving.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    new_id,
    now,
    parse_body,
    sse,
    usage,
)
from pagoda.node_agent.serving.api.tenancy import TenantPolicy

log = logging.getLogger("pagoda.api")

SESSION_HEADER = "x-session-affinity"
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})  # probes: never behind API keys
TENANT_SCOPE_KEY = "pagoda.tenant"  # the authenticated tenant, set in the ASGI scope


@dataclass
class ApiSettings:
    """What the API layer needs to know besides its backend."""

    model_names: list[str]  # the first is reported by /v1/models; all are accepted
    tenancy: TenantPolicy
    metrics: ServeMetrics
    max_body_bytes: int = 1 << 20
    max_prompt_bytes: int | None = None  # prompt text, before tokenizing (413); None: the body limit only
    api_keys: ApiKeys | None = None  # None: no authentication
    body_timeout_s: float = 30.0  # to receive a whole request body
    default_max_tokens: int = 16
    default_chat_max_tokens: int = 256
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S  # after SIGTERM (see drain.py)
    extra_routes: list[Callable[[FastAPI], None]] = field(default_factory=list)
    on_startup: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    on_shutdown: list[Callable[[], Awaitable[None]]] = field(default_factory=list)


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def internal_error() -> ApiError:
    return ApiError(
        500, "the server failed to handle the request", code="internal_error", type_="server_error"
    )


def auth_error(reason: str) -> ApiError:
    """401 for a request without a usable API key (``reason``: missing, malformed, unknown)."""
    if reason == "missing":
        msg, code = "missing API key: send 'Authorization: Bearer KEY'", "missing_api_key"
    elif reason == "malformed":
        msg, code = "malformed Authorization header: expected 'Bearer KEY'", "invalid_api_key"
    else:
        msg, code = "incorrect API key provided", "invalid_api_key"
    return ApiError(401, msg, code=code, headers={"WWW-Authenticate": "Bearer"})


class PublicAuth:
    """ASGI middleware: every HTTP request outside OPEN_PATHS needs a known API key; the refusal
    (401, counted in ``pagoda_auth_failures_total{plane="public"}``) comes before the body is read."""

    def __init__(self, app: ASGIApp, keys: ApiKeys, metrics: ServeMetrics) -> None:
        self.app = app
        self.keys = keys
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        result = self.keys.check([v for k, v in scope["headers"] if k == b"authorization"])
        if result.tenant is None:
            self.metrics.auth_failures.labels(self.metrics.pool, "public", result.reason).inc()
            await error_response(auth_error(result.reason))(scope, receive, send)
            return
        scope[TENANT_SCOPE_KEY] = result.tenant
        await self.app(scope, receive, send)


class CatchAll:
    """ASGI middleware: an exception that escapes the app becomes a 500 JSON error (when no
    response has started yet), logged once with its traceback."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watch(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception:
            log.exception("unhandled error serving %s %s", scope.get("method"), scope.get("path"))
            if not started:
                await error_response(internal_error())(scope, receive, send)


def create_app(backend: Backend | None, settings: ApiSettings) -> FastAPI:
    """The app; ``backend`` None serves only health/metrics and the extra routes (prefill/decode pods)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        for hook in settings.on_startup:
            await hook()
        try:
            yield
        finally:
            for hook in settings.on_shutdown:
                with contextlib.suppress(Exception):
                    await hook()

    app = FastAPI(title="pagoda", lifespan=lifespan)
    app.state.settings = settings
    app.state.backend = backend
    metrics = settings.metrics
    if backend is not None:
        settings.on_startup.insert(0, log_tenancy(settings))
        if settings.api_keys is not None:
            app.add_middleware(PublicAuth, keys=settings.api_keys, metrics=metrics)
    app.add_middleware(CatchAll)
    app.state.drain = Drain(metrics, settings.drain_timeout_s)
    app.add_middleware(DrainGate, drain=app.state.drain)  # outermost: refuses before auth while draining

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        if exc.status == 429:
            metrics.outcome("rejected")
        elif 400 <= exc.status < 500:
            metrics.outcome("invalid")
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        kind = "server_error" if exc.status_code >= 500 else "invalid_request_error"
        return error_response(ApiError(exc.status_code, str(exc.detail), None, code, kind, exc.headers))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        where = ".".join(str(x) for x in errors[0]["loc"]) if errors else "body"
        msg = errors[0]["msg"] if errors else "invalid request"
        return error_response(ApiError(400, f"{where}: {msg}", where, "invalid_value"))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error serving %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(internal_error())

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def prom() -> Response:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    for add in settings.extra_routes:
        add(app)

    if backend is None:
        return app

    @app.get("/ready")
    async def ready() -> JSONResponse:
        detail = backend.ready_detail()
        ok = backend.ready
        return JSONResponse({"ready": ok, **detail}, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {"id": settings.model_names[0], "object": "model", "created": now(), "owned_by": "pagoda"}
            ],
        }

    async def body_of(request: Request, kind: type[CompletionRequest | ChatCompletionRequest]) -> Any:
        raw = await read_body(request, settings.max_body_bytes, settings.body_timeout_s)
        req = parse_body(raw, kind)
        check_model(req.model, settings.model_names)
        return req

    def salt_of(request: Request) -> str:
        return settings.tenancy.salt(request.headers, request.scope.get(TENANT_SCOPE_KEY))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req: CompletionRequest = await body_of(request, CompletionRequest)
        max_tokens = req.max_tokens or settings.default_max_tokens
        salt = salt_of(request)
        session = request.headers.get(SESSION_HEADER)
        n = req.choices_per_prompt
        for p in req.prompts():
            check_prompt_bytes(p, settings.max_prompt_bytes, "prompt")
        gens = [
            GenRequest(p, req.sampling(max_tokens, i * n + j), False, salt, session)
            for i, p in enumerate(req.prompts())
            for j in range(n)
        ]
        return await respond(request, backend, gens, req, kind="text_completion", chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        req: ChatCompletionRequest = await body_of(request, ChatCompletionRequest)
        max_tokens = req.requested_max_tokens() or settings.default_chat_max_tokens
        salt = salt_of(request)
        session = request.headers.get(SESSION_HEADER)
        fmt = backend.chat_format()
        plan = plan_chat(req, fmt)
        check_prompt_bytes(plan.prompt, settings.max_prompt_bytes, "messages")
        gens = []
        for j in range(req.choices_per_prompt):
            params = req.sampling(max_tokens, j)
            params.guided = plan.guided
            # a family's tool-call and reasoning markers are often special tokens: keep them in the
            # text its parser reads (the generic envelope is plain JSON)
            params.skip_special_tokens = plan.tool_parser in (None, "generic") and not fmt.reasoning_parser
            gens.append(GenRequest(plan.prompt, params, True, salt, session))
        readers = [ChatReader(plan, fmt) for _ in gens]
        return await respond(request, backend, gens, req, "chat.completion", True, readers, metrics)

    return app


def log_tenancy(settings: ApiSettings) -> Callable[[], Awaitable[None]]:
    async def hook() -> None:
        line = settings.tenancy.describe()
        if settings.tenancy.single_tenant:
            log.warning("%s", line)
        else:
            log.info("%s", line)

    return hook


async def read_body(request: Request, limit: int, timeout_s: float = 30.0) -> bytes:
    """The body, refusing more than ``limit`` bytes with 413 (declared or actual) and a body not
    received within ``timeout_s`` with 408."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise ApiError(
            413, f"request body of {declared} bytes exceeds the limit of {limit} bytes", code="body_too_large"
        )
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise ApiError(
                        413, f"request body exceeds the limit of {limit} bytes", code="body_too_large"
                    )
                chunks.append(chunk)
    except TimeoutError as exc:
        raise ApiError(
            408,
            f"the request body was not received within {timeout_s:g} s",
            code="body_timeout",
            headers={"Connection": "close"},
        ) from exc
    except ClientDisconnect as exc:
        raise ApiError(
            400, "the client disconnected before sending the whole body", code="client_disconnected"
        ) from exc
    return b"".join(chunks)


def check_model(model: str, names: list[str]) -> None:
    if model not in names:
        raise ApiError(
            404,
            f"model: the model {model!r} does not exist; available: {names[0]!r}",
            param="model",
            code="model_not_found",
        )


async def respond(
    request: Request,
    backend: Backend,
    gens: list[GenRequest],
    req: Any,
    kind: str,
    chat: bool,
    readers: list[ChatReader] | None = None,
    metrics: ServeMetrics | None = None,
) -> Response:
    """``readers``: one per chat choice, reading tool calls and reasoning out of its text."""
    handles = await backend.open_all(gens)  # all choices admitted at once, or none
    rid = new_id("chatcmpl" if chat else "cmpl")
    model = req.model
    shaper = Shaper.of(req, gens, chat)  # each choice's text and logprobs in the endpoint's shape
    if req.streaming:
        return StreamingResponse(
            stream_events(
                handles,
                rid,
                model,
                chat,
                req.include_usage(),
                req.choices_per_prompt,
                shaper,
                readers,
                metrics,
                request.scope,
            ),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    return await complete(
        request, handles, rid, model, kind, chat, req.choices_per_prompt, shaper, readers, metrics
    )


async def collect(handle: Handle) -> tuple[str, StreamChunk]:
    text: list[str] = []
    last: StreamChunk | None = None
    lps = Gathered()
    async for chunk in handle:
        text.append(chunk.delta)
        lps.add(chunk)
        last = chunk
    if last is None:
        raise RequestFailed("the request ended without output")
    return "".join(text), lps.onto(last)


async def complete(
    request: Request,
    handles: list[Handle],
    rid: str,
    model: str,
    kind: str,
    chat: bool,
    n: int,
    shaper: Shaper | None = None,
    readers: list[ChatReader] | None = None,
    metrics: ServeMetrics | None = None,
) -> Response:
    """Wait for every choice; a client disconnect aborts them all (one log line, no traceback)."""
    work = asyncio.ensure_future(asyncio.gather(*(collect(h) for h in handles)))
    gone = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # e.g. ended at the drain deadline: stop its work too
        cancel_quietly(work)
        for h in handles:
            h.abort()
        log_early_end(rid, request.scope)
        raise
    finally:
        cancel_quietly(gone)
    if not work.done():
        cancel_quietly(work)
        for h in handles:
            h.abort()
        log.info("request %s: the client disconnected; aborted", rid)
        return Response(status_code=499)
    try:
        results = work.result()
    except Exception as exc:
        for h in handles:
            h.abort()
        if isinstance(exc, RequestFailed):
            raise ApiError(
                500, f"the request failed: {exc}", code="request_failed", type_="server_error"
            ) from exc
        raise
    choices = []
    shaper = shaper or Shaper(chat, [])
    for i, (text, last) in enumerate(results):
        text, lps = shaper.final(i, text, last)
        if chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            reason = last.finish_reason
            if readers is not None:
                reader = readers[i]
                reader.feed(text)
                reader.finish()
                message, reason = reader.message(), reader.finish_reason(last.finish_reason)
                if metrics is not None:
                    reader.record(metrics, last.finish_reason)
            choices.append({"index": i, "message": message, "finish_reason": reason, "logprobs": lps})
        else:
            choices.append({"index": i, "text": text, "finish_reason": last.finish_reason, "logprobs": lps})
    body = {
        "id": rid,
        "object": kind,
        "created": now(),
        "model": model,
        "choices": choices,
        "usage": total_usage([last for _, last in results], n),
    }
    return JSONResponse(body)


def total_usage(lasts: list[StreamChunk], n: int) -> dict[str, Any]:
    """Usage over the choices: each prompt counts once however many choices (``n``) it has."""
    firsts = lasts[:: max(1, n)]
    return usage(
        sum(c.num_prompt_tokens for c in firsts),
        sum(c.num_tokens for c in lasts),
        sum(c.num_cached_tokens for c in firsts),
    )


def chat_events(
    reader: ChatReader, text: str, item: StreamChunk, metrics: ServeMetrics | None
) -> list[tuple[dict[str, Any], str | None]]:
    """(delta parts, finish_reason) of the stream chunks one engine chunk of a chat choice makes
    (``text``: the chunk's new text)."""
    deltas = reader.feed(text) if text else []
    if not item.finished:
        return [(d, None) for d in deltas]
    deltas += reader.finish()
    if metrics is not None:
        reader.record(metrics, item.finish_reason)
    out: list[tuple[dict[str, Any], str | None]] = [(d, None) for d in deltas]
    out.append(({}, reader.finish_reason(item.finish_reason)))
    return out


def _reap(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()  # retrieved: never logged as "exception was never retrieved"


def cancel_quietly(fut: asyncio.Future) -> None:
    """Cancel ``fut`` and retrieve whatever it ends with (a cancelled gather ends with an exception
    that asyncio would otherwise log with a traceback when the future is collected)."""
    fut.cancel()
    fut.add_done_callback(_reap)


def log_early_end(rid: str, scope: Scope | None) -> None:
    """The one line for a request that ended before its response did: cut at the drain deadline,
    or its client went away."""
    if scope is not None and scope.get(CUT_SCOPE_KEY):
        log.warning("request %s: ended at the drain deadline", rid)
    else:
        log.info("request %s: the client disconnected; aborted", rid)


async def wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def stream_events(
    handles: list[Handle],
    rid: str,
    model: str,
    chat: bool,
    include_usage: bool,
    n: int,
    shaper: Shaper | None = None,
    readers: list[ChatReader] | None = None,
    metrics: ServeMetrics | None = None,
    scope: Scope | None = None,
) -> AsyncIterator[bytes]:
    """SSE chunks of every choice, interleaved, then usage (if asked) and ``[DONE]``; an error event
    ends the stream when a choice fails. Closing the generator (client gone, drain cut) aborts them
    all and logs one line (``scope``: the request's, to tell a drain cut from a disconnect)."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    merged: asyncio.Queue[tuple[int, StreamChunk | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, h: Handle) -> None:
        try:
            async for c in h:
                await merged.put((i, c))
            await merged.put((i, None))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # forwarded to the consumer
            await merged.put((i, exc))

    shaper = shaper or Shaper(chat, [])

    def chunk(
        i: int,
        delta: str | None,
        reason: str | None,
        role: bool = False,
        lps: dict | None = None,
        parts: dict | None = None,
    ) -> dict[str, Any]:
        if chat:
            d: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if delta:
                d["content"] = delta
            if parts:
                d.update(parts)
            choice: dict[str, Any] = {"index": i, "delta": d, "finish_reason": reason, "logprobs": lps}
        else:
            choice = {"index": i, "text": delta or "", "finish_reason": reason, "logprobs": lps}
        return {"id": rid, "object": obj, "created": now(), "model": model, "choices": [choice]}

    def failure(exc: BaseException) -> ApiError:
        if isinstance(exc, ApiError):
            return exc
        if isinstance(exc, RequestFailed):
            return ApiError(500, f"the request failed: {exc}", code="request_failed", type_="server_error")
        log.error("stream failed", exc_info=exc)
        return internal_error()

    tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
    open_ = len(handles)
    last: dict[int, StreamChunk] = {}
    failed = False
    try:
        try:
            if chat:
                for i in range(len(handles)):
                    yield sse(chunk(i, None, None, role=True))
            while open_:
                i, item = await merged.get()
                if item is None:
                    open_ -= 1
                    continue
                if isinstance(item, BaseException):
                    failed = True
                    yield sse(failure(item).body())
                    return
                last[i] = item
                text, lps, says = shaper.delta(i, item)  # echo and logprobs (logprobs.py)
                if readers is not None:
                    events = chat_events(readers[i], text, item, metrics)
                    for k, (parts, reason) in enumerate(events):
                        yield sse(chunk(i, None, reason, lps=lps if k == 0 else None, parts=parts))
                    if not events and lps:  # logprobs of tokens whose text is not out yet
                        yield sse(chunk(i, None, None, lps=lps))
                elif says or item.finished:
                    yield sse(chunk(i, text, item.finish_reason if item.finished else None, lps=lps))
            if include_usage:
                lasts = [last[i] for i in sorted(last)]
                yield sse(
                    {
                        "id": rid,
                        "object": obj,
                        "created": now(),
                        "model": model,
                        "choices": [],
                        "usage": total_usage(lasts, n),
                    }
                )
            yield sse("[DONE]")
        except Exception as exc:  # after the headers: the stream ends with an error event, then nothing
            failed = True
            yield sse(failure(exc).body())
    finally:
        for t in tasks:
            t.cancel()
        if failed or open_:
            for h in handles:
                h.abort()
        if open_ and not failed:
            log_early_end(rid, scope)
