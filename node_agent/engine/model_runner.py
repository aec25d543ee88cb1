"""Turns a scheduled step into tensors, runs the model and samples the next tokens."""

from __future__ import annotations

import logging
from typing import NamedTuple, Protocol

import torch

from pagoda.kernels.selector import select_kernels
from pagoda.node_agent.engine.block_tables import block_table_tensor
from pagoda.node_agent.engine.config import EngineConfig
from pagoda.node_agent.engine.logprobs import prompt_spans, score_prompts
from pagoda.node_agent.engine.sampling import StepSamples, sample
from pagoda.node_agent.engine.scheduler import ScheduledStep
from pagoda.node_agent.engine.sequence import Sequence
from pagoda.node_agent.kv.pool import KVPagePool
from pagoda.node_agent.models.batch import StepBatch
from pagoda.node_agent.models.config import ModelConfig
from pagoda.node_agent.models.llama import LlamaForCausalLM
from pagoda.node_agent.models.loader import LoadedModel
from pagoda.node_agent.models.parallel import (
    TensorParallel,
    local_config,
    rank_weights,
)
from pagoda.node_agent.models.weight_bytes import phase_format_bytes
from pagoda.node_agent.params import SamplingParams

log = logging.getLogger("pagoda.engine")


def build_model(
    config: EngineConfig, loaded: LoadedModel, dtype: torch.dtype, device: torch.device, group=None
) -> LlamaForCausalLM:
    """The model with each phase's weight format (a single-phase worker holds only its phase's).
    With a tensor-parallel ``group`` (engine/parallel/group.py): this rank's slice of it."""
    formats = {"prefill": config.formats.prefill_weights, "decode": config.formats.decode_weights}
    if config.role in formats:
        formats = dict.fromkeys(formats, formats[config.role])
    cfg, tp = loaded.config, None
    rank, world = (group.rank, group.world) if group is not None else (0, 1)
    plan, weights = rank_weights(
        loaded.weights, cfg, rank, world, set(formats.values()), config.int4_group_size
    )
    if group is not None:
        cfg = local_config(cfg, plan)
        tp = TensorParallel(plan, loaded.config.vocab_size, group.data)
    return _build(config, cfg, weights, formats, dtype, device, tp)


def _build(
    config: EngineConfig,
    cfg: ModelConfig,
    weights: dict,
    formats: dict,
    dtype: torch.dtype,
    device: torch.device,
    tp: TensorParallel | None,
):
    kernels = select_kernels(
        device, dtype, config.kernel_backend, config.int4_compute, config.allow_kernel_fallback
    )
    model = LlamaForCausalLM(
        cfg,
        weights,
        formats,
        dtype,
        device,
        kernels=kernels,
        int4_group_size=config.int4_group_size,
        decode_head_format="dense" if config.role == "prefill" else config.decode_lm_head,
        head_phases_shared=config.role == "decode",
        tp=tp,
    )
    for phase, by_fmt in phase_format_bytes(model).items():
        log.info("%s weights by format: %s", phase, ", ".join(f"{f} {n}" for f, n in by_fmt.items()))
    return model


def context_limit(config: EngineConfig, mc: ModelConfig) -> int:
    """Tokens one sequence may hold: the configured length within the model's (a sliding window
    limits what each query sees, not the context)."""
    return min(config.max_model_len or mc.max_position, mc.max_position)


def _slot_mapping(
    pages: torch.Tensor, seqs: list[Sequence], pos: torch.Tensor, row: torch.Tensor, ps: int
) -> torch.Tensor:
    """The KV slot (page * page size + offset) of each token at ``pos`` of sequence ``row``."""
    block = pos // ps
    mapped = torch.tensor([len(s.block_table) for s in seqs], dtype=torch.long)
    if bool((block >= mapped[row]).any()):  # never write through a table's 0-padding
        raise RuntimeError("a scheduled token has no KV page mapped in its block table")
    at = pages.device
    return pages.long()[row.to(at), block.to(at)] * ps + (pos % ps).to(at)


class LogitRows(NamedTuple):
    """Where a step's logits rows go: ``sample`` (one per sampling sequence, in order) and ``prompt``
    (indices of the rows scoring the prompt positions of ``spans``: (seq, lo, hi) each)."""

    sample: list[int]
    prompt: list[int]
    spans: list[tuple[Sequence, int, int]]


class Replica(Protocol):
    """Where the model runs: one process, or every rank of a tensor-parallel replica
    (engine/parallel/replica.py)."""

    def run_model(
        self, model, batch: StepBatch, pool: KVPagePool, weights_phase: str | None, logits: bool
    ): ...


