"""Triton kernel for the KV page integrity check: one program per sequence."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _check_tags_kernel(
    pages_ptr,
    expected_ptr,
    num_ptr,
    table_ptr,
    out_ptr,
    max_pages,
    total_pages,
    stride_pages,
    stride_expected,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    n = tl.load(num_ptr + b)
    corrupt_count = (n < 0) | (n > max_pages)
    n = tl.where(corrupt_count, 0, n)
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, max_pages, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        live = offs < n
        page = tl.load(pages_ptr + b * stride_pages + offs, mask=live, other=0)
        want = tl.load(expected_ptr + b * stride_expected + offs, mask=live, other=0)
        in_range = (page >= 0) & (page < total_pages)
        # Out-of-range pages are never dereferenced: the load is masked off.
        found = tl.load(table_ptr + page, mask=live & in_range, other=0)
        mismatch = live & ((~in_range) | (found != want))
        bad = bad | mismatch.to(tl.int32)
    flagged = (tl.max(bad, axis=0) > 0) | corrupt_count
    tl.store(out_ptr + b, flagged.to(tl.int8))


def check_page_tags_triton(
    block_pages: Tensor, expected_tags: Tensor, num_pages: Tensor, tag_table: Tensor
) -> Tensor:
    """Per-sequence mismatch mask [B] bool."""
    bsz, max_pages = block_pages.shape
    out = torch.empty(bsz, dtype=torch.int8, device=block_pages.device)
    if bsz == 0:
        return out.bool()
    pages = block_pages.to(torch.int32).contiguous()
    expected = expected_tags.to(torch.int32).contiguous()
    block = max(16, min(128, triton.next_power_of_2(max(max_pages, 1))))
    _check_tags_kernel[(bsz,)](
        pages,
        expected,
        num_pages.to(torch.int32).contiguous(),
        tag_table.to(torch.int32).contiguous(),
        out,
        max_pages,
        tag_table.shape[0],
        pages.stride(0),
        expected.stride(0),
        BLOCK=block,
    )
    return out.bool()
