"""The router (``--role router``): the OpenAI API in front of prefill and decode workers.

Workers are static URLs (``--prefill-endpoints``/``--decode-endpoints``) and/or every address of
DNS names (``--prefill-dns``/``--decode-dns``, e.g. headless Services: one worker per pod),
re-resolved every ``--dns-refresh-seconds`` in the background (discovery.py): a pod that leaves
DNS is dropped (its requests in flight finish), a new one is polled and joins.

For each request it picks a decode worker (session affinity, then the most free KV capacity) and
opens its token stream, then picks a prefill worker (session affinity, then the longest prefix the
router has sent it before, then the lightest load) and asks it to prefill and hand the KV pages to
that decode worker; tokens stream back through the router. Session affinity is rendezvous hashing
of the ``x-session-affinity`` key over the ready workers of the role (hashing.py): router replicas
that see the same workers agree without sharing state, and a worker leaving moves only its own
sessions. A worker that fails a health poll or a request is skipped until its ``/internal/state``
answers ready again; one that is draining or cannot be connected to (nothing was sent) is retried
on another worker of its role; clients whose stream breaks get an error event at once.

Every internal call carries the internal token's proof (internal_auth.py); the decode worker's
grant for its ticket is forwarded to the prefill worker. ``open_all`` admits a request's choices
together: more than ``max_inflight`` at once is a 400, more than the room left now a 429.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from pagoda.node_agent.params import params_to_json
from pagoda.node_agent.serving.api.backend import ChatFormat, GenRequest, StreamChunk
from pagoda.node_agent.serving.api.errors import RETRY_AFTER_S, ApiError, RequestFailed
from pagoda.node_agent.serving.api.internal_auth import InternalAuth
from pagoda.node_agent.serving.api.metrics import ServeMetrics
from pagoda.node_agent.serving.router import hashing
from pagoda.node_agent.serving.router.discovery import DnsTarget, DnsWatch, Resolver, resolve
from pagoda.node_agent.serving.router.protocol_metrics import RouterProtocolCollector

log = logging.getLogger("pagoda.router")

PREFIX_CHUNK_CHARS = 64
PREFIX_INDEX_SIZE = 65536
ATTEMPTS = 3  # workers of one role tried for one request (draining or unreachable ones are skipped)
RULES = ("affinity", "prefix", "capacity", "load")


@dataclass
class RouterSettings:
    prefill: list[str]
    decode: list[str]
    session_affinity: bool = True
    prefix_aware: bool = True
    health_interval_s: float = 1.0
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 120.0
    max_inflight: int = 256  # requests (choices) open through this router at once
    prefill_dns: list[DnsTarget] = field(default_factory=list)
    decode_dns: list[DnsTarget] = field(default_factory=list)
    dns_refresh_s: float = 5.0
    tool_call_parser: str | None = None  # overrides the workers' (None or "auto": theirs)
    reasoning_parser: str | None = None  # "none": no reasoning separation; else the workers'
    model_name: str = ""  # the served model name: model_name of the protocol metrics on /metrics


@dataclass
class Worker:
    url: str
    role: str
    ready: bool = False
    kv_free_tokens: int = 0
    kv_capacity_tokens: int = 0  # these three: its own report, for the protocol metrics
    running: int = 0
    waiting: int = 0
    max_sequences: int = 0  # decode: sequences it decodes at once (0: not reported)
    reported_inflight: int = 0  # requests on it as it last reported (all routers)
    inflight: int = 0  # requests this router has on it now
    prefixes: OrderedDict[bytes, None] = field(default_factory=OrderedDict)

    def mark_down(self, why: str) -> None:
        if self.ready:
            log.warning("%s worker %s is down: %s", self.role, self.url, why)
        self.ready = False


def prefix_keys(req: GenRequest) -> list[bytes]:
    """Chained hashes of the prompt's full 64-character chunks, salted by the tenant."""
    p = req.prompt
    text = p if isinstance(p, str) else json.dumps(p, separators=(",", ":"))
    h = hashlib.blake2b(b"router:" + req.cache_salt.encode(), digest_size=12).digest()
    out = []
    for i in range(0, len(text) - PREFIX_CHUNK_CHARS + 1, PREFIX_CHUNK_CHARS):
        h = hashlib.blake2b(h + text[i : i + PREFIX_CHUNK_CHARS].encode(), digest_size=12).digest()
        out.append(h)
    return out


