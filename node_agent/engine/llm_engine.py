"""The engine loop: accept requests, schedule a step, check KV integrity, run the model, emit output.

Follow one request: ``add_request`` tokenizes and validates it into a Sequence (sequence.py); the
Scheduler (scheduler.py) admits it and maps its tokens onto KV pages (kv_pool.py); before the step
the integrity tracker (integrity.py) checks every mapped page's generation tag; the ModelRunner
(model_runner.py) builds a StepBatch (models/batch.py) and runs the model (models/llama.py), whose
layers call the kernels (pagoda.kernels); sampling.py picks the token; output.py applies the stop
rules and detokenizes; ``step`` returns the outputs. Pools are sized and calibrated in kv_setup.py;
prefill -> decode handoffs are built, validated and received in handoff.py.

Failures stay with the request that causes them: a handoff is validated before a page is taken and
rolled back if it fails later; a step that raises is re-run in parts, and only a request that fails
alone ends (finish_reason "error"), so its batch mates' output is what it would have been anyway.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import signal
import time
import uuid

import torch

from pagoda.node_agent.engine import handoff
from pagoda.node_agent.engine.block_tables import block_table_tensor
from pagoda.node_agent.engine.config import EngineConfig
from pagoda.node_agent.engine.fault_injection import make_faults
from pagoda.node_agent.engine.integrity import IntegrityError, make_tracker, release_owned
from pagoda.node_agent.engine.kv_pool import KVPagePool, OutOfPages
from pagoda.node_agent.engine.kv_setup import PoolBuilder, kv_components
from pagoda.node_agent.engine.memory import check_weights_fit, estimate_weight_bytes, phase_weight_formats
from pagoda.node_agent.engine.model_runner import ModelRunner, build_model, context_limit
from pagoda.node_agent.engine.output import RequestOutput, RequestState, StopRules
from pagoda.node_agent.engine.parallel_group import ParallelGroup, ReplicaFailure
from pagoda.node_agent.engine.parallel_steps import Follower, ParallelDriver
from pagoda.node_agent.engine.prompts import Prompt, prompt_token_ids
from pagoda.node_agent.engine.scheduler import ScheduledStep, Scheduler, SchedulerConfig
from pagoda.node_agent.engine.sequence import Sequence
from pagoda.node_agent.engine.state import EngineState, EngineStats, KVPoolState
from pagoda.node_agent.models.config import ModelConfig
from pagoda.node_agent.models.loader import LoadedModel, load_model
from pagoda.node_agent.models.parallel import head_ranges
from pagoda.node_agent.models.step_ops import enable_compile
from pagoda.node_agent.models.tokenizer import Tokenizer
from pagoda.node_agent.params import PROMPT, CapacityError, RequestError, SamplingParams

log = logging.getLogger("pagoda.engine")

MAX_ERROR_CHARS = 500  # of an exception's text in a failed request's error


def _describe(exc: BaseException, where: str) -> str:
    """The error a request ended by ``exc`` (raised in ``where``) reports."""
    text = f"engine {where} failed for this request: {type(exc).__name__}: {exc}"
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


class LLMEngine:
    """One engine process: both phases (``pagoda serve --role both``) or one of them."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        loaded: LoadedModel | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        self.config = config = config or EngineConfig()
        config.validate()
        self.device = config.torch_device()
        self.dtype = config.torch_dtype()
        t0 = time.perf_counter()
        # tensor parallelism: this process is one rank of the replica (rank 0 drives the others)
        self.group = ParallelGroup(config, run_worker_rank) if config.parallel.tensor_parallel > 1 else None
        self.tp: ParallelDriver | None = None
        self._follower: Follower | None = None
        loaded = loaded or load_model(config.model)
        self.model_config: ModelConfig = loaded.config  # the whole model (a rank holds a slice)
        self.tokenizer = tokenizer or Tokenizer(loaded.tokenizer_dir, loaded.gguf_file)
        if self.device.type == "cuda" and self.group is None:  # before any weight reaches the device
            est = estimate_weight_bytes(
                loaded.weights,
                phase_weight_formats(config),
                self.dtype,
                config.int4_group_size,
                int4_compute=config.int4_compute,
                # auto keeps a dense head on CUDA; a prefill worker holds only the dense one
                decode_head_format="dense" if config.role == "prefill" else config.decode_lm_head,
            )
            check_weights_fit(est, self.device)
        self.model = build_model(config, loaded, self.dtype, self.device, self.group)
        del loaded
        if self.group is not None:  # ranks load at their own pace; the first collective waits for all
            self.group.wait_for_all("the model was loaded on every rank")
        self.max_model_len = context_limit(config, self.model_config)
        self.runner = ModelRunner(self.model, config.kernel_backend)
        local = self.model.cfg  # this rank's heads
        if config.compile:  # at load, so that the first request does not pay it
            enable_compile(self.device, self.dtype, local.num_heads, local.num_kv_heads, local.head_dim)
        mc = self.model_config
        builder = PoolBuilder(
            config,
            local,
            self.dtype,
            self.device,
            self.runner,
            self.tokenizer,
            self.max_model_len,
            **self._parallel_pool_args(),
        )
        self.prefill_pool, self.pool = builder.pools()  # every rank at once (calibration runs the model)
        if self.group is not None:
            self._join_ranks()
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                enable_prefix_caching=config.enable_prefix_caching,
            ),
            self.prefill_pool,
            self.pool,
        )
        self.integrity = make_tracker(config.integrity, config.kernel_backend)
        self.faults = make_faults(self, config.fault_injection)  # raises on use unless enabled
        self.stats = EngineStats()
        self._requests: dict[str, RequestState] = {}
        self._ready: list[RequestOutput] = []
        eos = set(mc.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.stop_rules = StopRules(frozenset(eos), self.max_model_len)
        self._weight_breakdown = self.model.weight_bytes()  # by part and format (models/weight_bytes.py)
        self._weight_bytes = int(self._weight_breakdown["total"])
        log.info(
            "engine ready in %.1fs: %s, %d layers, dtype %s, KV %d pages x %d tokens (%s), device %s",
            time.perf_counter() - t0,
            mc.arch,
            mc.num_layers,
            self.dtype,
            self.pool.num_pages,
            self.pool.page_size,
            self.pool.kv_format,
            self.device,
        )

    # ------------------------------------------------------------------ tensor parallelism

    def _parallel_pool_args(self) -> dict:
        """Pool sizing over the ranks: as many pages on each as the rank with most heads holds."""
        if self.group is None:
            return {}
        import torch.distributed as dist

        mc = self.model_config
        sizing = None
        if mc.mla is None:
            most = max(
                kv[1] - kv[0] for _, kv in head_ranges(mc.num_heads, mc.num_kv_heads, self.group.world)
            )
            sizing = kv_components(dataclasses.replace(mc, num_kv_heads=most, num_heads=most))

        def reduce_max(t: torch.Tensor) -> torch.Tensor:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group.data)
            return t

        return {"sizing": sizing, "reduce_max": reduce_max}

    def _join_ranks(self) -> None:
        """Rank 0 drives the others from now on; another rank only follows (``follow``)."""
        mc = self.model_config
        whole = kv_components(mc)
        for p in self.pools().values():
            p.replica_components = dict(whole)
        if mc.mla is not None:
            split = [(0, 1)] * self.group.world
        else:
            split = [kv for _, kv in head_ranges(mc.num_heads, mc.num_kv_heads, self.group.world)]
        backend = self.config.kernel_backend
        if self.group.rank == 0:
            self.tp = ParallelDriver(self.group, self.model, self.prefill_pool, self.pool, split, backend)
            self.runner.driver = self.tp
            atexit.register(self.close)
        else:
            self._follower = Follower(self.group, self.model, self.prefill_pool, self.pool, backend)

    @property
    def is_driver(self) -> bool:
        """Whether this process serves requests (rank 0, or no tensor parallelism)."""
        return self.group is None or self.group.rank == 0

    def follow(self) -> int:
        """A rank other than 0: carry out rank 0's instructions until it stops (0) or is lost (3)."""
        if self._follower is None:
            raise RuntimeError("only a tensor-parallel rank other than 0 follows")
        code = self._follower.run()
        self.group.close()
        return code

    def tick(self) -> None:
        """Called by an idle serving loop: a keepalive vote when nothing was sent for a while, so a
        dead rank fails the replica even without traffic (raises ReplicaFailure)."""
        if self.tp is not None:
            self.tp.keepalive_if_due()

    def close(self) -> None:
        """Tell the other ranks to stop and leave the group (idempotent)."""
        if self.tp is not None and self.group is not None:
            self.tp.stop()
        if self.group is not None:
            self.group.close()
            self.group = None

    def _check_tags(
        self, seqs: list[Sequence], pool: KVPagePool, tables: tuple | None = None
    ) -> dict[Sequence, IntegrityError]:
        """The integrity check of ``seqs`` on this rank and, under tensor parallelism, on every other
        rank (a mismatch on any rank fails the request on all of them)."""
        bad = self.integrity.check(seqs, pool, tables)
        if self.tp is None or self.integrity.mode == "off":
            return bad
        if tables is None:
            tables = block_table_tensor(seqs, pool.tag_table.device)
        votes = self.tp.check(pool, tables[0], tables[1], [len(s.block_table) for s in seqs])
        for seq, vote in zip(seqs, votes, strict=True):
            if vote and seq not in bad:
                bad[seq] = IntegrityError(
                    f"request {seq.request_id}: a KV page's generation tag differs on tensor-parallel "
                    f"rank {vote - 1}; its pages cannot be trusted (failing closed)"
                )
                self.integrity.counters.mismatches += 1
        return bad

    # ------------------------------------------------------------------ requests

    def tokenize(self, prompt: Prompt, chat: bool = False) -> list[int]:
        """Prompt text, token ids or chat messages -> token ids (validated)."""
        return prompt_token_ids(self.tokenizer, prompt, self.model_config.vocab_size, chat)

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        chat: bool = False,
        cache_salt: str = "",
        prefill_only: bool = False,
    ) -> str:
        """Validate and queue a request; returns its id. Raises RequestError on bad input."""
        params = params or SamplingParams()
        params.validate()
        ids = self.tokenize(prompt, chat)
        if len(ids) >= self.max_model_len:
            raise RequestError(
                f"prompt has {len(ids)} tokens; the model length is {self.max_model_len} "
                f"(prompt + at least one new token must fit)",
                PROMPT,
            )
        if len(ids) + 1 > self.prefill_pool.capacity_tokens:
            raise RequestError(
                f"prompt has {len(ids)} tokens; the prefill KV pool holds {self.prefill_pool.capacity_tokens}",
                PROMPT,
            )
        need = len(ids) + min(params.max_tokens, self.max_model_len - len(ids))
        if prefill_only:
            need = len(ids) + 1
        if need > self.pool.capacity_tokens:
            raise RequestError(
                f"prompt + max_tokens ({need} tokens) exceeds the KV cache capacity "
                f"({self.pool.capacity_tokens} tokens)",
                PROMPT,
            )
        rid = self._new_id(request_id)
        seq = Sequence(rid, ids, params, cache_salt)
        seq.prefill_only = prefill_only
        self._requests[rid] = RequestState(seq, self.tokenizer, self.stop_rules)
        self.scheduler.add(seq)
        return rid

    def add_prefilled(
        self, payload: handoff.KVPayload, params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Continue decoding a sequence prefilled elsewhere: fresh tagged pages, converted on arrival.

        Everything is validated before a page is allocated: RequestError for malformed parameters or
        payload, CapacityError when the decode pool lacks free pages or max_num_seqs is reached,
        IntegrityError when an audited payload fails its checksums. Anything raised after allocation
        releases every page taken and leaves no trace of the request before it propagates."""
        params = params or SamplingParams()
        params.validate()
        num_pages = handoff.check_payload(
            payload, self.pool, self.model_config.vocab_size, self.max_model_len
        )
        n = len(payload.prompt_token_ids)
        need = n + min(params.max_tokens, self.max_model_len - n)
        if need > self.pool.capacity_tokens:
            raise RequestError(
                f"prompt + max_tokens ({need} tokens) exceeds the decode KV cache capacity "
                f"({self.pool.capacity_tokens} tokens)",
                PROMPT,
            )
        if len(self.scheduler.running) >= self.config.max_num_seqs:
            raise CapacityError("decode worker is at max_num_seqs; retry later")
        if self.pool.num_free < num_pages:
            raise CapacityError(
                f"decode KV pool has {self.pool.num_free} free pages, the handoff needs {num_pages}; retry later"
            )
        rid = self._new_id(request_id or payload.request_id)
        self.integrity.verify_payload(rid, payload.layers, payload.meta)  # audit: raises IntegrityError
        write = self.tp.scatter_pages if self.tp is not None else None
        try:
            seq = handoff.receive(payload, self.pool, params, rid, self.config.kernel_backend, write)
        except OutOfPages as exc:  # receive released what it took
            raise CapacityError("decode KV pool is full; retry later") from exc
        try:
            self._admit_prefilled(seq, payload.first_token)
        except BaseException:
            self._discard(seq)
            raise
        return rid

    def _admit_prefilled(self, seq: Sequence, first_token: int) -> None:
        """Register a received sequence: it decodes next, or ends at once on its first token."""
        state = RequestState(seq, self.tokenizer, self.stop_rules)
        state.check_stop(first_token)
        if seq.finished:  # the first token already ends it: reported by the next step()
            self.pool.release_all(seq.block_table)
            seq.block_table = []
            out = state.output(finished=True)
            self._ready.append(out)
            self.stats.requests_finished += 1
            return
        self.scheduler.add_running(seq)
        self._requests[seq.request_id] = state

    def _discard(self, seq: Sequence) -> None:
        """Undo a half-admitted sequence: its pages back to the pool, no entry anywhere."""
        if seq in self.scheduler.running:
            self.scheduler.running.remove(seq)
        self.pool.release_all(seq.block_table)
        seq.block_table = []
        state = self._requests.get(seq.request_id)
        if state is not None and state.seq is seq:
            del self._requests[seq.request_id]

    def _new_id(self, request_id: str | None) -> str:
        rid = handoff.check_request_id(request_id) if request_id else uuid.uuid4().hex
        if rid in self._requests:
            raise RequestError(f"request id {rid!r} is already in flight", PROMPT)
        return rid

    def abort(self, request_id: str, reason: str = "aborted") -> RequestOutput | None:
        """Cancel a request (client gone): pages are released at once."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return None
        self.scheduler.abort(state.seq)
        state.seq.finish("abort", reason)
        self.stats.requests_aborted += 1
        return state.output(finished=True)

    def sequence(self, request_id: str) -> Sequence | None:
        """The live sequence of a request in flight (None when it has ended)."""
        state = self._requests.get(request_id)
        return state.seq if state is not None else None

    def has_unfinished(self) -> bool:
        return bool(self._requests) or bool(self._ready)

    def stalled(self) -> bool:
        """Requests are in flight but nothing is scheduled or waiting to be reported: a bug, never a wait."""
        return self.has_unfinished() and not self._ready and not self.scheduler.has_work()

    # ------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; returns outputs of every request that progressed or ended.

        An exception while running the model, sampling or post-processing ends only the requests
        that cause it (finish_reason "error"); the rest of the step's results stand."""
        outputs, self._ready = self._ready, []  # requests that ended outside a step
        outputs += self._migrate_prefilled()
        step = self.scheduler.schedule()
        if step is None:
            return outputs
        pool = self.prefill_pool if step.phase == "prefill" else self.pool
        # the step's block tables, built once: the integrity check and the model read the same ones
        tables = block_table_tensor(step.seqs, pool.tag_table.device)
        bad = self._check_tags(step.seqs, pool, tables)
        if bad:
            outputs += [self._fail_integrity(seq, err) for seq, err in bad.items()]
            step, tables = step.excluding(bad), None
            if step is None:
                return outputs
        t0 = time.perf_counter()
        sampled, errors = self._run_isolated(step, pool, tables)
        self.stats.step_seconds[step.phase] += time.perf_counter() - t0
        self.stats.steps += 1
        outputs += self._fail_all(errors)
        step = step.excluding(errors)
        if step is None:
            return outputs
        for seq, n in zip(step.seqs, step.num_new_tokens, strict=True):
            seq.num_computed_tokens += n  # only after a run that succeeded
        new_tokens = sum(step.num_new_tokens)
        if step.phase == "prefill":
            self.stats.prefill_tokens += new_tokens
        else:
            self.stats.decode_tokens += new_tokens
        payloads: dict[Sequence, handoff.KVPayload] = {}
        post_errors: dict[Sequence, str] = {}
        for seq, tok in sampled.items():
            try:
                seq.output_token_ids.append(tok)
                self._requests[seq.request_id].check_stop(tok)
                if seq.prefill_only and not seq.finished:
                    # audit mode adds per-page checksums to the payload
                    extract = self.tp.gather_pages if self.tp is not None else handoff.extract_pages
                    payloads[seq] = handoff.payload_of(
                        seq, self.prefill_pool, self.integrity.payload_meta, extract
                    )
                    seq.finish("prefilled")
            except ReplicaFailure:
                raise
            except Exception as exc:
                post_errors[seq] = self._log_failure([seq], "output", exc)
        for seq in step.seqs:
            if seq in post_errors:
                continue
            try:
                self.scheduler.seal_full_pages(seq)
                self.integrity.sealed(seq, pool)  # audit: checksum of each newly sealed page
                if seq.finished:
                    self.scheduler.finish(seq)
            except Exception as exc:
                post_errors[seq] = self._log_failure([seq], "page bookkeeping", exc)
        for seq in sampled:
            state = self._requests.get(seq.request_id)
            if state is None or seq in post_errors:
                continue
            try:
                out = state.output(finished=seq.finished)
            except Exception as exc:
                post_errors[seq] = self._log_failure([seq], "output", exc)
                continue
            out.kv_payload = payloads.get(seq)
            outputs.append(out)
            if seq.finished:
                del self._requests[seq.request_id]
                self.stats.requests_finished += 1
        return outputs + self._fail_all(post_errors)

    def _run_isolated(
        self, step: ScheduledStep, pool: KVPagePool, tables: tuple | None = None
    ) -> tuple[dict[Sequence, int], dict[Sequence, str]]:
        """Run the step; if it raises, re-run it in halves down to single sequences (a sequence fails
        only when it fails alone). Returns the sampled tokens and an error message per failed sequence.

        A retry rewrites the KV slots the failed run may have written (the same slots, computed
        again) and starts every seeded generator from its state before the failed run."""
        # seeded draws consume the generator: snapshot it (~2 us per sampling request) for a retry
        gens = {
            s: s.generator.get_state() for s in step.seqs if s.generator is not None and not s.params.greedy
        }
        try:
            return self.runner.run(step, pool, tables), {}
        except ReplicaFailure:
            raise  # the replica cannot run anything any more: no retry
        except Exception as exc:
            first = exc
        sampled: dict[Sequence, int] = {}
        failed: dict[Sequence, Exception] = {}
        self._retry_halves(step, pool, gens, sampled, failed)
        if not failed:
            log.warning(
                "a %s step of %d requests raised, and every part succeeded when re-run",
                step.phase,
                len(step.seqs),
                exc_info=first,
            )
            return sampled, {}
        where = f"{step.phase} step"
        self._log_failure(list(failed), where, next(iter(failed.values())))
        return sampled, {seq: _describe(exc, where) for seq, exc in failed.items()}

    def _retry_halves(
        self,
        step: ScheduledStep,
        pool: KVPagePool,
        gens: dict[Sequence, torch.Tensor],
        sampled: dict[Sequence, int],
        failed: dict[Sequence, Exception],
    ) -> None:
        """Re-run a failed step's two halves; a failing half of several sequences splits again."""
        mid = len(step.seqs) // 2
        for part in (step.seqs[:mid], step.seqs[mid:]):
            if not part:
                continue
            sub = step.only(part)
            for seq in part:
                if seq in gens:
                    seq.generator.set_state(gens[seq])
            try:
                sampled.update(self.runner.run(sub, pool))
            except ReplicaFailure:
                raise
            except Exception as exc:
                if len(part) == 1:
                    failed[part[0]] = exc
                else:
                    self._retry_halves(sub, pool, gens, sampled, failed)

    def _log_failure(self, seqs: list[Sequence], where: str, exc: BaseException) -> str:
        """Log a failure once, with the request ids it ends; returns the message those requests get."""
        ids = ", ".join(s.request_id for s in seqs)
        log.error("%s failed; ending request(s) %s with an error", where, ids, exc_info=exc)
        return _describe(exc, where)

    def _fail_all(self, errors: dict[Sequence, str]) -> list[RequestOutput]:
        """End each sequence with its error: pages released, no longer scheduled, counted as aborted."""
        outs = [self._fail_request(seq, msg) for seq, msg in errors.items()]
        return [o for o in outs if o is not None]

    def _fail_request(self, seq: Sequence, message: str) -> RequestOutput | None:
        """End one request with ``message``; its final output (None when it has none in flight)."""
        try:
            self.scheduler.abort(seq)  # leaves the running set first, then releases the pages
        except Exception:
            log.exception("releasing the pages of failed request %s", seq.request_id)
            seq.block_table = []
        seq.finish("error", message)
        self.stats.requests_aborted += 1
        state = self._requests.get(seq.request_id)
        if state is None or state.seq is not seq:
            return None
        del self._requests[seq.request_id]
        return state.output(finished=True)  # an errored output builds no text: it cannot raise here

    def _migrate_prefilled(self) -> list[RequestOutput]:
        """Move finished prefills from the prefill pool to the decode pool, converting the KV format.
        Pages are tag-checked before they are copied; returns the outputs of requests failed closed."""
        failed: list[RequestOutput] = []
        for seq in self.scheduler.awaiting_migration():
            err = self._check_tags([seq], self.prefill_pool).get(seq)
            if err is not None:
                failed.append(self._fail_integrity(seq, err))
                continue
            mirror = self.tp.migrate if self.tp is not None else None
            try:
                refs = handoff.migrate(
                    self.prefill_pool, self.pool, seq.block_table, self.config.kernel_backend, mirror
                )
            except OutOfPages:
                break  # decode frees pages as sequences finish; try again next step
            except ReplicaFailure:
                raise
            except Exception as exc:  # migrate released what it took in the decode pool
                out = self._fail_request(seq, self._log_failure([seq], "KV migration", exc))
                failed += [out] if out is not None else []
                continue
            seq.block_table = refs
            seq.pool_name = self.pool.name
            self.stats.migrations += 1
        return failed

    def _fail_integrity(self, seq: Sequence, err: IntegrityError) -> RequestOutput:
        """Fail closed: end only this request with an explicit error and release its pages."""
        log.error("integrity: aborting %s: %s", seq.request_id, err)
        live = self.scheduler.running + list(self.scheduler.waiting)
        release_owned(seq, self.scheduler.pool_of(seq), live)  # never a page now owned by another
        self.scheduler.abort(seq)
        seq.finish("error", str(err))
        self.stats.requests_aborted += 1
        return self._requests.pop(seq.request_id).output(finished=True)

    # ------------------------------------------------------------------ observation

    def pools(self) -> dict[str, KVPagePool]:
        """The KV page pools by name: one shared pool, or a prefill and a decode pool."""
        return {p.name: p for p in (self.prefill_pool, self.pool)}

    def state(self) -> EngineState:
        """A typed snapshot of occupancy, formats and counters (call on the engine's thread)."""
        return EngineState(
            model=self.config.model,
            formats=self.config.formats.as_dict(),
            pools=[
                KVPoolState(name, p.num_pages, p.num_used, p.page_size, p.capacity_tokens, p.kv_format)
                for name, p in self.pools().items()
            ],
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            integrity_mode=self.integrity.mode,
            integrity=dataclasses.asdict(self.integrity.counters),
            weight_bytes=self._weight_bytes,
            weight_breakdown=self._weight_breakdown,
            prefix_hit_tokens=self.scheduler.prefix_hit_tokens,
            preemptions=self.scheduler.num_preemptions,
            stats=dataclasses.replace(self.stats, step_seconds=dict(self.stats.step_seconds)),
        )

    # ------------------------------------------------------------------ convenience

    def score(
        self, token_ids: list[int], phase: str = "decode", pool: KVPagePool | None = None
    ) -> torch.Tensor:
        """Next-token logits [T, vocab] (float32) at every position of ``token_ids``, through the paged
        KV path of ``pool`` (default: the phase's pool) with the phase's weights; pages are released."""
        pool = pool or (self.pool if phase == "decode" else self.prefill_pool)
        if not token_ids or len(token_ids) > pool.capacity_tokens:
            raise RequestError(f"score needs 1..{pool.capacity_tokens} tokens")
        return self.runner.score(token_ids, pool, phase)

    def run_until_done(self, on_output=None, max_steps: int | None = None) -> dict[str, RequestOutput]:
        """Step until every queued request has finished; returns the final output per request."""
        final: dict[str, RequestOutput] = {}
        n = 0
        while self.has_unfinished():
            outs = self.step()
            for o in outs:
                if on_output:
                    on_output(o)
                if o.finished:
                    final[o.request_id] = o
            n += 1
            if not outs and self.stalled():
                raise RuntimeError("engine stalled with unfinished requests")
            if max_steps is not None and n >= max_steps:
                break
        return final


def run_worker_rank(config: EngineConfig, rank: int, world: int, addr: str, port: int) -> None:
    """A rank other than 0, in the child process its host's first rank started: join as ``rank``,
    load this rank's slice, follow rank 0 until told to stop (exit 0) or until the group is lost
    (exit 3)."""
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when the ranks stop
    logging.basicConfig(
        level=logging.WARNING, format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s"
    )
    try:
        engine = LLMEngine(config)
    except BaseException:
        log.exception("tensor-parallel rank %d failed to start", rank)
        os._exit(3)
    os._exit(engine.follow())