class ModelRunner:
    """Owns the model; builds StepBatch metadata and returns sampled tokens."""

    def __init__(self, model: LlamaForCausalLM, kernel_backend: str | None, replica: Replica) -> None:
        self.model = model
        self.device = model.device
        self.kernel_backend = kernel_backend
        self.replica = replica  # tensor parallel: rank 0 sends each batch to the other ranks first

    def forward(
        self, batch: StepBatch, pool: KVPagePool, weights_phase: str | None = None, logits: bool = True
    ):
        """Run the model on ``batch`` (on every rank of a tensor-parallel replica); logits or None."""
        return self.replica.run_model(self.model, batch, pool, weights_phase, logits)

    def build_batch(
        self,
        step: ScheduledStep,
        pool: KVPagePool,
        tables: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[StepBatch, list[Sequence]]:
        """Tensors for the step, and the sequences whose last new token yields a sample.

        ``tables`` are the step's block tables when the caller built them already (the integrity
        check reads the same ones); no Python loop runs per token, only per sequence."""
        batch, samplers, _ = self.build_step(step, pool, tables)
        return batch, samplers

    def build_step(
        self,
        step: ScheduledStep,
        pool: KVPagePool,
        tables: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[StepBatch, list[Sequence], LogitRows]:
        """``build_batch``, and which rows of the step's logits sample and which score prompt tokens
        (the prompt logprobs of the sequences that asked, each position once, chunk by chunk)."""
        ids: list[int] = []
        starts: list[int] = []
        lens: list[int] = []
        cu = [0]
        logit_rows: list[int] = []
        samplers: list[Sequence] = []
        rows = LogitRows([], [], [])
        for seq, n in zip(step.seqs, step.num_new_tokens, strict=True):
            start = seq.num_computed_tokens
            n_prompt = len(seq.prompt_token_ids)
            ids += seq.prompt_token_ids[start : start + n]  # empty once past the prompt
            if start + n > n_prompt:
                ids += seq.output_token_ids[max(0, start - n_prompt) : start + n - n_prompt]
            starts.append(start)
            lens.append(n)
            cu.append(cu[-1] + n)
            lo, hi = prompt_spans(seq, start, n)
            if hi > lo:  # position j's logits score prompt token j + 1
                rows.spans.append((seq, lo, hi))
                rows.prompt.extend(range(len(logit_rows), len(logit_rows) + hi - lo))
                logit_rows += range(cu[-2] + lo - start, cu[-2] + hi - start)
            if start + n == seq.num_tokens:  # reached the newest token: sample the next one
                rows.sample.append(len(logit_rows))
                logit_rows.append(cu[-1] - 1)
                samplers.append(seq)
        batch = self._tensors(step, pool, tables, ids, starts, lens, cu, logit_rows)
        return batch, samplers, rows

    def _tensors(
        self,
        step: ScheduledStep,
        pool: KVPagePool,
        tables: tuple[torch.Tensor, torch.Tensor] | None,
        ids: list[int],
        starts: list[int],
        lens: list[int],
        cu: list[int],
        logit_rows: list[int],
    ) -> StepBatch:
        """The StepBatch of the step's gathered token ids, chunk starts and lengths."""
        dev = self.device
        pages = (tables if tables is not None else block_table_tensor(step.seqs, dev))[0]
        n_tok = cu[-1]
        lens_t = torch.tensor(lens, dtype=torch.long)
        ctx = torch.tensor(starts, dtype=torch.long) + lens_t
        if n_tok == len(lens):  # one token per sequence (a decode step)
            row = torch.arange(len(lens))
            pos = ctx - 1
        else:
            row = torch.repeat_interleave(torch.arange(len(lens)), lens_t)
            first = torch.tensor(cu[:-1], dtype=torch.long)
            pos = torch.repeat_interleave(torch.tensor(starts, dtype=torch.long) - first, lens_t)
            pos = pos + torch.arange(n_tok)
        slots = _slot_mapping(pages, step.seqs, pos, row, pool.page_size)
        return StepBatch(
            phase=step.phase,
            kv=pool,
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=pos.to(dev),
            slot_mapping=slots.to(dev),
            block_tables=pages,
            context_lens=ctx.to(device=dev, dtype=torch.int32),
            cu_q_lens=torch.tensor(cu, dtype=torch.int32, device=dev),
            logits_indices=torch.tensor(logit_rows, dtype=torch.long, device=dev),
            kernel_backend=self.kernel_backend,
        )

    @torch.inference_mode()
    def score(self, token_ids: list[int], pool: KVPagePool, phase: str = "decode") -> torch.Tensor:
        """Next-token logits [T, vocab] (float32) at every position of ``token_ids``, through the paged
        KV path of ``pool`` with the phase's weights; the pages are released afterwards."""
        seq = Sequence("score", token_ids, SamplingParams(max_tokens=1))
        seq.block_table = pool.allocate_pages(-(-len(token_ids) // pool.page_size))
        try:
            batch, _ = self.build_batch(ScheduledStep("prefill", [seq], [len(token_ids)]), pool)
            batch.logits_indices = torch.arange(len(token_ids), device=self.device)
            return self.forward(batch, pool, weights_phase=phase)
        finally:
            pool.release_all(seq.block_table)

    def run(
        self,
        step: ScheduledStep,
        pool: KVPagePool,
        tables: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> StepSamples:
        """Run one step; returns the sampled token for each sequence that reached its newest token
        (a dict), with the logprobs and the prompt logprobs of the sequences that asked beside it."""
        batch, samplers, rows = self.build_step(step, pool, tables)
        if not samplers and not rows.spans:
            self.forward(batch, pool, logits=False)
            return StepSamples()
        logits = self.forward(batch, pool)
        prompt = {}
        if rows.spans:
            at = torch.tensor(rows.prompt, device=logits.device)
            prompt = score_prompts(logits[at], rows.spans)
            logits = logits[torch.tensor(rows.sample, dtype=torch.long, device=logits.device)]
        if not samplers:
            return StepSamples(prompt_logprobs=prompt)
        picked = sample(logits, samplers)
        lps = {s: e for s, e in zip(samplers, picked.logprobs, strict=True) if e is not None}
        return StepSamples(zip(samplers, picked.tokens, strict=True), lps, prompt)