class Router:
    """A Backend for the API server that generates through prefill and decode workers."""

    def __init__(
        self,
        settings: RouterSettings,
        metrics: ServeMetrics,
        auth: InternalAuth,
        resolver: Resolver = resolve,
    ) -> None:
        for role, urls, names in (
            ("prefill", settings.prefill, settings.prefill_dns),
            ("decode", settings.decode, settings.decode_dns),
        ):
            if not urls and not names:
                raise ValueError(f"the router needs --{role}-endpoints or --{role}-dns")
        if not settings.dns_refresh_s > 0:
            raise ValueError(f"--dns-refresh-seconds must be > 0, got {settings.dns_refresh_s}")
        self.settings = settings
        self.metrics = metrics
        self.auth = auth
        self.inflight = 0  # admitted choices not yet finished
        self.static = {
            "prefill": list(dict.fromkeys(u.rstrip("/") for u in settings.prefill)),
            "decode": list(dict.fromkeys(u.rstrip("/") for u in settings.decode)),
        }
        self.prefill = [Worker(u, "prefill") for u in self.static["prefill"]]
        self.decode = [Worker(u, "decode") for u in self.static["decode"]]
        names = {"prefill": settings.prefill_dns, "decode": settings.decode_dns}
        self.dns = DnsWatch(names, self._dns_error, resolver) if any(names.values()) else None
        for role, targets in names.items():
            for t in targets:
                metrics.dns_errors.labels(metrics.pool, role, str(t))
        self._chat_format = ChatFormat()  # until a prefill worker reports its own
        self._client: httpx.AsyncClient | None = None
        self._health: asyncio.Task | None = None
        self._discovery: asyncio.Task | None = None
        metrics.worker_ready.source = lambda: {(w.url, w.role): w.ready for w in self.prefill + self.decode}
        metrics.registry.register(RouterProtocolCollector(self, settings.model_name))

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        s = self.settings
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(s.read_timeout_s, connect=s.connect_timeout_s),
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256),
        )
        await self.poll()
        await self.discover()
        self._health = asyncio.create_task(self._health_loop(), name="pagoda-router-health")
        if self.dns is not None:
            self._discovery = asyncio.create_task(self._dns_loop(), name="pagoda-router-dns")

    async def stop(self) -> None:
        for task in (self._health, self._discovery):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._client is not None:
            await self._client.aclose()

    async def _dns_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.dns_refresh_s)
            try:
                await self.discover()
            except Exception:
                log.exception("worker discovery failed")

    async def discover(self) -> None:
        """Re-resolve the DNS names: workers that left are dropped (requests in flight on them finish),
        new ones are polled once and join with a fresh state; static URLs always stay."""
        if self.dns is None:
            return
        found = await self.dns.refresh()
        for role in ("prefill", "decode"):
            current: list[Worker] = getattr(self, role)
            want = list(dict.fromkeys(self.static[role] + sorted(found[role])))
            have = {w.url: w for w in current}
            new = {u: Worker(u, role) for u in want if u not in have}
            if new:
                await asyncio.gather(*(self._poll_one(w) for w in new.values()))
                for w in new.values():
                    log.info("%s worker %s joined (DNS); ready: %s", role, w.url, w.ready)
            keep = set(want)
            for w in current:
                if w.url not in keep:
                    log.info("%s worker %s left DNS: dropped (its requests in flight finish)", role, w.url)
                    self._forget(w)
            setattr(self, role, [have.get(u) or new[u] for u in want])

    def _forget(self, w: Worker) -> None:
        """Drop a departed worker's per-worker metric series (pod addresses come and go)."""
        m = self.metrics
        for rule in RULES:
            with contextlib.suppress(KeyError):
                m.routed.remove(m.pool, w.url, rule)

    def _dns_error(self, role: str, target: DnsTarget, exc: Exception) -> None:
        known = len(self.dns.known.get((role, target), ())) if self.dns is not None else 0
        log.warning(
            "%s DNS name %s did not resolve (%r); keeping its last %d address(es)", role, target, exc, known
        )
        m = self.metrics
        m.dns_errors.labels(m.pool, role, str(target)).inc()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.health_interval_s)
            with contextlib.suppress(Exception):
                await self.poll()

    async def poll(self) -> None:
        await asyncio.gather(*(self._poll_one(w) for w in self.prefill + self.decode))

    async def _poll_one(self, w: Worker) -> None:
        assert self._client is not None
        try:
            r = await self._send("GET", w.url + "/internal/state", timeout=2.0)
            if r.status_code in (401, 403):
                w.mark_down(f"it refused the internal token ({r.status_code}): check the shared token")
            if _draining(r.status_code, r.content):
                w.mark_down("it is draining (shutting down)")
            state = r.json() if r.status_code == 200 else {}
        except (httpx.HTTPError, ValueError) as exc:
            w.mark_down(repr(exc))
            state = None
        if state is not None:
            ok = bool(state.get("ready"))
            if ok and not w.ready:
                log.info("%s worker %s is ready", w.role, w.url)
            if not ok:
                w.mark_down("not ready")
            w.ready = ok
            w.kv_free_tokens = _count(state.get("kv_free_tokens"))
            w.kv_capacity_tokens = _count(state.get("kv_capacity_tokens"))
            w.running, w.waiting = _count(state.get("running")), _count(state.get("waiting"))
            w.max_sequences = _count(state.get("max_sequences"))
            w.reported_inflight = _count(state.get("inflight"))
            if w.role == "prefill" and "chat_format" in state:  # prefill workers render the template
                self._chat_format = ChatFormat.from_json(state["chat_format"])

    # ------------------------------------------------------------------ Backend

    @property
    def ready(self) -> bool:
        return any(w.ready for w in self.prefill) and any(w.ready for w in self.decode)

    def chat_format(self) -> ChatFormat:
        """The workers' chat format (--tool-call-parser / --reasoning-parser here override it)."""
        fmt = self._chat_format
        o = self.settings
        if o.tool_call_parser not in (None, "auto"):
            fmt = dataclasses.replace(fmt, tool_parser=o.tool_call_parser)
        if o.reasoning_parser == "none":
            fmt = dataclasses.replace(fmt, reasoning_parser=None, reasoning_open=False)
        elif o.reasoning_parser not in (None, "auto"):
            fmt = dataclasses.replace(fmt, reasoning_parser=o.reasoning_parser)
        return fmt

    def ready_detail(self) -> dict[str, Any]:
        return {
            "prefill": {w.url: w.ready for w in self.prefill},
            "decode": {w.url: w.ready for w in self.decode},
        }

    def _pick(
        self,
        workers: list[Worker],
        role: str,
        req: GenRequest,
        keys: list[bytes] | None,
        skip: frozenset[str] | set[str] = frozenset(),
    ) -> tuple[Worker, str]:
        """A ready worker not in ``skip`` (URLs already tried for this request), and the rule that chose it."""
        ready = [w for w in workers if w.ready and w.url not in skip]
        if not ready:
            raise retry_later(
                503,
                f"no {role} worker is ready; retry later",
                "no_worker",
            )
        if self.settings.session_affinity and req.session:
            return hashing.pick(req.session, ready, lambda w: w.url), "affinity"
        if keys:
            best, depth = None, 0
            for w in ready:
                n = 0
                for k in keys:
                    if k not in w.prefixes:
                        break
                    n += 1
                if n > depth or (n == depth and best is not None and n and w.inflight < best.inflight):
                    best, depth = w, n
            if best is not None and depth:
                return best, "prefix"
        if role == "decode":
            return max(ready, key=lambda w: (w.kv_free_tokens - 64 * w.inflight, -w.inflight)), "capacity"
        return min(ready, key=lambda w: w.inflight), "load"

    def _remember(self, w: Worker, keys: list[bytes] | None) -> None:
        """The prompt prefixes now cached on prefill worker ``w``."""
        for k in keys or []:
            w.prefixes[k] = None
            w.prefixes.move_to_end(k)
        while len(w.prefixes) > PREFIX_INDEX_SIZE:
            w.prefixes.popitem(last=False)

    def _signed(self, method: str, url: str, **kw: Any) -> httpx.Request:
        """A request to a worker carrying the internal token's proof."""
        assert self._client is not None, "router not started"
        req = self._client.build_request(method, url, **kw)
        req.headers.update(self.auth.headers(method, req.url.path))
        return req

    async def _send(self, method: str, url: str, stream: bool = False, **kw: Any) -> httpx.Response:
        assert self._client is not None, "router not started"
        return await self._client.send(self._signed(method, url, **kw), stream=stream)

    def _admit(self, n: int) -> None:
        """Take ``n`` slots of ``max_inflight`` at once, or refuse them all."""
        limit = self.settings.max_inflight
        if n > limit:
            raise ApiError(
                400,
                f"n: {n} choices are more than this server runs at once ({limit})",
                param="n",
                code="too_many_choices",
            )
        if self.inflight + n > limit:
            raise retry_later(
                429,
                f"the server is busy ({self.inflight} of {limit} requests in flight); retry later",
                "queue_full",
            )
        room = self._decode_room()
        if room is not None and n > room:
            raise retry_later(
                429,
                f"the decode workers have room for {room} more sequences now and this request needs "
                f"{n}; retry later",
                "decode_full",
            )
        self.inflight += n

    def _decode_room(self) -> int | None:
        """Sequences the ready decode workers can still take (None: unknown, e.g. none ready yet; the
        pick answers that). A decode worker refuses a handoff beyond its --max-num-seqs, so a request
        that cannot fit is refused here, before any prefill work."""
        ready = [w for w in self.decode if w.ready]
        if not ready or any(w.max_sequences <= 0 for w in ready):
            return None
        return sum(max(0, w.max_sequences - max(w.inflight, w.reported_inflight)) for w in ready)

    def _release(self) -> None:
        self.inflight -= 1

    async def open_all(self, reqs: list[GenRequest]) -> list[RouterHandle]:
        """Open every choice of one API request, or none: admitted together before any work, a
        failure aborts the ones already opened."""
        self._admit(len(reqs))
        handles: list[RouterHandle] = []
        try:
            for r in reqs:
                handles.append(await self._open(r))
        except BaseException:
            for h in handles:
                h.abort()
            self.inflight -= len(reqs) - len(handles)  # the handles release their own slots
            raise
        return handles

    async def open(self, req: GenRequest) -> RouterHandle:
        return (await self.open_all([req]))[0]

    async def _open(self, req: GenRequest) -> RouterHandle:
        """One choice, its slot already admitted (the handle releases it when it ends)."""
        assert self._client is not None, "router not started"
        t0 = time.perf_counter()
        rid = req.request_id or uuid.uuid4().hex
        keys = prefix_keys(req) if self.settings.prefix_aware else None
        m = self.metrics
        stream: httpx.Response | None = None
        dec: Worker | None = None
        try:
            body = {"request_id": rid, "params": params_to_json(req.params)}
            dec, stream, lines, grant = await self._open_decode(req, body)
            pbody = {
                "prompt": req.prompt,
                "chat": req.chat,
                "params": params_to_json(req.params),
                "cache_salt": req.cache_salt,
                "request_id": rid,
                "kv_address": grant[0],
                "ticket": grant[1],
                "grant": grant[2],
            }
            pre, r = await self._prefill(req, keys, pbody)
            if r.status_code in (401, 403):
                raise _worker_error(pre, r.status_code, r.content)
            try:
                answer = r.json()
            except ValueError as exc:
                raise ApiError(
                    502,
                    f"prefill worker {pre.url} answered {r.status_code} without JSON",
                    type_="server_error",
                ) from exc
            if r.status_code != 200:
                err = answer.get("error") or {}
                headers = {"Retry-After": r.headers["retry-after"]} if "retry-after" in r.headers else {}
                raise ApiError(
                    r.status_code,
                    err.get("message", "prefill failed"),
                    err.get("param"),
                    err.get("code"),
                    err.get("type", "server_error"),
                    headers,
                )
            self._remember(pre, keys)
        except BaseException as exc:
            if dec is not None:
                dec.inflight -= 1
            if stream is not None:
                await stream.aclose()
            if not (isinstance(exc, ApiError) and exc.status < 500):
                m.outcome("error")
            raise
        if answer.get("status") == "finished":  # the first token ended it: nothing to decode
            await stream.aclose()
            dec.inflight -= 1
            return RouterHandle(self, rid, None, dec, t0, StreamChunk.from_json(answer["chunk"]))
        return RouterHandle(
            self,
            rid,
            (stream, lines),
            dec,
            t0,
            None,
            int(answer.get("num_prompt_tokens") or 0),
            int(answer.get("num_cached_tokens") or 0),
            Lead.of(answer),
        )

    async def _open_decode(
        self, req: GenRequest, body: dict[str, Any]
    ) -> tuple[Worker, httpx.Response, AsyncIterator[str], tuple[str, str, str]]:
        """Park the request on a decode worker: (worker, its open stream, the stream's lines, the
        grant). A worker that is draining or refuses the connection is marked down and the next one
        tried (up to ATTEMPTS); the worker's ``inflight`` is counted for the caller."""
        m = self.metrics
        tried: set[str] = set()
        while True:
            dec, rule = self._pick(self.decode, "decode", req, None, tried)
            tried.add(dec.url)
            dec.inflight += 1
            stream: httpx.Response | None = None
            try:
                try:
                    stream = await self._send("POST", dec.url + "/internal/decode", stream=True, json=body)
                except httpx.ConnectError as exc:  # nothing reached the worker
                    raise _Skip(repr(exc)) from exc
                if stream.status_code != 200:
                    raw = await stream.aread()
                    if _draining(stream.status_code, raw):
                        raise _Skip("it is draining (shutting down)")
                    raise _worker_error(dec, stream.status_code, raw)
                lines = stream.aiter_lines()
                first = json.loads(await anext(lines))
                grant = (first["kv_address"], first["ticket"], first["grant"])
            except _Skip as skip:
                await _undo(dec, stream)
                dec.mark_down(skip.why)
                if len(tried) >= ATTEMPTS or not _others_ready(self.decode, tried):
                    raise retry_later(
                        503, f"decode worker {dec.url} failed: {skip.why}", "worker_failed"
                    ) from skip
                continue
            except (httpx.HTTPError, StopAsyncIteration, ValueError, KeyError, TypeError) as exc:
                await _undo(dec, stream)
                dec.mark_down(repr(exc))
                raise retry_later(
                    503,
                    f"decode worker {dec.url} failed: {exc!r}",
                    "worker_failed",
                ) from exc
            except BaseException:
                await _undo(dec, stream)
                raise
            m.routed.labels(m.pool, dec.url, rule).inc()
            return dec, stream, lines, grant

    async def _prefill(
        self, req: GenRequest, keys: list[bytes] | None, body: dict[str, Any]
    ) -> tuple[Worker, httpx.Response]:
        """Ask a prefill worker to prefill and hand off: (worker, its answer). A worker that is
        draining or refuses the connection is marked down and the next one tried (up to ATTEMPTS;
        the decode worker's grant is bound to its ticket, not to a prefill worker)."""
        m = self.metrics
        tried: set[str] = set()
        while True:
            pre, rule = self._pick(self.prefill, "prefill", req, keys, tried)
            tried.add(pre.url)
            pre.inflight += 1
            try:
                try:
                    r = await self._send("POST", pre.url + "/internal/prefill", json=body)
                except httpx.ConnectError as exc:
                    raise _Skip(repr(exc)) from exc
                except httpx.HTTPError as exc:
                    pre.mark_down(repr(exc))
                    raise retry_later(
                        503,
                        f"prefill worker {pre.url} failed: {exc!r}",
                        "worker_failed",
                    ) from exc
                if _draining(r.status_code, r.content):
                    raise _Skip("it is draining (shutting down)")
            except _Skip as skip:
                pre.mark_down(skip.why)
                if len(tried) >= ATTEMPTS or not _others_ready(self.prefill, tried):
                    raise retry_later(
                        503, f"prefill worker {pre.url} failed: {skip.why}", "worker_failed"
                    ) from skip
                continue
            finally:
                pre.inflight -= 1
            m.routed.labels(m.pool, pre.url, rule).inc()
            return pre, r


