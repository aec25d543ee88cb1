"""Turns a scheduled step into tensors, runs the model and samples the next tokens."""

from __future__ import annotations

from typing import Protocol

import torch

from pagoda.kernels.selector import select_kernels
from pagoda.node_agent.engine.block_tables import block_table_tensor
from pagoda.node_agent.engine.config import EngineConfig
from pagoda.node_agent.engine.sampling import sample
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
    make_plan,
    mlp_units,
    shard_weights,
)
from pagoda.node_agent.params import SamplingParams


def build_model(
    config: EngineConfig, loaded: LoadedModel, dtype: torch.dtype, device: torch.device, group=None
) -> LlamaForCausalLM:
    """The model with each phase's weight format (a single-phase worker holds only its phase's).
    With a tensor-parallel ``group`` (engine/parallel/group.py): this rank's slice of it."""
    formats = {"prefill": config.formats.prefill_weights, "decode": config.formats.decode_weights}
    if config.role in formats:
        formats = dict.fromkeys(formats, formats[config.role])
    cfg, weights, tp = loaded.config, loaded.weights, None
    if group is not None:
        fmts = set(formats.values())
        units = mlp_units(weights, cfg, fmts, config.int4_group_size)
        plan = make_plan(cfg, group.rank, group.world, *units)
        weights = shard_weights(weights, cfg, plan, fmts)
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
    return LlamaForCausalLM(
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


def context_limit(config: EngineConfig, mc: ModelConfig) -> int:
    """Tokens one sequence may hold: the configured length within the model's (and its window)."""
    limit = min(config.max_model_len or mc.max_position, mc.max_position)
    return min(limit, mc.sliding_window) if mc.sliding_window else limit


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
        ids: list[int] = []
        starts: list[int] = []
        lens: list[int] = []
        cu = [0]
        logit_rows: list[int] = []
        samplers: list[Sequence] = []
        for seq, n in zip(step.seqs, step.num_new_tokens, strict=True):
            start = seq.num_computed_tokens
            n_prompt = len(seq.prompt_token_ids)
            ids += seq.prompt_token_ids[start : start + n]  # empty once past the prompt
            if start + n > n_prompt:
                ids += seq.output_token_ids[max(0, start - n_prompt) : start + n - n_prompt]
            starts.append(start)
            lens.append(n)
            cu.append(cu[-1] + n)
            if start + n == seq.num_tokens:  # reached the newest token: sample the next one
                logit_rows.append(cu[-1] - 1)
                samplers.append(seq)
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
        batch = StepBatch(
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
        return batch, samplers

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
    ) -> dict[Sequence, int]:
        """Run one step; returns the sampled token for each sequence that reached its newest token."""
        batch, samplers = self.build_batch(step, pool, tables)
        if not samplers:
            self.forward(batch, pool, logits=False)
            return {}
        logits = self.forward(batch, pool)
        return dict(zip(samplers, sample(logits, samplers), strict=True))
