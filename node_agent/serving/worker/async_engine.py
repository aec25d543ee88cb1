"""The engine on a background thread, with one asyncio queue per request.

The engine is not thread-safe: only the loop thread changes it. Submissions and aborts travel to
it through a command queue. Before that, a constrained request's grammar is compiled on the grammar
threads, and its prompt is measured, tokenized and length-checked on the tokenizer threads (which
read only the tokenizer and the fixed limits), so neither ever holds up the loop's steps and the
loop sees only token ids. Outputs travel back to each request's asyncio queue with
``call_soon_threadsafe``. Every accepted request ends with a finished output or an exception in
its queue (nothing is lost), including when the engine step itself fails.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
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
from pagoda.node_agent.params import PROMPT, RequestError, SamplingParams, guided_param
from pagoda.node_agent.serving.api.errors import RequestFailed
from pagoda.node_agent.serving.api.metrics import EngineSnapshot, ServeMetrics
from pagoda.node_agent.serving.api.prompt_limits import default_prompt_bytes, text_bytes, too_large
from pagoda.node_agent.serving.worker.queue_deadline import (
    DeadlineQueue,
    QueueFull,
    QueuePolicy,
    QueueRefused,
    QueueTimeout,
)

log = logging.getLogger("pagoda.async_engine")

SNAPSHOT_EVERY_S = 0.05
GRAMMAR_THREADS = 2  # constrained requests compile here, beside the engine thread
TOKENIZE_THREADS = 2  # prompts are tokenized and length-checked here, never on the engine thread
TOKENIZE_NICE = 10  # added to the tokenizer threads' nice value: the engine thread wins a busy CPU


def build_off_main(factory: Callable[[], LLMEngine]) -> LLMEngine:
    """``factory()`` run on a short-lived thread, its engine (or its exception) returned.

    OpenMP keeps one pool of worker threads per thread that ever ran a parallel region, and once a
    process holds more such workers than it has cores, every pool's workers go to sleep between
    regions instead of spinning, so each of a decode step's hundreds of regions waits for a wake-up
    (measured on 2 cores: a step 2.5-3x slower when the engine loop runs on another thread than the
    one that built the model). Built here, the model's pool goes with its thread, and the engine
    thread's pool is the only one (docs/serving.md#one-openmp-pool)."""
    box: dict[str, object] = {}

    def build() -> None:
        try:
            box["engine"] = factory()
        except BaseException as exc:  # re-raised on the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=build, name="pagoda-build")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["engine"]  # type: ignore[return-value]


