"""The tensors one engine step hands to the model: which tokens, where their KV goes, what to read."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv_pool import KVPagePool
from .sequence import Sequence


@dataclass
class StepBatch:
    """Metadata of one forward pass over a ragged batch (prefill chunks) or one token per sequence."""

    phase: str  # "prefill" or "decode": selects the phase's weights and the attention kernel
    pool: KVPagePool
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] int64: page * page_size + offset for each new token's KV
    block_tables: torch.Tensor  # [B, max_pages] int32 physical pages (padded with 0)
    context_lens: torch.Tensor  # [B] int32 tokens in cache per sequence after this step
    cu_q_lens: torch.Tensor  # [B + 1] int32 query offsets into T (prefill)
    logits_indices: torch.Tensor  # rows of T whose next-token logits are needed
    kernel_backend: str | None = None


def block_table_tensor(seqs: list[Sequence], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, max_pages] physical pages and expected tags of each sequence's block table (0-padded)."""
    width = max(1, max(len(s.block_table) for s in seqs))
    pages = torch.zeros((len(seqs), width), dtype=torch.int32)
    tags = torch.zeros((len(seqs), width), dtype=torch.int32)
    for i, s in enumerate(seqs):
        n = len(s.block_table)
        if n:
            pages[i, :n] = torch.tensor([r.page for r in s.block_table], dtype=torch.int32)
            tags[i, :n] = torch.tensor([r.tag for r in s.block_table], dtype=torch.int32)
    return pages.to(device), tags.to(device)
