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

from .engine_config import EngineConfig
from .integrity import IntegrityError, make_tracker
from .kv_pool import KVPagePool
from .loader import LoadedModel, load_model
from .model_config import ModelConfig
from .model_runner import ModelRunner
from .models.llama import LlamaForCausalLM
from .scheduler import Scheduler, SchedulerConfig
from .sequence import RequestError, SamplingParams, SeqStatus, Sequence
from .tokenizer import Detokenizer, Tokenizer

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


@dataclass
class EngineStats:
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    step_seconds: dict[str, float] = field(default_factory=lambda: {"prefill": 0.0, "decode": 0.0})


class _Tracked:
    """Per-request output state kept beside the Sequence."""

    def __init__(self, seq: Sequence, detok: Detokenizer) -> None:
        self.seq = seq
        self.detok = detok
        self.sent = 0  # characters of text already emitted
        self.stop_text: str | None = None  # final text, cut before a matched stop string


class LLMEngine:
    """A single-process engine holding both phases (``pagoda serve --role both``)."""

    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None,
                 tokenizer: Tokenizer | None = None) -> None:
        self.config = config = config or EngineConfig()
        config.validate()
        self.device = config.torch_device()
        self.dtype = config.torch_dtype()
        t0 = time.perf_counter()
        loaded = loaded or load_model(config.model)
        self.model_config: ModelConfig = loaded.config
        self.tokenizer = tokenizer or Tokenizer(loaded.tokenizer_dir, loaded.gguf_file)
        formats = {"prefill": config.formats.prefill_weights, "decode": config.formats.decode_weights}
        self.model = LlamaForCausalLM(
            loaded.config, loaded.weights, formats, self.dtype, self.device, backend=config.kernel_backend
        )
        del loaded
        self.max_model_len = min(
            config.max_model_len or self.model_config.max_position, self.model_config.max_position
        )
        if self.model_config.sliding_window:
            self.max_model_len = min(self.max_model_len, self.model_config.sliding_window)
        self.pool = self._make_pool(config.formats.decode_kv)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                enable_prefix_caching=config.enable_prefix_caching,
            ),
            self.pool,
        )
        self.runner = ModelRunner(self.model, config.kernel_backend)
        self.integrity = make_tracker(config.integrity)
        self.stats = EngineStats()
        self._requests: dict[str, _Tracked] = {}
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

    def _make_pool(self, kv_format: str, name: str = "kv") -> KVPagePool:
        from .kv_pool import storage_dtype

        dt = storage_dtype(kv_format, self.dtype)
        comps = self._kv_components()
        pages = KVPagePool.pages_for_budget(
            self.kv_budget_bytes(), self.model_config.num_layers, self.config.page_size, comps, dt
        )
        return KVPagePool(
            self.model_config.num_layers,
            pages,
            self.config.page_size,
            comps,
            dt,
            self.device,
            kv_format=kv_format,
            name=name,
        )

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
        need = len(ids) + min(params.max_tokens, self.max_model_len - len(ids))
        if need > self.pool.capacity_tokens:
            raise RequestError(
                f"prompt + max_tokens ({need} tokens) exceeds the KV cache capacity "
                f"({self.pool.capacity_tokens} tokens)"
            )
        rid = request_id or uuid.uuid4().hex
        if rid in self._requests:
            raise RequestError(f"request id {rid!r} is already in flight")
        seq = Sequence(rid, ids, params, cache_salt)
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
        return bool(self._requests)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; returns outputs of every request that progressed or ended."""
        step = self.scheduler.schedule()
        if step is None:
            return []
        outputs: list[RequestOutput] = []
        bad = self.integrity.check(step.seqs, self.pool)
        if bad:
            outputs += [self._fail_integrity(seq, err) for seq, err in bad.items()]
            keep = [(s, n) for s, n in zip(step.seqs, step.num_new_tokens, strict=True) if s not in bad]
            if not keep:
                return outputs
            step.seqs = [s for s, _ in keep]
            step.num_new_tokens = [n for _, n in keep]
        t0 = time.perf_counter()
        sampled = self.runner.run(step, self.pool)
        self.stats.step_seconds[step.phase] += time.perf_counter() - t0
        self.stats.steps += 1
        for seq, n in zip(step.seqs, step.num_new_tokens, strict=True):
            seq.num_computed_tokens += n
            if step.phase == "prefill":
                self.stats.prefill_tokens += n
            else:
                self.stats.decode_tokens += n
        for seq, tok in sampled.items():
            seq.output_token_ids.append(tok)
            self._check_stop(seq, tok)
        for seq in step.seqs:
            self.scheduler.seal_full_pages(seq)
            if seq.finished:
                self.scheduler.finish(seq)
        for seq in sampled:
            tr = self._requests.get(seq.request_id)
            if tr is not None:
                outputs.append(self._output(tr, finished=seq.finished))
                if seq.finished:
                    self._requests.pop(seq.request_id, None)
                    self.stats.requests_finished += 1
        return outputs

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
    def score(self, token_ids: list[int], phase: str = "decode") -> torch.Tensor:
        """Next-token logits [T, vocab] (float32) at every position of ``token_ids``, through the paged
        KV path with the given phase's weights; the pages are released afterwards."""
        from .scheduler import ScheduledStep
        from .sequence import Sequence

        if not token_ids or len(token_ids) > self.pool.capacity_tokens:
            raise RequestError("score needs 1..capacity tokens")
        seq = Sequence("score", token_ids, SamplingParams(max_tokens=1))
        ps = self.pool.page_size
        try:
            seq.block_table = [self.pool.allocate() for _ in range(-(-len(token_ids) // ps))]
            step = ScheduledStep("prefill", [seq], [len(token_ids)])
            batch, _ = self.runner.build_batch(step, self.pool)
            batch.logits_indices = torch.arange(len(token_ids), device=self.device)
            return self.model.forward(batch, weights_phase=phase)
        finally:
            self.pool.release_all(seq.block_table)

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
