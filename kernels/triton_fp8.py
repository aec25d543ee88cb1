"""Triton FP8 GEMM: e4m3 activations (per-token scales) x e4m3 weights (per-channel scales).

Tiled ``[BLOCK_M, BLOCK_N]`` output, fp8 operands fed to ``tl.dot`` (native on GPUs with FP8
tensor cores; widened to float32 elsewhere, e.g. under the interpreter), float32 accumulation,
and both scales plus the bias applied once in the epilogue.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .dispatch import triton_interpreting
from .fp8_format import quantize_activations


@triton.jit
def _fp8_gemm_kernel(
    a_ptr,
    b_ptr,
    a_scale_ptr,
    b_scale_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_om,
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
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + offs_k) < K
        a = tl.load(
            a_ptr + offs_m[:, None] * stride_am + (k0 + offs_k)[None, :],
            mask=m_mask[:, None] & k_mask[None, :],
            other=0,
        ).to(tl.float8e4nv, bitcast=True)
        b = tl.load(
            b_ptr + offs_n[:, None] * stride_bn + (k0 + offs_k)[None, :],
            mask=n_mask[:, None] & k_mask[None, :],
            other=0,
        ).to(tl.float8e4nv, bitcast=True)
        if FP8_DOT:
            acc += tl.dot(a, tl.trans(b))
        else:
            acc += tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
    a_scale = tl.load(a_scale_ptr + offs_m, mask=m_mask, other=0.0)
    b_scale = tl.load(b_scale_ptr + offs_n, mask=n_mask, other=0.0)
    acc = acc * a_scale[:, None] * b_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _fp8_tensor_cores(device: torch.device) -> bool:
    return (
        device.type == "cuda"
        and not triton_interpreting()
        and torch.cuda.get_device_capability(device) >= (8, 9)
    )


def fp8_gemm(x: Tensor, w_fp8: Tensor, w_scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x [M, K]`` (quantized per token here) ``@ (w_fp8 * w_scale).T + bias`` -> ``x.dtype``."""
    m, k = x.shape
    n = w_fp8.shape[0]
    xq, xs = quantize_activations(x)
    out_dtype = x.dtype if x.dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n, block_k = 64, 64
    a, b = xq.view(torch.uint8).contiguous(), w_fp8.view(torch.uint8).contiguous()
    _fp8_gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        a,
        b,
        xs.reshape(-1).contiguous(),
        w_scale.float().contiguous(),
        bias if bias is not None else w_scale,
        out,
        m,
        n,
        k,
        a.stride(0),
        b.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        FP8_DOT=_fp8_tensor_cores(x.device),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return out.to(x.dtype)