class _Skip(Exception):
    """A worker to skip for this request (draining, or the connection refused): try another."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


def _others_ready(workers: list[Worker], tried: set[str]) -> bool:
    """Whether a ready worker not yet tried for this request is left (else: the last worker's error)."""
    return any(w.ready and w.url not in tried for w in workers)


async def _undo(w: Worker, stream: httpx.Response | None) -> None:
    w.inflight -= 1
    if stream is not None:
        with contextlib.suppress(Exception):
            await stream.aclose()


def _draining(status: int, body: bytes) -> bool:
    """Whether a worker's answer is its drain refusal (503, code ``draining``)."""
    if status != 503:
        return False
    with contextlib.suppress(ValueError, AttributeError, TypeError, KeyError):
        return json.loads(body)["error"]["code"] == "draining"
    return False


def _worker_error(w: Worker, status: int, body: bytes) -> ApiError:
    """A worker's refusal of the router's own call, as the API's error."""
    text = body.decode(errors="replace")[:500]
    if status in (401, 403):
        w.mark_down(f"it refused the internal token ({status})")
        msg = f"{w.role} worker {w.url} refused the router's internal token; check the shared token"
        return ApiError(502, msg, code="internal_auth_failed", type_="server_error")
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        err = json.loads(text)["error"]
        return ApiError(
            status, str(err["message"]), err.get("param"), err.get("code"), err.get("type", "server_error")
        )
    return ApiError(status, text, type_="server_error")


class Lead:
    """What the prefill worker's answer adds to the decode stream: the logprobs entry of the first
    token (sampled on the prefill side; the decode side sends None in its place) and the prompt
    logprobs, put on the first chunk."""

    def __init__(self, first: list | None = None, prompt: list | None = None, text: str | None = None):
        self.first = list(first or [])
        self.prompt, self.text = prompt, text

    @classmethod
    def of(cls, answer: dict[str, Any]) -> Lead:
        first, prompt, text = answer.get("logprobs"), answer.get("prompt_logprobs"), answer.get("prompt_text")
        return cls(
            first if isinstance(first, list) else None,
            prompt if isinstance(prompt, list) else None,
            text if isinstance(text, str) else None,
        )

    def fill(self, c: StreamChunk) -> StreamChunk:
        if self.prompt is not None and c.prompt_logprobs is None:
            c.prompt_logprobs, c.prompt_text, self.prompt = self.prompt, self.text, None
        if c.logprobs:
            c.logprobs = [e if e is not None or not self.first else self.first.pop(0) for e in c.logprobs]
        return c


class RouterHandle:
    """Token chunks relayed from a decode worker; ``abort`` closes the stream (the worker aborts).
    The handle holds one of the router's ``max_inflight`` slots until it ends or is aborted."""

    def __init__(
        self,
        router: Router,
        rid: str,
        stream: tuple[httpx.Response, AsyncIterator[str]] | None,
        worker: Worker,
        t0: float,
        final: StreamChunk | None,
        prompt_tokens: int = 0,
        cached_tokens: int = 0,
        lead: Lead | None = None,
    ) -> None:
        self.router = router
        self.lead = lead or Lead()
        self.request_id = rid
        self._stream = stream
        self.worker = worker
        self.t0 = t0
        self._final = final
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = cached_tokens
        self._closed = final is not None
        self._started = False
        self._slot = True

    def _release(self) -> None:
        if self._slot:
            self._slot = False
            self.router._release()

    def __aiter__(self) -> AsyncIterator[StreamChunk]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[StreamChunk]:
        self._started = True
        m = self.router.metrics
        if self._final is not None:
            m.ttft.labels(m.pool).observe(time.perf_counter() - self.t0)
            m.outcome(self._final.finish_reason or "stop")
            self._release()
            yield self._final
            return
        assert self._stream is not None
        resp, lines = self._stream
        last_t: float | None = None
        tokens = 0
        outcome = "error"
        try:
            while True:
                try:
                    line = await anext(lines)
                except StopAsyncIteration:
                    raise RequestFailed(f"decode worker {self.worker.url} closed the stream early") from None
                except httpx.HTTPError as exc:
                    self.worker.mark_down(repr(exc))
                    raise RequestFailed(
                        f"decode worker {self.worker.url} failed mid-stream: {exc!r}"
                    ) from exc
                if not line.strip():
                    continue
                msg = json.loads(line)
                if "error" in msg:
                    raise _decode_error(msg["error"])
                c = self.lead.fill(StreamChunk.from_json(msg["chunk"]))
                c.num_prompt_tokens = c.num_prompt_tokens or self.prompt_tokens
                c.num_cached_tokens = c.num_cached_tokens or self.cached_tokens
                now = time.perf_counter()
                if c.num_tokens > tokens:
                    if last_t is None:
                        m.ttft.labels(m.pool).observe(now - self.t0)
                    else:
                        m.itl.labels(m.pool).observe((now - last_t) / (c.num_tokens - tokens))
                    m.generation_tokens.labels(m.pool).inc(c.num_tokens - tokens)
                    tokens, last_t = c.num_tokens, now
                if c.finished:
                    outcome = "error" if c.error else (c.finish_reason or "stop")
                    if c.error:
                        raise RequestFailed(c.error)
                    m.prompt_tokens.labels(m.pool).inc(c.num_prompt_tokens)
                    m.cached_tokens.labels(m.pool).inc(c.num_cached_tokens)
                    yield c
                    return
                yield c
        except (GeneratorExit, asyncio.CancelledError):
            outcome = "abort"
            raise
        finally:
            m.outcome(outcome)
            self.worker.inflight -= 1
            self._release()
            self._closed = True
            with contextlib.suppress(Exception):
                await asyncio.shield(resp.aclose())

    def abort(self) -> None:
        self._release()
        if self._closed or self._stream is None:
            return
        self._closed = True
        if not self._started:
            self.worker.inflight -= 1
        resp = self._stream[0]
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop().create_task(resp.aclose())


def _count(value: Any) -> int:
    """A non-negative count from a worker's state (anything else counts as 0)."""
    return value if type(value) is int and value > 0 else 0


def _decode_error(err: dict[str, Any]) -> Exception:
    """A decode worker's error line as the client's error: a queue timeout stays a 503 with its
    Retry-After (before any byte it is the answer's status; later, the stream's error event)."""
    message = str(err.get("message", "decode failed"))
    if err.get("code") != "queue_timeout":
        return RequestFailed(message)
    wait = err.get("retry_after_s")
    wait = wait if isinstance(wait, int) and 0 < wait <= 3600 else RETRY_AFTER_S
    return ApiError(
        503, message, code="queue_timeout", type_="server_error", headers={"Retry-After": str(wait)}
    )


def retry_later(status: int, message: str, code: str) -> ApiError:
    """A 429 (busy) or 503 (no worker) the client should retry: ``Retry-After`` set."""
    kind = "rate_limit_error" if status == 429 else "server_error"
    return ApiError(status, message, code=code, type_=kind, headers={"Retry-After": str(RETRY_AFTER_S)})
