"""The tensors one engine step hands to the model: which tokens, where their KV goes, what to read."""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter

import torch

from .kv_pool import KVPagePool
from .sequence import Sequence

_page, _tag = attrgetter("page"), attrgetter("tag")


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
    """[B, max_pages] physical pages and expected tags of each sequence's block table (0-padded).

    Built from flat lists, one tensor per table: per-row tensors cost more than the check itself."""
    width = max(1, max(len(s.block_table) for s in seqs))
    pages: list[int] = []
    tags: list[int] = []
    for s in seqs:
        pages.extend(map(_page, s.block_table))
        tags.extend(map(_tag, s.block_table))
        pad = [0] * (width - len(s.block_table))
        pages.extend(pad)
        tags.extend(pad)
    shape = (len(seqs), width)
    return (
        torch.tensor(pages, dtype=torch.int32).view(shape).to(device),
        torch.tensor(tags, dtype=torch.int32).view(shape).to(device),
    )
