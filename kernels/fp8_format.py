"""The FP8 e4m3 number format: constants, scaling, (de)quantization and raw-byte views.

Shared by the FP8 GEMM, the paged-attention kernels and their Triton paths; imports no kernel.
"""

from __future__ import annotations

import torch
from torch import Tensor

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# Smallest scale we ever use: keeps all-zero rows/heads finite (0 / tiny = 0).
SCALE_FLOOR = 1e-12


# e4m3 bits placed into a bf16 (sign, then the 7 exponent+mantissa bits shifted left by 4) read
# as exactly value * 2**-120, subnormals included: a cheap vectorized decode (torch's own
# float8 -> float32 cast is scalar on CPU, ~3x slower).
FP8_BF16_BIAS = 2.0**120


def fp8_to_float_scaled_down(raw: Tensor) -> Tensor:
    """uint8 e4m3 bits -> float32 ``value * 2**-120`` (multiply by FP8_BF16_BIAS, or fold it)."""
    i = raw.to(torch.int16)
    return (((i & 0x80) << 8) | ((i & 0x7F) << 4)).view(torch.bfloat16).float()


def quantize_fp8(x: Tensor, scale: Tensor | float) -> Tensor:
    """``x / scale`` clamped to +-448 and cast to float8_e4m3fn (``scale`` broadcastable)."""
    scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_fp8(q: Tensor, scale: Tensor | float, dtype: torch.dtype = torch.float32) -> Tensor:
    """``q * scale`` in ``dtype`` (the product is formed in float32)."""
    scale = torch.as_tensor(scale, dtype=torch.float32, device=q.device)
    return (q.float() * scale).to(dtype)


def amax_scale(amax: Tensor, headroom: float = 1.0) -> Tensor:
    """The e4m3 scale that maps ``amax * headroom`` to 448 (float32, floored)."""
    return (amax.float() * headroom / FP8_MAX).clamp_(min=SCALE_FLOOR)


# Dynamic per-token scales (one per token and head) are stored in bfloat16: the page pays 2 bytes per
# token and head. Quantizing with the stored (rounded) value keeps the round trip exact.
TOKEN_SCALE_DTYPE = torch.bfloat16


def token_scales(x: Tensor) -> Tensor:
    """Dynamic scales of ``x [..., H, D]`` per token and head: ``amax / 448`` over D, rounded to the
    nearest bfloat16 (``[..., H]``). The token's largest value then lands within 2**-9 of 448 and
    quantizes to 448 (clamped when just above): the outlier that dominates q.k is kept almost
    exactly, which is what per-token scales buy over static ones in e4m3 (a float format)."""
    return amax_scale(x.detach().abs().amax(dim=-1)).to(TOKEN_SCALE_DTYPE)


def quantize_fp8_weight(w: Tensor) -> tuple[Tensor, Tensor]:
    """Per-output-channel FP8: ``w [N, K]`` -> (``w_fp8 [N, K]``, ``scale [N]`` float32)."""
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight [N, K], got shape {tuple(w.shape)}")
    scale = amax_scale(w.detach().abs().amax(dim=1))
    return quantize_fp8(w.detach(), scale[:, None]), scale


def quantize_activations(x: Tensor) -> tuple[Tensor, Tensor]:
    """Dynamic per-token FP8 activations: ``x [M, K]`` -> (``xq [M, K]``, ``scale [M, 1]``)."""
    scale = amax_scale(x.abs().amax(dim=1, keepdim=True))
    return quantize_fp8(x, scale), scale.contiguous()


def raw_bytes(t: Tensor) -> Tensor:
    """A view that supports every indexing op (fp8 lacks some on CPU)."""
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


def quantize_token_groups(x: Tensor, group: int) -> tuple[Tensor, Tensor]:
    """Dynamic activations per token and per ``group`` columns: ``x [M, K]`` -> (e4m3 ``[M, K]``,
    float32 scales ``[M, ceil(K / group)]``), each group's amax mapped to 448 (DeepSeek-V3's act
    quantization; the last group may be partial)."""
    m, k = x.shape
    kb = -(-k // group)
    padded = torch.zeros(m, kb * group, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()
    g = padded.reshape(m, kb, group)
    scale = (g.abs().amax(dim=2) / FP8_MAX).clamp_(min=SCALE_FLOOR)
    q = (g / scale[:, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(m, kb * group)[:, :k].contiguous(), scale
