"""The VNNI kernels' weight layouts (kernels/cpu_int4_vnni.c, cpu_int8_vnni.c): 16 rows of W side
by side, so that one 64-byte load feeds the 16 int32 lanes of ``vpdpbusd``, and their inverses."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def interleave16(packed: Tensor) -> Tensor:
    """Canonical nibbles uint8 [N, K//2] -> the VNNI kernel's layout [ceil(N/16), K//8, 16, 4]: N padded
    with zero rows to a multiple of 16, and in each block of 16 rows the rows' 4-byte words of one
    column (k = 8j..8j+7, bytes unchanged) side by side (kernels/cpu_int4_vnni.c)."""
    n, half = packed.shape
    if half % 4:
        raise ValueError(f"the 16-row layout needs K a multiple of 8, got K={2 * half}")
    n16 = -(-n // 16) * 16
    padded = F.pad(packed, (0, 0, 0, n16 - n))
    return padded.view(n16 // 16, 16, half // 4, 4).permute(0, 2, 1, 3).contiguous()


def deinterleave16(packed16: Tensor, n: int) -> Tensor:
    """Inverse of :func:`interleave16`: the canonical [N, K//2] nibbles of the first ``n`` rows."""
    blocks, cols, _, _ = packed16.shape
    return packed16.permute(0, 2, 1, 3).reshape(blocks * 16, cols * 4)[:n].contiguous()


def interleave16_i8(q: Tensor) -> Tensor:
    """int8 [N, K] -> the VNNI kernel's layout: uint8 ``q + 128``, N padded with zero weights to a
    multiple of 16, [ceil(N/16), K//4, 16, 4] (16 rows' 4 consecutive k side by side)."""
    n, k = q.shape
    if k % 4:
        raise ValueError(f"the 16-row layout needs K a multiple of 4, got K={k}")
    n16 = -(-n // 16) * 16
    biased = F.pad((q.to(torch.int16) + 128).to(torch.uint8), (0, 0, 0, n16 - n), value=128)
    return biased.view(n16 // 16, 16, k // 4, 4).permute(0, 2, 1, 3).contiguous()


def deinterleave16_i8(q16: Tensor, n: int) -> Tensor:
    """Inverse of :func:`interleave16_i8`: int8 [n, K]."""
    blocks, cols, _, _ = q16.shape
    biased = q16.permute(0, 2, 1, 3).reshape(blocks * 16, cols * 4)[:n]
    return (biased.to(torch.int16) - 128).to(torch.int8).contiguous()
