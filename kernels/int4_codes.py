"""Lossless codes for INT4 group parameters: a group's float16 scale and offset as two 12-bit indices
into one float16 table of the weight's distinct values.

A GGUF Q4_1 group is 16 bytes of nibbles plus a float16 scale and a float16 min: 20 bytes per 32
weights, 0.3125x bfloat16. A weight holds few distinct scales and mins (SmolLM2-135M: at most 2,830
together in one fused weight, against up to 82,944 groups), so 3 bytes of codes per group and the
small table hold them exactly: 19 bytes per 32 weights plus 2 bytes per distinct value. A weight
with more than :data:`MAX_VALUES` distinct scales and offsets together keeps float16 parameters.

Code layout (what ``kernels/cpu_int4.c`` reads as parameter mode 2): uint8 ``[N, groups, 3]``, the
24 bits little-endian; bits 0-11 index the scale, bits 12-23 the offset, both into ``table``
(scales first, then offsets).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

MAX_VALUES = 4096  # two 12-bit indices into one table


@dataclass(frozen=True, eq=False)
class ParamCodes:
    """Codes ``uint8 [N, groups, 3]`` and their ``table`` (float16 ``[T]``, T <= 4096)."""

    codes: Tensor
    table: Tensor

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.table.nbytes

    def decode(self) -> tuple[Tensor, Tensor]:
        """(scales, offsets), float16 ``[N, groups]``, exactly as encoded."""
        c = self.codes.to(torch.int32)
        code = c[..., 0] | (c[..., 1] << 8) | (c[..., 2] << 16)
        return self.table[code & 0xFFF].contiguous(), self.table[code >> 12].contiguous()


def _distinct(values: Tensor) -> tuple[Tensor, Tensor]:
    """Distinct float16 bit patterns (so -0.0 and 0.0 stay apart) and each value's index."""
    bits, index = torch.unique(values.contiguous().view(torch.int16), return_inverse=True)
    return bits.view(torch.float16), index.to(torch.int32)


def distinct_values(scales: Tensor, offsets: Tensor) -> int:
    """How many table entries :func:`encode_params` would need for these float16 parameters."""
    return int(torch.unique(scales.contiguous().view(torch.int16)).numel()) + int(
        torch.unique(offsets.contiguous().view(torch.int16)).numel()
    )


def codes_nbytes(rows: int, groups: int, values: int) -> int:
    """Bytes held by codes of ``rows x groups`` parameters with ``values`` table entries."""
    return rows * groups * 3 + values * 2


def encode_params(scales: Tensor, offsets: Tensor) -> ParamCodes | None:
    """Codes for float16 ``scales`` and ``offsets`` ``[N, groups]``, or None when together they hold
    more than :data:`MAX_VALUES` distinct values (the caller keeps float16)."""
    if scales.dtype != torch.float16 or offsets.dtype != torch.float16:
        raise ValueError(
            f"parameter codes take float16 scales and offsets, got {scales.dtype}, {offsets.dtype}"
        )
    if scales.shape != offsets.shape or scales.dim() != 2:
        raise ValueError(
            f"scales {tuple(scales.shape)} and offsets {tuple(offsets.shape)} must be one [N, groups]"
        )
    s_values, s_index = _distinct(scales)
    o_values, o_index = _distinct(offsets)
    if s_values.numel() + o_values.numel() > MAX_VALUES:
        return None
    code = s_index | ((o_index + s_values.numel()) << 12)
    codes = torch.stack([code & 0xFF, (code >> 8) & 0xFF, code >> 16], dim=-1).to(torch.uint8)
    return ParamCodes(codes.contiguous(), torch.cat([s_values, o_values]).contiguous())
