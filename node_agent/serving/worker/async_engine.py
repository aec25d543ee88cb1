"""The engine on a background thread, with one asyncio queue per request.

The engine is not thread-safe: only the loop thread touches it. Submissions and aborts travel to
it through a command queue; outputs travel back to each request's asyncio queue with
``call_soon_threadsafe``. Every accepted request ends with a finished output or an exception in
its queue (nothing is lost), including when the engine step itself fails.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from pagoda.node_agent.engine.handoff import KVPayload
from pagoda.node_agent.engine.llm_engine import LLMEngine
from pagoda.node_agent.engine.output import RequestOutput
from pagoda.node_agent.engine.parallel.group import ReplicaFailure
from pagoda.node_agent.engine.prompts import Prompt
from pagoda.node_agent.params import RequestError, SamplingParams
from pagoda.node_agent.serving.api.errors import RequestFailed
from pagoda.node_agent.serving.api.metrics import EngineSnapshot, ServeMetrics

log = logging.getLogger("pagoda.async_engine")

SNAPSHOT_EVERY_S = 0.05


class QueueFull(RuntimeError):
    """Too many requests in flight; the caller should answer 429 with Retry-After."""


class EngineDead(RuntimeError):
    """The engine loop has stopped; no request can be served."""


class TooManyChoices(ValueError):
    """A batch larger than the server can ever hold in flight at once; retrying will not help."""


@dataclass
class Submission:
    """One request of a batch given to ``submit_many``."""

    prompt: Prompt
    params: SamplingParams
    chat: bool = False
    cache_salt: str = ""
    request_id: str | None = None


@dataclass
class _Live:
    """Loop-thread bookkeeping of one in-flight request."""

    rid: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float
    first: float | None = None
    last: float = 0.0
    tokens: int = 0


@dataclass
class _Command:
    kind: str  # "add" (queue requests with ``add``) | "abort" | "wake"
    rid: str
    add: Callable[[LLMEngine], object] | None = None  # runs on the loop thread; raises on bad input
    lives: list[_Live] = field(default_factory=list)  # what ``add`` queues, all or none
    done: concurrent.futures.Future | None = None


class RequestStream:
    """Outputs of one request, as an async iterator; ``aclose`` aborts it if unfinished."""

    def __init__(self, owner: AsyncEngine, live: _Live) -> None:
        self.owner = owner
        self.request_id = live.rid
        self._queue = live.queue
        self.finished = False

    def __aiter__(self) -> AsyncIterator:
        return self._iter()

    async def _iter(self) -> AsyncIterator:
        while not self.finished:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            if item.finished:
                self.finished = True
                if item.error is not None or item.finish_reason == "error":
                    raise RequestFailed(item.error or "the request failed")
            yield item

    async def final(self):
        """Wait for the finished output."""
        last = None
        async for out in self:
            last = out
        return last

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self.owner.abort(self.request_id)


class AsyncEngine:
    """Runs ``engine.step()`` on its own thread; async submit/stream/abort for the server."""

    def __init__(
        self,
        engine: LLMEngine,
        metrics: ServeMetrics | None = None,
        max_queue: int = 256,
        model_name: str = "",
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_inflight = engine.config.max_num_seqs + max_queue
        self.model_name = model_name or engine.config.model
        self._cmds: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}
        self._inflight = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._dead: str | None = None
        self._snapshot = EngineSnapshot()
        self._snap_at = 0.0
        self.generated_tokens = 0
        self._thread = threading.Thread(target=self._run, name="pagoda-engine", daemon=True)
        # called (on the engine thread) once the replica cannot serve any more: a tensor-parallel
        # rank died or hung; the server exits non-zero (cli/serve.py)
        self.on_fatal: Callable[[str], None] | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> AsyncEngine:
        self._take_snapshot()
        self._thread.start()
        return self

    def stop(self, timeout: float = 10) -> None:
        self._stop.set()
        self._cmds.put(_Command("wake", ""))
        self._thread.join(timeout)

    @property
    def ready(self) -> bool:
        return self._thread.is_alive() and self._dead is None

    @property
    def num_inflight(self) -> int:
        return self._inflight

    def snapshot(self) -> EngineSnapshot:
        return self._snapshot

    # ------------------------------------------------------------------ API (event-loop side)

    async def submit(
        self,
        prompt: Prompt,
        params: SamplingParams,
        *,
        chat: bool = False,
        cache_salt: str = "",
        request_id: str | None = None,
        prefill_only: bool = False,
    ) -> RequestStream:
        """Queue a request; raises RequestError (bad input), QueueFull or EngineDead."""
        rid = request_id or uuid.uuid4().hex

        def add(engine: LLMEngine) -> str:
            return engine.add_request(prompt, params, rid, chat, cache_salt, prefill_only)

        return await self._submit(rid, add)

    async def submit_prefilled(
        self, payload: KVPayload, params: SamplingParams, request_id: str | None = None
    ) -> RequestStream:
        """Continue a request whose prompt KV arrived from a prefill worker."""
        rid = request_id or uuid.uuid4().hex
        return await self._submit(rid, lambda engine: engine.add_prefilled(payload, params, rid))

    async def submit_many(self, subs: list[Submission]) -> list[RequestStream]:
        """Queue every request of ``subs`` in one loop command, or none of them.

        Raises TooManyChoices (more than can ever be in flight at once), QueueFull (not enough
        free slots now), EngineDead, or the first request's RequestError (nothing queued)."""
        if len(subs) > self.max_inflight:
            raise TooManyChoices(
                f"{len(subs)} choices in one request; this server holds at most {self.max_inflight} at once"
            )
        rids = [s.request_id or uuid.uuid4().hex for s in subs]

        def add(engine: LLMEngine) -> None:
            added: list[str] = []
            try:
                for s, rid in zip(subs, rids, strict=True):
                    added.append(engine.add_request(s.prompt, s.params, rid, s.chat, s.cache_salt))
            except BaseException:
                for rid in added:  # not stepped yet: no page was allocated, no token computed
                    engine.abort(rid, "another choice of the request was refused")
                raise

        return await self._submit_all(rids, add)

    def abort(self, request_id: str) -> None:
        self._cmds.put(_Command("abort", request_id))

    async def _submit(self, rid: str, add: Callable[[LLMEngine], object]) -> RequestStream:
        return (await self._submit_all([rid], add))[0]

    async def _submit_all(self, rids: list[str], add: Callable[[LLMEngine], object]) -> list[RequestStream]:
        if self._dead is not None or not self._thread.is_alive():
            raise EngineDead(self._dead or "the engine loop is not running")
        with self._lock:
            if self._inflight + len(rids) > self.max_inflight:
                raise QueueFull(
                    f"{self._inflight} requests in flight, {len(rids)} more asked (limit {self.max_inflight})"
                )
            self._inflight += len(rids)
        loop = asyncio.get_running_loop()
        lives = [_Live(rid, loop, asyncio.Queue(), time.perf_counter()) for rid in rids]
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put(_Command("add", rids[0], add, lives, done))
        try:
            await asyncio.wrap_future(done)
        except BaseException:
            # cancelled while queued (wrap_future cancels ``done`` too): make sure they do not run
            # unseen; a cancelled ``done`` has no exception to ask for (asking would raise)
            if not done.done() or done.cancelled() or done.exception() is None:
                for rid in rids:
                    self.abort(rid)
            raise
        return [RequestStream(self, live) for live in lives]

    # ------------------------------------------------------------------ the loop thread

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                busy = self.engine.has_unfinished()
                self._drain(block=not busy)
                if self.engine.has_unfinished():
                    self._step()
                else:
                    self.engine.tick()  # idle: a keepalive over a tensor-parallel replica's ranks
                self._maybe_snapshot()
        except ReplicaFailure as exc:
            self._fatal(exc)
        except BaseException as exc:  # pragma: no cover - a bug in the loop itself
            log.exception("engine loop died")
            self._dead = f"engine loop died: {exc}"
            self._fail_all(self._dead)
        finally:
            self._dead = self._dead or "the engine loop stopped"
            self._fail_all("the server is shutting down")
            self._take_snapshot()

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._cmds.get(timeout=SNAPSHOT_EVERY_S) if block else self._cmds.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(cmd)
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return

    def _handle(self, cmd: _Command) -> None:
        if cmd.kind == "abort":
            live = self._live.pop(cmd.rid, None)
            if live is not None:
                out = self.engine.abort(cmd.rid, "client disconnected")
                self._finish(live, "abort")
                if out is not None:
                    self._deliver(live, out)
            return
        if cmd.kind != "add" or cmd.add is None or not cmd.lives or cmd.done is None:
            return
        try:
            cmd.add(self.engine)
        except ReplicaFailure:
            self._release(len(cmd.lives))
            cmd.done.set_exception(EngineDead("the replica failed"))
            raise
        except Exception as exc:
            self._release(len(cmd.lives))
            if self.metrics:
                self.metrics.outcome("invalid" if isinstance(exc, (RequestError, ValueError)) else "error")
            cmd.done.set_exception(exc)
            return
        for live in cmd.lives:
            self._live[live.rid] = live
        cmd.done.set_result(cmd.rid)

    def _step(self) -> None:
        steps = self.engine.stats.steps
        try:
            outs = self.engine.step()
        except ReplicaFailure:
            raise  # _run ends the loop: nothing can run any more
        except Exception as exc:
            log.exception("engine step failed; failing the requests in flight")
            for rid in list(self._live):
                try:
                    self.engine.abort(rid, f"engine step failed: {exc}")
                except Exception:
                    log.exception("abort after a failed step")
            self._fail_all(f"engine step failed: {exc}")
            return
        now = time.perf_counter()
        for out in outs:
            live = self._live.get(out.request_id)
            if live is None:
                continue
            self._observe(live, out, now)
            if out.finished:
                self._live.pop(out.request_id, None)
                self._finish(live, "error" if out.error else out.finish_reason or "stop", out)
            self._deliver(live, out)
        if not outs and self.engine.stats.steps == steps:
            if self.engine.stalled():
                self._fail_all("the engine stalled with unfinished requests")
            else:
                time.sleep(0.001)

    def _observe(self, live: _Live, out: RequestOutput, now: float) -> None:
        n = len(out.token_ids)
        new = n - live.tokens
        if new <= 0:
            return
        m = self.metrics
        if live.first is None:
            live.first = now
            if m:
                m.ttft.labels(m.pool).observe(now - live.arrival)
        elif m:
            m.itl.labels(m.pool).observe((now - live.last) / new)
        self.generated_tokens += new
        if m:
            m.generation_tokens.labels(m.pool).inc(new)
        live.tokens = n
        live.last = now

    def _finish(self, live: _Live, outcome: str, out: RequestOutput | None = None) -> None:
        self._release()
        m = self.metrics
        if m is None:
            return
        m.outcome(outcome)
        if out is not None:
            m.prompt_tokens.labels(m.pool).inc(len(out.prompt_token_ids))
            m.cached_tokens.labels(m.pool).inc(out.num_cached_tokens)
            m.e2e.labels(m.pool).observe(time.perf_counter() - live.arrival)

    def _release(self, n: int = 1) -> None:
        with self._lock:
            self._inflight -= n

    def _fatal(self, exc: ReplicaFailure) -> None:
        """The replica lost a rank: every request in flight or queued ends with the reason, the
        server turns not ready, and ``on_fatal`` decides what the process does."""
        self._dead = f"tensor-parallel replica failed: {exc}"
        log.error("%s; failing every request and stopping", self._dead)
        self._fail_all(self._dead)
        self._stop.set()
        self._take_snapshot()
        if self.on_fatal is not None:
            self.on_fatal(self._dead)

    def _deliver(self, live: _Live, item: RequestOutput | BaseException) -> None:
        try:
            live.loop.call_soon_threadsafe(live.queue.put_nowait, item)
        except RuntimeError:
            pass  # the client's event loop is gone

    def _fail_all(self, message: str) -> None:
        for rid, live in list(self._live.items()):
            self._live.pop(rid, None)
            self._finish(live, "error")
            self._deliver(live, RequestFailed(message))
        while True:  # requests still queued as commands
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                break
            if cmd.kind == "add" and cmd.done is not None and not cmd.done.done():
                self._release(len(cmd.lives))
                cmd.done.set_exception(EngineDead(message))

    def _maybe_snapshot(self) -> None:
        if time.perf_counter() - self._snap_at >= SNAPSHOT_EVERY_S:
            self._take_snapshot()

    def _take_snapshot(self) -> None:
        s = self.engine.state()
        self._snap_at = time.perf_counter()
        self._snapshot = EngineSnapshot(
            ready=self._dead is None and not self._stop.is_set(),
            pools=s.pools,
            running=s.running,
            waiting=s.waiting,
            integrity_mode=s.integrity_mode,
            integrity=s.integrity,
            weight_bytes=s.weight_bytes,
            weight_breakdown=s.weight_breakdown,
            formats=s.formats,
            prefix_hit_tokens=s.prefix_hit_tokens,
            generation_tokens=self.generated_tokens,
            model=self.model_name,
        )
