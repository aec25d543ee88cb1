"""The tensors one engine step hands to the model: which tokens, where their KV goes, what to read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class PagedKV(Protocol):
    """What a model needs of a paged KV cache: one layer's page tensors and FP8 scales, by component.

    The engine's KV page pool provides it; a model never sees the pool's bookkeeping."""

    def layer_cache(self, layer: int) -> dict[str, torch.Tensor]: ...

    def layer_scales(self, layer: int) -> dict[str, torch.Tensor]: ...


@dataclass
class StepBatch:
    """Metadata of one forward pass over a ragged batch (prefill chunks) or one token per sequence."""

    phase: str  # "prefill" or "decode": selects the phase's weights and the attention kernel
    kv: PagedKV
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] int64: page * page_size + offset for each new token's KV
    block_tables: torch.Tensor  # [B, max_pages] int32 physical pages (padded with 0)
    context_lens: torch.Tensor  # [B] int32 tokens in cache per sequence after this step
    cu_q_lens: torch.Tensor  # [B + 1] int32 query offsets into T (prefill)
    logits_indices: torch.Tensor  # rows of T whose next-token logits are needed
    kernel_backend: str | None = None
