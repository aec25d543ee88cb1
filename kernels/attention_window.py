"""Sliding-window attention helpers shared by the paged attention paths (torch, native, Triton).

A query at position p sees the keys at positions p - window < j <= p, itself included (transformers'
sliding-window mask); ``window=None`` attends to every earlier key.
"""

from __future__ import annotations

import torch
from torch import Tensor


def check_window(window: int | None) -> int | None:
    """``window`` as the kernels take it: None (attend to every earlier key) or an int >= 1."""
    if window is None:
        return None
    if isinstance(window, bool) or int(window) != window or window < 1:
        raise ValueError(f"window must be None or a positive int, got {window!r}")
    return int(window)


def window_tables(
    block_tables: Tensor, context_lens: Tensor, window: int | None, page_size: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Block tables and lengths with the pages before each decode query's window dropped:
    ``(tables, lens, first_page)``. Sequence b's token j moves to ``j - first_page[b] * page_size``;
    its query (the last token) keeps the same keys, ``window`` of them at most, now within
    ``ceil((window - 1) / page_size) + 1`` pages. Without a window the inputs come back as they are."""
    lens = context_lens.long()
    if window is None or block_tables.shape[1] == 0:
        return block_tables, context_lens, torch.zeros_like(lens)
    first = (lens - window).clamp(min=0) // page_size
    cols = min(block_tables.shape[1], -(-(window - 1) // page_size) + 1)
    idx = (first[:, None] + torch.arange(cols, device=lens.device)[None, :]).clamp(
        max=block_tables.shape[1] - 1
    )
    tables = block_tables.gather(1, idx.to(block_tables.device))
    return tables, (lens - first * page_size).to(context_lens.dtype), first
