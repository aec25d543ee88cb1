"""Turns a scheduled step into tensors, runs the model and samples the next tokens."""

from __future__ import annotations

import torch

from pagoda.node_agent.engine.block_tables import block_table_tensor
from pagoda.node_agent.engine.config import EngineConfig
from pagoda.node_agent.engine.kv_pool import KVPagePool
from pagoda.node_agent.engine.sampling import sample
from pagoda.node_agent.engine.scheduler import ScheduledStep
from pagoda.node_agent.engine.sequence import SamplingParams, Sequence
from pagoda.node_agent.models.batch import StepBatch
from pagoda.node_agent.models.config import ModelConfig
from pagoda.node_agent.models.llama import LlamaForCausalLM
from pagoda.node_agent.models.loader import LoadedModel


def build_model(
    config: EngineConfig, loaded: LoadedModel, dtype: torch.dtype, device: torch.device
) -> LlamaForCausalLM:
    """The model with each phase's weight format (a single-phase worker holds only its phase's)."""
    formats = {"prefill": config.formats.prefill_weights, "decode": config.formats.decode_weights}
    if config.role in formats:
        formats = dict.fromkeys(formats, formats[config.role])
    return LlamaForCausalLM(
        loaded.config,
        loaded.weights,
        formats,
        dtype,
        device,
        backend=config.kernel_backend,
        int4_group_size=config.int4_group_size,
    )


def context_limit(config: EngineConfig, mc: ModelConfig) -> int:
    """Tokens one sequence may hold: the configured length within the model's (and its window)."""
    limit = min(config.max_model_len or mc.max_position, mc.max_position)
    return min(limit, mc.sliding_window) if mc.sliding_window else limit


class ModelRunner:
    """Owns the model; builds StepBatch metadata and returns sampled tokens."""

    def __init__(self, model: LlamaForCausalLM, kernel_backend: str | None = None) -> None:
        self.model = model
        self.device = model.device
        self.kernel_backend = kernel_backend

    def build_batch(self, step: ScheduledStep, pool: KVPagePool) -> tuple[StepBatch, list[Sequence]]:
        """Tensors for the step, and the sequences whose last new token yields a sample."""
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        cu = [0]
        ctx: list[int] = []
        logit_rows: list[int] = []
        samplers: list[Sequence] = []
        ps = pool.page_size
        for seq, n in zip(step.seqs, step.num_new_tokens, strict=True):
            start = seq.num_computed_tokens
            for p in range(start, start + n):
                ids.append(seq.token_at(p))
                pos.append(p)
                slots.append(seq.block_table[p // ps].page * ps + p % ps)
            cu.append(cu[-1] + n)
            ctx.append(start + n)
            if start + n == seq.num_tokens:  # reached the newest token: sample the next one
                logit_rows.append(cu[-1] - 1)
                samplers.append(seq)
        dev = self.device
        pages, _ = block_table_tensor(step.seqs, dev)
        batch = StepBatch(
            phase=step.phase,
            kv=pool,
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(pos, dtype=torch.long, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_tables=pages,
            context_lens=torch.tensor(ctx, dtype=torch.int32, device=dev),
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
            return self.model.forward(batch, weights_phase=phase)
        finally:
            pool.release_all(seq.block_table)

    def run(self, step: ScheduledStep, pool: KVPagePool) -> dict[Sequence, int]:
        """Run one step; returns the sampled token for each sequence that reached its newest token."""
        batch, samplers = self.build_batch(step, pool)
        if not samplers:
            self.model.forward_no_logits(batch)
            return {}
        logits = self.model.forward(batch)
        return dict(zip(samplers, sample(logits, samplers), strict=True))
