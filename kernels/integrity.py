"""KV page integrity: generation tags checked in one batched step before decode reads pages.

Every physical page has an int32 tag in ``tag_table``, bumped with :func:`next_tag` on each
allocation; a request records the tag it saw for each of its pages. A sequence is flagged when
some page slot ``i < num_pages[b]`` has ``tag_table[block_pages[b, i]] != expected_tags[b, i]``
or its page index lies outside ``[0, len(tag_table))`` (counted as a mismatch, never read), or
``num_pages[b]`` itself lies outside ``[0, max_pages]`` (fail closed).

Tag 0 means "never allocated"; tags run 1 .. 2**31 - 1 and wrap back to 1, so a stale block
table matches a page again only after exactly 2**31 - 1 reallocations of that page.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .dispatch import resolve

TAG_NEVER_ALLOCATED = 0
TAG_MAX = 2**31 - 1


def next_tag(tag: int) -> int:
    """The tag after ``tag``: 1..2**31-1, wrapping to 1 and skipping the reserved 0."""
    if not 0 <= tag <= TAG_MAX:
        raise ValueError(f"tag {tag} outside [0, {TAG_MAX}]")
    return 1 if tag >= TAG_MAX else tag + 1


def next_tags(tags: Tensor) -> Tensor:
    """Vectorized :func:`next_tag` for an int32 tensor of tags."""
    bumped = tags.to(torch.int64) + 1
    return torch.where(bumped > TAG_MAX, torch.ones_like(bumped), bumped).to(tags.dtype)


def _validate(block_pages: Tensor, expected_tags: Tensor, num_pages: Tensor) -> None:
    if block_pages.shape != expected_tags.shape or block_pages.dim() != 2:
        raise ValueError(
            f"block_pages {tuple(block_pages.shape)} and expected_tags {tuple(expected_tags.shape)} "
            "must both be [B, max_pages]"
        )
    if num_pages.shape != (block_pages.shape[0],):
        raise ValueError(f"num_pages must be [{block_pages.shape[0]}], got {tuple(num_pages.shape)}")


def check_page_tags(
    block_pages: Tensor,
    expected_tags: Tensor,
    num_pages: Tensor,
    tag_table: Tensor,
    backend: str | None = None,
) -> Tensor:
    """Per-sequence mismatch mask [B] bool (True = do not trust this sequence's pages)."""
    _validate(block_pages, expected_tags, num_pages)
    be = resolve("check_page_tags", block_pages.device, backend)
    if be == "triton":
        from .triton_integrity import check_page_tags_triton

        return check_page_tags_triton(block_pages, expected_tags, num_pages, tag_table)
    if be == "cpu":
        return _check_vectorized(block_pages, expected_tags, num_pages, tag_table)
    return _check_reference(block_pages, expected_tags, num_pages, tag_table)


def _check_reference(block_pages, expected_tags, num_pages, tag_table) -> Tensor:
    bad = [bool(row) for row in _mismatch_rows(block_pages, expected_tags, num_pages, tag_table)]
    return torch.tensor(bad, dtype=torch.bool, device=block_pages.device)


def _mismatch_rows(block_pages, expected_tags, num_pages, tag_table) -> list[list[tuple]]:
    table = tag_table.tolist()
    rows = []
    for b, (pages, tags, n) in enumerate(
        zip(block_pages.tolist(), expected_tags.tolist(), num_pages.tolist(), strict=True)
    ):
        found_rows = []
        if not 0 <= n <= len(pages):  # a corrupt count: fail closed
            found_rows.append((b, n, -1, -1, None))
            n = 0
        for i in range(n):
            page = pages[i]
            found = table[page] if 0 <= page < len(table) else None
            if found != tags[i]:
                found_rows.append((b, i, page, tags[i], found))
        rows.append(found_rows)
    return rows


def _check_vectorized(block_pages, expected_tags, num_pages, tag_table) -> Tensor:
    max_pages = block_pages.shape[1]
    live = torch.arange(max_pages, device=block_pages.device)[None, :] < num_pages[:, None].long()
    pages = block_pages.long()
    in_range = (pages >= 0) & (pages < tag_table.shape[0])
    found = tag_table[torch.where(in_range, pages, torch.zeros_like(pages))]
    bad = live & (~in_range | (found != expected_tags))
    corrupt_count = (num_pages < 0) | (num_pages > max_pages)
    return bad.any(dim=1) | corrupt_count


def find_mismatches(
    block_pages: Tensor, expected_tags: Tensor, num_pages: Tensor, tag_table: Tensor
) -> list[tuple[int, int, int, int, int | None]]:
    """``(seq_idx, slot, page, expected, found)`` per mismatch, for logs.

    ``found`` is None for an out-of-range page; a corrupt ``num_pages`` reports ``(b, n, -1, -1, None)``.
    """
    _validate(block_pages, expected_tags, num_pages)
    rows = _mismatch_rows(block_pages.cpu(), expected_tags.cpu(), num_pages.cpu(), tag_table.cpu())
    return [m for row in rows for m in row]
