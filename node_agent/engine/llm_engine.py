"""The engine loop: accept requests, schedule a step, check KV integrity, run the model, emit output.

Follow one request: ``add_request`` tokenizes it and asks admission.py whether it fits, then queues
it as a Sequence (sequence.py); the Scheduler (scheduler.py) admits it and maps its tokens onto KV
pages (../kv/pool.py, the KVPagePool facade); before the step the integrity tracker (integrity.py) checks every mapped page's
generation tag; failure isolation (isolation.py) runs the step through the ModelRunner
(model_runner.py), which builds a StepBatch (models/batch.py) and runs the model (models/llama.py)
on the replica (parallel/replica.py: this process, or every tensor-parallel rank); its layers call
the kernels (pagoda.kernels); sampling.py picks the token; output.py applies the stop rules and
detokenizes; ``step`` returns the outputs (step_budget.py times it, when a budget sizes the steps).
build.py builds the parts, kv_setup.py sizes and calibrates the pools; handoff.py the handoffs.

Failures stay with the request that causes them: a handoff is validated before a page is taken and
rolled back if it fails later; a step that raises is re-run in parts, and only a request that fails
alone ends (finish_reason "error"), so its batch mates' output is what it would have been anyway.
"""

from __future__ import annotations

import logging
import os
import signal
import time

import torch

from pagoda.node_agent.engine.block_tables import block_table_tensor
from pagoda.node_agent.engine.build import build_parts, log_ready
from pagoda.node_agent.engine.config import EngineConfig
from pagoda.node_agent.engine.fault_injection import make_faults
from pagoda.node_agent.engine.guided.cache import GrammarCache
from pagoda.node_agent.engine.handoff import KVPayload
from pagoda.node_agent.engine.integrity import make_tracker
from pagoda.node_agent.engine.isolation import FailureIsolation
from pagoda.node_agent.engine.migration import migrate_prefilled
from pagoda.node_agent.engine.output import RequestOutput, RequestState
from pagoda.node_agent.engine.postprocess import Postprocessor
from pagoda.node_agent.engine.prompts import Prompt, prompt_token_ids
from pagoda.node_agent.engine.scheduler import ScheduledStep
from pagoda.node_agent.engine.sequence import Sequence
from pagoda.node_agent.engine.state import EngineState, EngineStats, engine_state
from pagoda.node_agent.kv.pool import KVPagePool, OutOfPages
from pagoda.node_agent.models.loader import LoadedModel
from pagoda.node_agent.models.tokenizer import Tokenizer
from pagoda.node_agent.models.weight_bytes import phase_format_bytes
from pagoda.node_agent.params import CapacityError, RequestError, SamplingParams

log = logging.getLogger("pagoda.engine")

