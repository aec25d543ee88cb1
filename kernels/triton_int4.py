"""Triton INT4 x float GEMM/GEMV with split-K for small M.

Weights stay packed (two nibbles per byte) in memory; each program unpacks a [BLOCK_N, BLOCK_K]
tile, applies its group's scale and zero point, and accumulates ``x @ w.T`` in float32. Even and
odd k are handled as two half-width dots, so nibbles never need interleaving. With split-K, each
program covers a slice of K and writes a float32 partial that the wrapper sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .triton_common import dot_in_input_dtype, target_programs


@triton.jit
def _int4_gemm_kernel(
    x_ptr,
    packed_ptr,
    scales_ptr,
    zeros_ptr,
    part_ptr,
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_pn,
    stride_sn,
    stride_ps,
    stride_pm,
    GROUP: tl.constexpr,
    ZERO_MODE: tl.constexpr,  # 0: symmetric (8), 1: integer zero points, 2: float mins
    DOT_IN_INPUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_j = tl.arange(0, BLOCK_K // 2)  # byte index inside the tile
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        # One tile never straddles a group: BLOCK_K divides GROUP.
        group = k0 // GROUP
        scale = tl.load(scales_ptr + offs_n * stride_sn + group, mask=n_mask, other=0.0).to(tl.float32)
        if ZERO_MODE == 2:  # w = q * scale + min  ==  (q - (-min / scale)) * scale, kept exact below
            offset = tl.load(zeros_ptr + offs_n * stride_sn + group, mask=n_mask, other=0.0).to(tl.float32)
            zero = tl.zeros([BLOCK_N], dtype=tl.float32)
        elif ZERO_MODE == 1:
            zero = tl.load(zeros_ptr + offs_n * stride_sn + group, mask=n_mask, other=0).to(tl.float32)
            offset = tl.zeros([BLOCK_N], dtype=tl.float32)
        else:
            zero = tl.full([BLOCK_N], 8.0, dtype=tl.float32)
            offset = tl.zeros([BLOCK_N], dtype=tl.float32)
        byte = k0 // 2 + offs_j
        packed = tl.load(
            packed_ptr + offs_n[:, None] * stride_pn + byte[None, :], mask=n_mask[:, None], other=0
        )
        w_even = ((packed & 0xF).to(tl.float32) - zero[:, None]) * scale[:, None] + offset[:, None]  # k=2j
        w_odd = ((packed >> 4).to(tl.float32) - zero[:, None]) * scale[:, None] + offset[:, None]  # 2j+1
        k_even = k0 + 2 * offs_j
        x_even = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + k_even[None, :], mask=m_mask[:, None], other=0.0
        )
        x_odd = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + k_even[None, :] + 1, mask=m_mask[:, None], other=0.0
        )
        if DOT_IN_INPUT:
            acc += tl.dot(x_even, tl.trans(w_even.to(x_even.dtype)))
            acc += tl.dot(x_odd, tl.trans(w_odd.to(x_odd.dtype)))
        else:
            acc += tl.dot(x_even.to(tl.float32), tl.trans(w_even), input_precision="ieee")
            acc += tl.dot(x_odd.to(tl.float32), tl.trans(w_odd), input_precision="ieee")
    out = part_ptr + pid_k * stride_ps + offs_m[:, None] * stride_pm + offs_n[None, :]
    tl.store(out, acc, mask=m_mask[:, None] & n_mask[None, :])


def _block_m(m: int) -> int:
    return 16 if m <= 16 else 32 if m <= 32 else 64


def int4_gemm(
    x: Tensor,
    packed: Tensor,
    scales: Tensor,
    zeros: Tensor | None,
    group_size: int,
    bias: Tensor | None = None,
    split_k: int | None = None,
    mins: Tensor | None = None,
) -> Tensor:
    """``x [M, K] @ dequant(packed, scales, zeros).T (+ bias)`` -> ``[M, N]`` in ``x.dtype``."""
    m, k = x.shape
    n = packed.shape[0]
    block_k = min(group_size, 64)
    if group_size % block_k or k % block_k or block_k < 32:
        raise ValueError(f"group size {group_size} unsupported by the Triton INT4 kernel (needs 32..256)")
    block_m, block_n = _block_m(m), 32 if n <= 32 else 64
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    k_blocks = k // block_k
    if split_k is None:
        split_k = max(1, min(k_blocks, target_programs(x.device) // max(tiles, 1)))
    split_k = max(1, min(split_k, k_blocks))
    k_per_split = triton.cdiv(k_blocks, split_k) * block_k
    split_k = triton.cdiv(k, k_per_split)
    x = x.contiguous()
    part = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split_k)
    _int4_gemm_kernel[grid](
        x,
        packed,
        scales,
        mins if mins is not None else zeros if zeros is not None else scales,
        part,
        m,
        n,
        k,
        k_per_split,
        x.stride(0),
        packed.stride(0),
        scales.stride(0),
        part.stride(0),
        part.stride(1),
        GROUP=group_size,
        ZERO_MODE=2 if mins is not None else 1 if zeros is not None else 0,
        DOT_IN_INPUT=dot_in_input_dtype(x),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    out = part.sum(dim=0) if split_k > 1 else part[0]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
