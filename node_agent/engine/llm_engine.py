"""The engine loop: accept requests, schedule a step, check KV integrity, run the model, emit output.

Follow one request: ``add_request`` tokenizes and validates it into a Sequence (sequence.py); the
Scheduler (scheduler.py) admits it and maps its tokens onto KV pages (kv_pool.py); before the step
the integrity tracker (integrity.py) checks every mapped page's generation tag; the ModelRunner
(model_runner.py) builds a StepBatch (step_batch.py) and runs the model (models/llama.py), whose
layers call the kernels (pagoda.kernels); sampling.py picks the token; ``step`` returns outputs.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field

import torch

from pagoda.kernels.paged_attention import RECOMMENDED_KV_HEADROOM, calibrate_kv_scales
from pagoda.node_agent.engine.calibration import CALIBRATION_TEXT
from pagoda.node_agent.engine.config import EngineConfig
from pagoda.node_agent.engine.fault_injection import make_faults
from pagoda.node_agent.engine.handoff import KVPayload, allocate_pages, convert_into, extract_pages, migrate
from pagoda.node_agent.engine.integrity import IntegrityError, make_tracker, release_owned
from pagoda.node_agent.engine.kv_pool import KVPagePool, OutOfPages, storage_dtype
from pagoda.node_agent.engine.model_runner import ModelRunner
from pagoda.node_agent.engine.scheduler import Scheduler, SchedulerConfig
from pagoda.node_agent.engine.sequence import RequestError, SamplingParams, SeqStatus, Sequence
from pagoda.node_agent.models.config import ModelConfig
from pagoda.node_agent.models.llama import LlamaForCausalLM
from pagoda.node_agent.models.loader import LoadedModel, load_model
from pagoda.node_agent.models.tokenizer import Detokenizer, Tokenizer

log = logging.getLogger("pagoda.engine")


@dataclass
class RequestOutput:
    """What a request has produced so far (``delta`` is the new text since the last output)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    delta: str
    finished: bool
    finish_reason: str | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    kv_payload: KVPayload | None = None  # set on a prefill-only request's final output


@dataclass
class EngineStats:
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    migrations: int = 0  # sequences moved from the prefill pool to the decode pool
    step_seconds: dict[str, float] = field(default_factory=lambda: {"prefill": 0.0, "decode": 0.0})


class CapacityError(RuntimeError):
    """The worker cannot take this request now (full); the caller may retry elsewhere or later."""


class _Tracked:
    """Per-request output state kept beside the Sequence."""

    def __init__(self, seq: Sequence, detok: Detokenizer) -> None:
        self.seq = seq
        self.detok = detok
        self.sent = 0  # characters of text already emitted
        self.stop_text: str | None = None  # final text, cut before a matched stop string