def lower_thread_priority(step: int = TOKENIZE_NICE) -> None:
    """Raise the calling thread's nice value by ``step`` (Linux: a thread id is a PRIO_PROCESS
    target), so a flood of long prompts being tokenized takes CPU from the engine thread only when
    a core is free; a no-op where the platform has no per-thread priority."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + step))
    except (AttributeError, OSError):
        pass


def _put_each(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    """On an event loop: hand one step's outputs to their requests' queues."""
    for q, item in items:
        q.put_nowait(item)


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
class _Tokenize:
    """A prompt to turn into checked token ids before its request goes to the engine thread."""

    prompt: Prompt
    params: SamplingParams
    chat: bool = False
    prefill_only: bool = False


@dataclass
class _Live:
    """Loop-thread bookkeeping of one in-flight request."""

    rid: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float
    tenant: str | None = None  # queued for this tenant until the first token (None: not queued)
    first: float | None = None
    last: float = 0.0
    tokens: int = 0


@dataclass
class _Command:
    kind: str  # "add" (queue requests with ``add``) | "call" (run ``add``, result in ``done``) | "abort" | "wake"
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
        queue_policy: QueuePolicy | None = None,
        max_prompt_bytes: int | None = None,
    ) -> None:
        self.engine = engine
        # prompt text beyond this is refused before tokenizing (default: prompt_limits.py)
        self.max_prompt_bytes = max_prompt_bytes or default_prompt_bytes(engine.admission.max_model_len)
        self.metrics = metrics
        self.max_inflight = engine.config.max_num_seqs + max_queue
        self.model_name = model_name or engine.config.model
        self._cmds: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}
        self.queue = DeadlineQueue(queue_policy or QueuePolicy(), max_queue)  # under self._lock
        self._expired_at = 0.0
        self._inflight = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._dead: str | None = None
        self._snapshot = EngineSnapshot()
        self._snap_at = 0.0
        self.generated_tokens = 0
        self._thread = threading.Thread(target=self._run, name="pagoda-engine", daemon=True)
        self._grammar_pool = concurrent.futures.ThreadPoolExecutor(GRAMMAR_THREADS, "pagoda-grammar")
        self._tokenize_pool = concurrent.futures.ThreadPoolExecutor(
            TOKENIZE_THREADS, "pagoda-tokenize", initializer=lower_thread_priority
        )
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
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

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

        def add(engine: LLMEngine, grammars: list, ids: list) -> str:
            return engine.add_request(ids[0], params, rid, chat, cache_salt, prefill_only, grammars[0])

        job = _Tokenize(prompt, params, chat, prefill_only)
        return (await self._submit_all([rid], add, params, jobs=[job], tenant=cache_salt))[0]

    async def submit_prefilled(
        self, payload: KVPayload, params: SamplingParams, request_id: str | None = None
    ) -> RequestStream:
        """Continue a request whose prompt KV arrived from a prefill worker."""
        rid = request_id or uuid.uuid4().hex
        return await self._submit(
            rid, lambda engine, grammars, _: engine.add_prefilled(payload, params, rid, grammars[0]), params
        )

    async def submit_many(self, subs: list[Submission]) -> list[RequestStream]:
        """Queue every request of ``subs`` in one loop command, or none of them.

        Raises TooManyChoices (more than can ever be in flight at once), QueueFull (not enough
        free slots now), EngineDead, or the first request's RequestError (nothing queued)."""
        if len(subs) > self.max_inflight:
            raise TooManyChoices(
                f"{len(subs)} choices in one request; this server holds at most {self.max_inflight} at once"
            )
        rids = [s.request_id or uuid.uuid4().hex for s in subs]

        def add(engine: LLMEngine, grammars: list, ids: list) -> None:
            added: list[str] = []
            try:
                for s, rid, g, p in zip(subs, rids, grammars, ids, strict=True):
                    added.append(engine.add_request(p, s.params, rid, s.chat, s.cache_salt, grammar=g))
            except BaseException:
                for rid in added:  # not stepped yet: no page was allocated, no token computed
                    engine.abort(rid, "another choice of the request was refused")
                raise

        jobs = [_Tokenize(s.prompt, s.params, s.chat) for s in subs]
        return await self._submit_all(
            rids, add, *[s.params for s in subs], jobs=jobs, tenant=subs[0].cache_salt
        )

    def abort(self, request_id: str) -> None:
        self._cmds.put(_Command("abort", request_id))

    async def _submit(
        self, rid: str, add: Callable, params: SamplingParams, tenant: str | None = None
    ) -> RequestStream:
        return (await self._submit_all([rid], add, params, tenant=tenant))[0]

    async def _submit_all(
        self,
        rids: list[str],
        add: Callable,
        *params: SamplingParams,
        jobs: list[_Tokenize] | None = None,
        tenant: str | None = None,
    ) -> list[RequestStream]:
        """Queue ``add(engine, grammars, ids)`` on the loop thread once every request's grammar (one
        per ``params``, None when unconstrained) is compiled and every prompt of ``jobs`` is tokenized
        and length-checked (``ids``: their token ids, None without jobs); an error queues nothing.
        New prompts (``tenant`` set) take places in the deadline queue or are refused (QueueRefused)."""
        for job in jobs or []:
            self._check_bytes(job)
        if self._dead is not None or not self._thread.is_alive():
            raise EngineDead(self._dead or "the engine loop is not running")
        arrival = time.perf_counter()
        with self._lock:
            if self._inflight + len(rids) > self.max_inflight:
                self._refused("queue_full")
                raise QueueFull(
                    f"{self._inflight} requests in flight, {len(rids)} more asked (limit {self.max_inflight})"
                )
            if tenant is not None:
                try:
                    self.queue.admit(tenant, len(rids), arrival)
                except QueueRefused as exc:
                    self._refused(exc.reason)
                    raise
            self._inflight += len(rids)
        loop = asyncio.get_running_loop()
        lives = [_Live(rid, loop, asyncio.Queue(), arrival, tenant) for rid in rids]
        try:
            grammars = [await self._compile(p) for p in params]
            ids = await self._tokenize(jobs) if jobs else [None] * len(rids)
        except BaseException:
            self._release(len(rids))
            self._unqueue(*lives)
            raise
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._put(_Command("add", rids[0], lambda engine: add(engine, grammars, ids), lives, done))
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

    def _check_bytes(self, job: _Tokenize) -> None:
        """Refuse a prompt whose text alone is over ``max_prompt_bytes`` (before any tokenizing)."""
        size = text_bytes(job.prompt, self.max_prompt_bytes)
        if size > self.max_prompt_bytes:
            if self.metrics:
                self.metrics.outcome("invalid")
            field = "prompt" if isinstance(job.prompt, str) and not job.chat else "messages"
            raise RequestError(too_large(size, self.max_prompt_bytes, field), PROMPT)

    async def _tokenize(self, jobs: list[_Tokenize]) -> list[list[int]]:
        """Every prompt's token ids, made and checked on the tokenizer threads (HF tokenizers encode
        with the GIL released), so a long prompt never holds up the engine loop; the first
        RequestError (by position) when one is refused."""
        futs = [asyncio.wrap_future(self._tokenize_pool.submit(self._prepare, j)) for j in jobs]
        results = await asyncio.gather(*futs, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                if self.metrics and isinstance(r, RequestError | ValueError):
                    self.metrics.outcome("invalid")
                raise r
        return results  # type: ignore[return-value]

    def _prepare(self, job: _Tokenize) -> list[int]:
        """On a tokenizer thread: the prompt's token ids, checked against the model length and the
        KV pools (the checks ``add_request`` repeats, cheaply, on ids). Raises RequestError."""
        job.params.validate()
        ids = self.engine.tokenize(job.prompt, job.chat)
        self.engine.admission.check_prompt(ids, job.params, job.prefill_only)
        return ids

    async def _compile(self, params: SamplingParams):
        """The compiled grammar of a constrained request (None otherwise), compiled on a grammar
        thread (the engine's cache answers at once for a constraint it compiled before). A compile
        error or one slower than the cache's ``timeout_s`` is a RequestError naming the param."""
        spec = params.guided
        if spec is None:
            return None
        cache = self.engine.grammars
        try:
            job = self._grammar_pool.submit(cache.compile, spec)
            return await asyncio.wait_for(asyncio.wrap_future(job), cache.timeout_s)
        except TimeoutError:
            if self.metrics:
                self.metrics.outcome("invalid")
            kind = spec.get("type") if isinstance(spec, dict) else None
            raise RequestError(
                f"the {kind} constraint did not compile within {cache.timeout_s:g}s; simplify it",
                guided_param(spec),
            ) from None
        except RequestError:
            if self.metrics:
                self.metrics.outcome("invalid")
            raise

    # ------------------------------------------------------------------ the loop thread

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                busy = self.engine.has_unfinished()
                self._drain(block=not busy)
                if self.engine.has_unfinished():
                    self._step()
                    self._expire()
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

    async def call(self, fn: Callable[[LLMEngine], object]) -> object:
        """Run ``fn(engine)`` on the loop thread between steps; its result (or exception)."""
        if self._dead:
            raise EngineDead(self._dead)
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._put(_Command("call", "", add=fn, done=done))
        return await asyncio.wrap_future(done)

    def _put(self, cmd: _Command) -> None:
        """Queue ``cmd`` for the loop thread. The loop marks itself dead before its last drain, so a
        command queued after that drain is failed here: no caller waits on a stopped loop."""
        self._cmds.put(cmd)
        if self._dead is not None:
            self._fail_queued(self._dead)

    def _handle(self, cmd: _Command) -> None:
        if cmd.kind == "call" and cmd.add is not None and cmd.done is not None:
            try:
                cmd.done.set_result(cmd.add(self.engine))
            except Exception as exc:
                cmd.done.set_exception(exc)
            return
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
            self._unqueue(*cmd.lives)
            cmd.done.set_exception(EngineDead("the replica failed"))
            raise
        except Exception as exc:
            self._release(len(cmd.lives))
            self._unqueue(*cmd.lives)
            if self.metrics:
                self.metrics.outcome("invalid" if isinstance(exc, (RequestError, ValueError)) else "error")
            cmd.done.set_exception(exc)
            return
        for live in cmd.lives:
            self._live[live.rid] = live
        cmd.done.set_result(cmd.rid)

    def _step(self) -> None:
        steps = self.engine.stats.steps
        faults = getattr(self.engine, "faults", None)
        if faults is not None and faults.enabled:  # drills only: faults armed for requests decoding now
            try:
                faults.arming.apply()
            except Exception:
                log.exception("fault injection failed")
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
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for out in outs:
            live = self._live.get(out.request_id)
            if live is None:
                continue
            self._observe(live, out, now)
            if out.finished:
                self._live.pop(out.request_id, None)
                self._finish(live, "error" if out.error else out.finish_reason or "stop", out)
            by_loop.setdefault(live.loop, []).append((live.queue, out))
        for loop, items in by_loop.items():  # one wake-up of each event loop per step, not per stream
            try:
                loop.call_soon_threadsafe(_put_each, items)
            except RuntimeError:
                pass  # the clients' event loop is gone
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
            self._unqueue(live, now=now)
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
        self._unqueue(live)
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

    # ------------------------------------------------------------------ the deadline queue

    def _unqueue(self, *lives: _Live, now: float | None = None) -> None:
        """The requests left the queue: a first token at ``now`` (a measured departure) or an end."""
        for live in lives:
            if live.tenant is None:
                continue
            with self._lock:
                self.queue.leave(live.tenant, now)
            live.tenant = None
            m = self.metrics
            if m is not None and now is not None:
                m.queue_time.labels(m.pool).observe(now - live.arrival)

    def _refused(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.queue_refusals.labels(self.metrics.pool, reason).inc()

    def _expire(self) -> None:
        """End every request still waiting unscheduled past the maximum queue time (loop thread)."""
        limit = self.queue.policy.max_queue_time_s
        now = time.perf_counter()
        if limit is None or now - self._expired_at < SNAPSHOT_EVERY_S:
            return
        self._expired_at = now
        for rid, live in list(self._live.items()):
            seq = self.engine.sequence(rid)
            if live.tenant is None or now - live.arrival <= limit or seq is None:
                continue
            if seq not in self.engine.scheduler.waiting:
                continue  # scheduled: its prefill runs (a cached prefix may be mapped while it waits)
            self._live.pop(rid, None)
            self.engine.abort(rid, "queue time exceeded")
            self._refused("timeout")
            self._finish(live, "error")
            with self._lock:
                wait = self.queue.expected_wait(0, now) or limit
            self._deliver(
                live,
                QueueTimeout(
                    f"the request waited {now - live.arrival:.1f}s in the queue without being scheduled "
                    f"(the maximum queue time is {limit:g}s); retry later",
                    wait,
                ),
            )

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
        self._fail_queued(message)

    def _fail_queued(self, message: str) -> None:
        """Fail every command still queued: requests to add and calls alike."""
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                break
            if cmd.done is None or cmd.done.done():
                continue
            if cmd.kind == "add":
                self._release(len(cmd.lives))
                self._unqueue(*cmd.lives)
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
            preemptions=s.preemptions_by_pool,
            step_budget=s.step_budget,
            generation_tokens=self.generated_tokens,
            model=self.model_name,
        )
