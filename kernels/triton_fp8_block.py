"""Triton GEMM over block-scaled FP8 weights, DeepSeek-V3 style.

Activations are quantized to e4m3 per token and per ``bk`` columns (one scale per group), so each
K step of ``BLOCK_K = bk`` columns meets one activation scale per row of the tile and one weight
scale per output row (its block's, read through the row map): ``acc += dot(a, b) * sa * sb``,
float32 accumulation, bias in the epilogue. The fp8 operands go to ``tl.dot`` as they are on GPUs
with FP8 tensor cores (sm89+); elsewhere, and under the interpreter, they are widened to float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .fp8_format import quantize_token_groups
from .triton_fp8 import _fp8_tensor_cores


@triton.jit
def _fp8_block_gemm_kernel(
    a_ptr,
    a_scale_ptr,
    b_ptr,
    b_scale_ptr,
    row_block_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    KB,
    HAS_BIAS: tl.constexpr,
    FP8_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    rows = tl.load(row_block_ptr + offs_n, mask=n_mask, other=0)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, KB):
        cols = kb * BLOCK_K + offs_k
        k_mask = cols < K
        a = tl.load(
            a_ptr + offs_m[:, None] * K + cols[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0
        ).to(tl.float8e4nv, bitcast=True)
        b = tl.load(
            b_ptr + offs_n[:, None] * K + cols[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0
        ).to(tl.float8e4nv, bitcast=True)
        if FP8_DOT:
            part = tl.dot(a, tl.trans(b))
        else:
            part = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
        sa = tl.load(a_scale_ptr + offs_m * KB + kb, mask=m_mask, other=0.0)
        sb = tl.load(b_scale_ptr + rows * KB + kb, mask=n_mask, other=0.0)
        acc += part * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m[:, None] * N + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def fp8_block_supported(w) -> bool:
    """The kernel's K step is the weight's column block: a power of two of 16 or more."""
    bk = w.block[1]
    return bk >= 16 and bk & (bk - 1) == 0


def fp8_block_gemm(x: Tensor, w, bias: Tensor | None = None) -> Tensor:
    """``x [M, K]`` (quantized per token and ``bk`` group here) ``@ dequant(w).T + bias`` for a
    kernels.fp8_block.Fp8BlockWeight ``w``."""
    m, k = x.shape
    n = w.out_features
    bk = w.block[1]
    xq, xs = quantize_token_groups(x, bk)
    kb = xs.shape[1]
    out_dtype = x.dtype if x.dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64
    _fp8_block_gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        xq.view(torch.uint8),
        xs.contiguous(),
        w.weight.view(torch.uint8).contiguous(),
        w.scale.contiguous(),
        w.row_block.contiguous(),
        bias.float().contiguous() if bias is not None else xs,
        out,
        m,
        n,
        k,
        kb,
        HAS_BIAS=bias is not None,
        FP8_DOT=_fp8_tensor_cores(x.device),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=bk,
    )
    return out.to(x.dtype)