class LLMEngine:
    """A single-process engine holding both phases (``pagoda serve --role both``)."""

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
        loaded = loaded or load_model(config.model)
        self.model_config: ModelConfig = loaded.config
        self.tokenizer = tokenizer or Tokenizer(loaded.tokenizer_dir, loaded.gguf_file)
        formats = {"prefill": config.formats.prefill_weights, "decode": config.formats.decode_weights}
        if config.role in formats:  # a single-phase worker holds only its phase's weights
            formats = dict.fromkeys(formats, formats[config.role])
        self.model = LlamaForCausalLM(
            loaded.config,
            loaded.weights,
            formats,
            self.dtype,
            self.device,
            backend=config.kernel_backend,
            int4_group_size=config.int4_group_size,
        )
        del loaded
        self.max_model_len = min(
            config.max_model_len or self.model_config.max_position, self.model_config.max_position
        )
        if self.model_config.sliding_window:
            self.max_model_len = min(self.max_model_len, self.model_config.sliding_window)
        self.runner = ModelRunner(self.model, config.kernel_backend)
        self.prefill_pool, self.pool = self._make_pools()
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
        self._requests: dict[str, _Tracked] = {}
        self._ready: list[RequestOutput] = []
        self.eos_ids = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        log.info(
            "engine ready in %.1fs: %s, %d layers, dtype %s, KV %d pages x %d tokens (%s), device %s",
            time.perf_counter() - t0,
            self.model_config.arch,
            self.model_config.num_layers,
            self.dtype,
            self.pool.num_pages,
            self.pool.page_size,
            self.pool.kv_format,
            self.device,
        )

    # ------------------------------------------------------------------ setup

    def kv_budget_bytes(self) -> int:
        if self.config.kv_memory is not None:
            return self.config.kv_memory
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * self.config.kv_memory_fraction)
        return self.config.cpu_kv_default

    def _kv_components(self) -> dict[str, tuple[int, ...]]:
        c = self.model_config
        return {"k": (c.num_kv_heads, c.head_dim), "v": (c.num_kv_heads, c.head_dim)}

    def _make_pool(self, kv_format: str, budget: int, name: str) -> KVPagePool:
        dt = storage_dtype(kv_format, self.dtype)
        comps = self._kv_components()
        pages = KVPagePool.pages_for_budget(
            budget, self.model_config.num_layers, self.config.page_size, comps, dt
        )
        pool = KVPagePool(
            self.model_config.num_layers,
            pages,
            self.config.page_size,
            comps,
            dt,
            self.device,
            kv_format=kv_format,
            name=name,
        )
        if pool.scales is not None:
            self._calibrate(pool)
        return pool

    def _make_pools(self) -> tuple[KVPagePool, KVPagePool]:
        """(prefill pool, decode pool): one shared pool when both phases use the same KV format."""
        f = self.config.formats
        budget = self.kv_budget_bytes()
        only = {"prefill": f.prefill_kv, "decode": f.decode_kv}.get(self.config.role)
        if only or f.prefill_kv == f.decode_kv:
            pool = self._make_pool(only or f.decode_kv, budget, "kv")
            return pool, pool
        pre = int(budget * self.config.prefill_kv_fraction)
        return (
            self._make_pool(f.prefill_kv, pre, "prefill-kv"),
            self._make_pool(f.decode_kv, budget - pre, "decode-kv"),
        )

    @torch.inference_mode()
    def _calibrate(self, pool: KVPagePool) -> None:
        """Static FP8 scales per layer and KV head from the K/V of a short built-in text."""
        ids = self.tokenizer.encode(CALIBRATION_TEXT)[: self.max_model_len]
        n = len(ids)
        tmp = KVPagePool(
            self.model_config.num_layers,
            -(-n // self.config.page_size),
            self.config.page_size,
            self._kv_components(),
            self.dtype,
            self.device,
            name="calibration",
        )
        self.score(ids, phase="prefill", pool=tmp)
        for layer, scales in zip(tmp.layers, pool.scales, strict=True):
            ks, vs = calibrate_kv_scales(
                layer["k"].flatten(0, 1)[:n], layer["v"].flatten(0, 1)[:n], headroom=RECOMMENDED_KV_HEADROOM
            )
            scales["k"].copy_(ks)
            scales["v"].copy_(vs)
        log.info("calibrated FP8 KV scales of %s on %d tokens", pool.name, n)

    # ------------------------------------------------------------------ requests

    def tokenize(self, prompt: str | list[int] | list[dict], chat: bool = False) -> list[int]:
        """Prompt text, token ids or chat messages -> token ids (validated)."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            ids = self.tokenizer.apply_chat_template(prompt)
        elif isinstance(prompt, list):
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise RequestError(f"token ids out of range [0, {self.model_config.vocab_size}): {bad[:5]}")
        elif isinstance(prompt, str):
            if chat:
                ids = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            else:
                ids = self.tokenizer.encode(prompt)
        else:
            raise RequestError(
                f"prompt must be a string, token ids or chat messages, got {type(prompt).__name__}"
            )
        if not ids or (isinstance(prompt, str) and not prompt):
            raise RequestError("prompt is empty")
        return ids

    def add_request(
        self,
        prompt: str | list[int] | list[dict],
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
                f"(prompt + at least one new token must fit)"
            )
        if len(ids) + 1 > self.prefill_pool.capacity_tokens:
            raise RequestError(
                f"prompt has {len(ids)} tokens; the prefill KV pool holds {self.prefill_pool.capacity_tokens}"
            )
        need = len(ids) + min(params.max_tokens, self.max_model_len - len(ids))
        if prefill_only:
            need = len(ids) + 1
        if need > self.pool.capacity_tokens:
            raise RequestError(
                f"prompt + max_tokens ({need} tokens) exceeds the KV cache capacity "
                f"({self.pool.capacity_tokens} tokens)"
            )
        rid = request_id or uuid.uuid4().hex
        if rid in self._requests:
            raise RequestError(f"request id {rid!r} is already in flight")
        seq = Sequence(rid, ids, params, cache_salt)
        seq.prefill_only = prefill_only
        self._requests[rid] = _Tracked(seq, Detokenizer(self.tokenizer))
        self.scheduler.add(seq)
        return rid

    def abort(self, request_id: str, reason: str = "aborted") -> RequestOutput | None:
        """Cancel a request (client gone): pages are released at once."""
        tr = self._requests.pop(request_id, None)
        if tr is None:
            return None
        self.scheduler.abort(tr.seq)
        tr.seq.status = SeqStatus.FINISHED
        tr.seq.finish_reason = "abort"
        tr.seq.error = reason
        self.stats.requests_aborted += 1
        return self._output(tr, finished=True)

    def has_unfinished(self) -> bool:
        return bool(self._requests) or bool(self._ready)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; returns outputs of every request that progressed or ended."""
        outputs, self._ready = self._ready, []  # requests that ended outside a step
        outputs += self._migrate_prefilled()
        step = self.scheduler.schedule()
        if step is None:
            return outputs
        pool = self.prefill_pool if step.phase == "prefill" else self.pool
        bad = self.integrity.check(step.seqs, pool)
        if bad:
            outputs += [self._fail_integrity(seq, err) for seq, err in bad.items()]
            keep = [(s, n) for s, n in zip(step.seqs, step.num_new_tokens, strict=True) if s not in bad]
            if not keep:
                return outputs
            step.seqs = [s for s, _ in keep]
            step.num_new_tokens = [n for _, n in keep]
        t0 = time.perf_counter()
        sampled = self.runner.run(step, pool)
        self.stats.step_seconds[step.phase] += time.perf_counter() - t0
        self.stats.steps += 1
        for seq, n in zip(step.seqs, step.num_new_tokens, strict=True):
            seq.num_computed_tokens += n
            if step.phase == "prefill":
                self.stats.prefill_tokens += n
            else:
                self.stats.decode_tokens += n
        payloads: dict[Sequence, KVPayload] = {}
        for seq, tok in sampled.items():
            seq.output_token_ids.append(tok)
            self._check_stop(seq, tok)
            if seq.prefill_only and not seq.finished:
                payloads[seq] = self._payload_of(seq)
                seq.status = SeqStatus.FINISHED
                seq.finish_reason = "prefilled"
        for seq in step.seqs:
            self.scheduler.seal_full_pages(seq)
            self.integrity.sealed(seq, pool)  # audit: checksum of each newly sealed page
            if seq.finished:
                self.scheduler.finish(seq)
        for seq in sampled:
            tr = self._requests.get(seq.request_id)
            if tr is not None:
                out = self._output(tr, finished=seq.finished)
                out.kv_payload = payloads.get(seq)
                outputs.append(out)
                if seq.finished:
                    self._requests.pop(seq.request_id, None)
                    self.stats.requests_finished += 1
        return outputs

    def _migrate_prefilled(self) -> list[RequestOutput]:
        """Move finished prefills from the prefill pool to the decode pool, converting the KV format.
        Pages are tag-checked before they are copied; returns the outputs of requests failed closed."""
        failed: list[RequestOutput] = []
        for seq in self.scheduler.awaiting_migration():
            err = self.integrity.check([seq], self.prefill_pool).get(seq)
            if err is not None:
                failed.append(self._fail_integrity(seq, err))
                continue
            try:
                refs = migrate(self.prefill_pool, self.pool, seq.block_table, self.config.kernel_backend)
            except OutOfPages:
                break  # decode frees pages as sequences finish; try again next step
            seq.block_table = refs
            seq.pool_name = self.pool.name
            self.stats.migrations += 1
        return failed

    # ------------------------------------------------------------------ disaggregation hooks

    def _payload_of(self, seq: Sequence) -> KVPayload:
        layers, scales = extract_pages(self.prefill_pool, seq.block_table)
        gen = seq.generator.get_state() if seq.generator is not None else None
        return KVPayload(
            seq.request_id,
            list(seq.prompt_token_ids),
            seq.output_token_ids[0],
            self.prefill_pool.page_size,
            self.prefill_pool.kv_format,
            layers,
            scales,
            gen,
            seq.num_cached_tokens,
            meta=self.integrity.payload_meta(layers),  # audit: per-page checksums
        )

    def add_prefilled(
        self, payload: KVPayload, params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Continue decoding a sequence prefilled elsewhere: fresh tagged pages, converted on arrival.
        Raises RequestError on a malformed payload and CapacityError when the decode pool is full."""
        params = params or SamplingParams()
        params.validate()
        ps = self.pool.page_size
        if payload.page_size != ps:
            raise RequestError(f"KV payload page size {payload.page_size} != this worker's {ps}")
        if payload.num_pages != -(-payload.num_tokens // ps) or len(payload.layers) != len(self.pool.layers):
            raise RequestError("KV payload shape does not match its token count or this model")
        if len(self.scheduler.running) >= self.config.max_num_seqs:
            raise CapacityError("decode worker is at max_num_seqs; retry later")
        rid = request_id or payload.request_id or uuid.uuid4().hex
        if rid in self._requests:
            raise RequestError(f"request id {rid!r} is already in flight")
        self.integrity.verify_payload(rid, payload.layers, payload.meta)  # audit: raises IntegrityError
        try:
            refs = allocate_pages(self.pool, payload.num_pages)
        except OutOfPages as exc:
            raise CapacityError("decode KV pool is full; retry later") from exc
        convert_into(self.pool, refs, payload.layers, payload.scales, backend=self.config.kernel_backend)
        seq = Sequence(rid, payload.prompt_token_ids, params)
        if payload.generator_state is not None and seq.generator is not None:
            seq.generator.set_state(payload.generator_state)
        seq.output_token_ids = [payload.first_token]
        seq.block_table = refs
        seq.pool_name = self.pool.name
        seq.num_computed_tokens = payload.num_tokens
        seq.num_cached_tokens = payload.num_cached_tokens
        seq.status = SeqStatus.RUNNING
        tr = _Tracked(seq, Detokenizer(self.tokenizer))
        self._requests[rid] = tr
        self._check_stop(seq, payload.first_token)
        if seq.finished:  # the first token already ends it: reported by the next step()
            self.pool.release_all(refs)
            seq.block_table = []
            self._ready.append(self._output(self._requests.pop(rid), finished=True))
            self.stats.requests_finished += 1
        else:
            self.scheduler.running.append(seq)
        return rid

    def _check_stop(self, seq: Sequence, tok: int) -> None:
        p = seq.params
        reason = None
        if (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            reason = "stop"
        elif len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        if p.stop:
            tr = self._requests[seq.request_id]
            text = tr.detok.update(seq.output_token_ids)
            hits = [text.find(s) for s in p.stop if s in text]
            if hits:
                tr.stop_text = text[: min(hits)]
                reason = "stop"
        if reason:
            seq.status = SeqStatus.FINISHED
            seq.finish_reason = reason

    def _fail_integrity(self, seq: Sequence, err: IntegrityError) -> RequestOutput:
        """Fail closed: end only this request with an explicit error and release its pages."""
        log.error("integrity: aborting %s: %s", seq.request_id, err)
        live = self.scheduler.running + list(self.scheduler.waiting)
        release_owned(seq, self.scheduler.pool_of(seq), live)  # never a page now owned by another
        self.scheduler.abort(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = "error"
        seq.error = str(err)
        self.stats.requests_aborted += 1
        tr = self._requests.pop(seq.request_id)
        return self._output(tr, finished=True)

    def _output(self, tr: _Tracked, finished: bool) -> RequestOutput:
        seq = tr.seq
        if seq.error is not None:
            text = ""  # fail closed: nothing built on a bad step is returned
        elif tr.stop_text is not None:
            text = tr.stop_text
        else:
            text = tr.detok.update(seq.output_token_ids)
        visible = text
        if not finished and seq.params.stop:  # hold back what could be the start of a stop string
            hold = max(len(s) for s in seq.params.stop) - 1
            visible = text[: max(len(text) - hold, tr.sent)]
        delta = visible[tr.sent :]
        tr.sent = max(tr.sent, len(visible))
        return RequestOutput(
            seq.request_id,
            seq.prompt_token_ids,
            list(seq.output_token_ids),
            text,
            delta,
            finished,
            seq.finish_reason,
            seq.error,
            seq.num_cached_tokens,
        )

    # ------------------------------------------------------------------ convenience

    @torch.inference_mode()
    def score(
        self, token_ids: list[int], phase: str = "decode", pool: KVPagePool | None = None
    ) -> torch.Tensor:
        """Next-token logits [T, vocab] (float32) at every position of ``token_ids``, through the paged
        KV path of ``pool`` (default: the phase's pool) with the phase's weights; pages are released."""
        from pagoda.node_agent.engine.scheduler import ScheduledStep

        pool = pool or (self.pool if phase == "decode" else self.prefill_pool)
        if not token_ids or len(token_ids) > pool.capacity_tokens:
            raise RequestError(f"score needs 1..{pool.capacity_tokens} tokens")
        seq = Sequence("score", token_ids, SamplingParams(max_tokens=1))
        seq.block_table = allocate_pages(pool, -(-len(token_ids) // pool.page_size))
        try:
            step = ScheduledStep("prefill", [seq], [len(token_ids)])
            batch, _ = self.runner.build_batch(step, pool)
            batch.logits_indices = torch.arange(len(token_ids), device=self.device)
            return self.model.forward(batch, weights_phase=phase)
        finally:
            pool.release_all(seq.block_table)

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
            if not outs and not self.scheduler.has_work() and self.has_unfinished():
                raise RuntimeError("engine stalled with unfinished requests")
            if max_steps is not None and n >= max_steps:
                break
        return final
