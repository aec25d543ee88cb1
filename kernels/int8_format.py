"""The INT8 KV element format: symmetric int8 values with one scale per token and head.

A row ``x [..., H, D]`` stores ``q = clamp(round(x / s), -127, 127)`` (round half to even) as int8
and ``s = bf16(max(amax|x| / 127, 1e-12))`` per token and head, in bfloat16 beside the page (the
same page scales as FP8's per-token K). Dequantization is ``q * s`` in float32 (``paged_attention``
reads every scaled page that way). Unlike e4m3 (3
mantissa bits), the error is uniform across a row: a token's largest entries, which dominate q.k,
keep about 7 significant bits. NaN values store 0 (their row's scale is NaN, so the row reads NaN).

Shared by the paged-attention kernels, their native and Triton paths, and the KV pool; imports no
kernel.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .fp8_format import SCALE_FLOOR, TOKEN_SCALE_DTYPE

INT8_DTYPE = torch.int8
INT8_MAX = 127.0


def int8_token_scales(x: Tensor) -> Tensor:
    """Scales of ``x [..., H, D]`` per token and head, ``amax / 127`` over D floored at 1e-12 and
    rounded to the nearest bfloat16 (``[..., H]``); NaN when the row has one."""
    return (x.detach().float().abs().amax(dim=-1) / INT8_MAX).clamp_(min=SCALE_FLOOR).to(TOKEN_SCALE_DTYPE)


def quantize_int8(x: Tensor, scale: Tensor) -> Tensor:
    """``round(x / scale)`` clamped to +-127 as int8 (``scale`` broadcastable; NaN -> 0)."""
    y = (x.float() / scale.float()).round_().clamp_(-INT8_MAX, INT8_MAX)
    return y.nan_to_num_(0.0).to(INT8_DTYPE)