__all__ = ["LLMEngine", "RequestOutput", "run_worker_rank"]


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
        self.device, self.dtype = config.torch_device(), config.torch_dtype()
        t0 = time.perf_counter()
        parts = build_parts(config, loaded, tokenizer, run_worker_rank)
        self.config = config = parts.config  # the weight formats left at auto, resolved for the source
        self.replica, self.model_config, self.tokenizer = parts.replica, parts.model_config, parts.tokenizer
        self.model, self.runner, self.max_model_len = parts.model, parts.runner, parts.max_model_len
        self.prefill_pool, self.decode_pool = parts.prefill_pool, parts.decode_pool
        self.scheduler, self.stop_rules, self.admission = parts.scheduler, parts.stop_rules, parts.admission
        self.integrity = make_tracker(config.integrity, config.kernel_backend)
        self.grammars = GrammarCache(self.tokenizer, self.model_config.vocab_size, self.stop_rules.eos_ids)
        self.faults = make_faults(self, config.fault_injection)  # raises on use unless enabled
        self.stats = EngineStats()
        self._requests: dict[str, RequestState] = {}
        self._ready: list[RequestOutput] = []  # requests that ended outside a step
        self.isolation = FailureIsolation(self.runner, self.scheduler, self.stats, self._requests)
        shared = (self.scheduler, self.integrity, self.replica, self.stats, self._requests)
        self.postprocess = Postprocessor(*shared, self.tokenizer, self.stop_rules)
        # by part and format, and per phase by the format each layer runs in (models/weight_bytes.py)
        self._weight_breakdown = {**self.model.weight_bytes(), "by_phase": phase_format_bytes(self.model)}
        self._weight_bytes = int(self._weight_breakdown["total"])
        log_ready(parts, self.dtype, self.device, t0)

    # ------------------------------------------------------------------ the replica's life cycle

    @property
    def is_driver(self) -> bool:
        """Whether this process serves requests (rank 0, or no tensor parallelism)."""
        return self.replica.is_driver

    def follow(self) -> int:
        """A rank other than 0: carry out rank 0's instructions until it stops (0) or is lost (3)."""
        return self.replica.follow()

    def tick(self) -> None:
        """Called by an idle serving loop: a keepalive vote when nothing was sent for a while, so a
        dead rank fails the replica even without traffic (raises ReplicaFailure)."""
        self.replica.tick()

    def close(self) -> None:
        """Tell the other ranks to stop and leave the group (idempotent)."""
        self.replica.close()

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
        grammar=None,  # params.guided compiled (serving compiles off this thread); None: compiled here
    ) -> str:
        """Validate and queue a request; returns its id. Raises RequestError on bad input."""
        params = params or SamplingParams()
        params.validate()
        ids = self.tokenize(prompt, chat)
        self.admission.check_prompt(ids, params, prefill_only)
        rid = self.admission.new_id(request_id, self._requests)
        seq = Sequence(rid, ids, params, cache_salt)
        seq.prefill_only, seq.grammar = prefill_only, self.grammars.state_for(params, grammar)
        self._requests[rid] = RequestState(seq, self.tokenizer, self.stop_rules)
        self.scheduler.add(seq)
        return rid

    def add_prefilled(
        self,
        payload: KVPayload,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        grammar=None,
    ) -> str:
        """Continue decoding a sequence prefilled elsewhere: fresh tagged pages, converted on arrival.

        Everything is validated before a page is allocated: RequestError for malformed parameters or
        payload, CapacityError when the decode pool lacks free pages or max_num_seqs is reached,
        IntegrityError when an audited payload fails its checksums. Anything raised after allocation
        releases every page taken and leaves no trace of the request before it propagates."""
        params = params or SamplingParams()
        params.validate()
        self.admission.check_prefilled(payload, params, len(self.scheduler.running))
        rid = self.admission.new_id(request_id or payload.request_id, self._requests)
        self.integrity.verify_payload(rid, payload.layers, payload.meta)  # audit: raises IntegrityError
        try:
            seq = self.replica.receive(payload, self.decode_pool, params, rid, self.config.kernel_backend)
        except OutOfPages as exc:  # receive released what it took
            raise CapacityError("decode KV pool is full; retry later") from exc
        try:
            seq.grammar = self.grammars.state_for(params, grammar)  # replays the first token below
            self._ready += self.postprocess.admit_received(seq, payload.first_token)
        except BaseException:
            self.isolation.discard(seq)
            raise
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
        outputs, self._ready = self._ready, []
        outputs += self._migrate_prefilled()
        step = self.scheduler.schedule()
        if step is None:
            return outputs
        pool = self.prefill_pool if step.phase == "prefill" else self.decode_pool
        step, tables, failed = self._check_step(step, pool)
        outputs += failed
        if step is None:
            return outputs
        sampled, errors = self._run(step, pool, tables)
        outputs += self.isolation.fail_all(errors)
        step = step.excluding(errors)
        if step is None:
            return outputs
        done, post_errors = self.postprocess.outputs(step, pool, sampled)
        self.scheduler.step_done()  # with a time budget, the step's time refines its cost model
        return outputs + done + self.isolation.fail_all(post_errors)

    def _migrate_prefilled(self) -> list[RequestOutput]:
        """Finished prefills move to the decode pool (migration.py); the outputs of those that failed."""
        parts = (self.scheduler, self.replica, self.integrity, self.isolation, self.stats)
        return migrate_prefilled(*parts, self.config.kernel_backend)

    def _check_step(
        self, step: ScheduledStep, pool: KVPagePool
    ) -> tuple[ScheduledStep | None, tuple | None, list[RequestOutput]]:
        """The step's integrity check: (the step without the requests failed closed, its block tables
        or None when it changed, the failed requests' outputs)."""
        # the step's block tables, built once: the integrity check and the model read the same ones
        tables = block_table_tensor(step.seqs, pool.tag_table.device)
        bad = self.replica.check_tags(self.integrity, step.seqs, pool, tables)
        if not bad:
            return step, tables, []
        failed = [self.isolation.fail_integrity(seq, err) for seq, err in bad.items()]
        return step.excluding(bad), None, failed

    def _run(
        self, step: ScheduledStep, pool: KVPagePool, tables: tuple | None
    ) -> tuple[dict[Sequence, int], dict[Sequence, str]]:
        """Run the step, failures isolated (isolation.py), and time it."""
        t0 = time.perf_counter()
        sampled, errors = self.isolation.run(step, pool, tables)
        self.stats.step_seconds[step.phase] += time.perf_counter() - t0
        self.stats.steps += 1
        return sampled, errors

    # ------------------------------------------------------------------ observation

    def pools(self) -> dict[str, KVPagePool]:
        """The KV page pools by name: one shared pool, or a prefill and a decode pool."""
        return {p.name: p for p in (self.prefill_pool, self.decode_pool)}

    def state(self) -> EngineState:
        """A typed snapshot of occupancy, formats and counters (call on the engine's thread)."""
        return engine_state(self)

    # ------------------------------------------------------------------ convenience

    def score(
        self, token_ids: list[int], phase: str = "decode", pool: KVPagePool | None = None
    ) -> torch.Tensor:
        """Next-token logits [T, vocab] (float32) at every position of ``token_ids``, through the paged
        KV path of ``pool`` (default: the phase's pool) with the phase's weights; pages are released."""
        pool = pool or (self.decode_pool if phase == "decode" else self.prefill_pool)
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
