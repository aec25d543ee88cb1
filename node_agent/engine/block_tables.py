"""Block tables as tensors: the physical pages and expected tags of a batch of sequences."""

from __future__ import annotations

from operator import attrgetter

import torch

from pagoda.node_agent.engine.sequence import Sequence

_page, _tag = attrgetter("page"), attrgetter("tag")


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
