"""Block-scaled FP8 weights as DeepSeek-V3 / Kimi checkpoints store them, and their GEMM.

A weight ``[N, K]`` float8_e4m3fn carries one float32 scale per ``bn x bk`` block (the
checkpoint's ``weight_scale_inv``, ``[ceil(N/bn), ceil(K/bk)]``; edge blocks may be partial). Its
value is ``w[r, c] * scale[row_block[r], c // bk]``. ``row_block`` maps each row to its scale row:
``r // bn`` for a weight as stored, any map once weights were stacked (fused q/k/v, gate/up) or
sliced by rows (tensor parallelism), so both stay exact without re-rounding a value.

GEMM backends (``fp8_block_linear``):
  * ``reference`` - dequantize the whole weight, one float32 matmul;
  * ``cpu``       - the same float32 values, dequantized ``bn`` rows at a time (no full float copy);
  * ``triton``    - DeepSeek-style: activations quantized to e4m3 per token and per ``bk`` group,
                    one scale pair applied per K block inside the loop (kernels/triton_fp8_block.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .dispatch import record, resolve
from .fp8_format import (
    FP8_BF16_BIAS,
    FP8_DTYPE,
    FP8_MAX,
    SCALE_FLOOR,
    fp8_to_float_scaled_down,
    quantize_token_groups,
)

# Weight rows dequantized per step of the CPU path (times K floats of temporaries).
_CPU_ROWS = 128


@dataclass(eq=False)
class Fp8BlockWeight:
    """e4m3 values with their block scales (see the module doc)."""

    weight: Tensor  # [N, K] float8_e4m3fn
    scale: Tensor  # [R, ceil(K / bk)] float32
    block: tuple[int, int]  # (bn, bk) of the checkpoint
    row_block: Tensor  # [N] int32: each row's scale row

    @classmethod
    def from_checkpoint(cls, w: Tensor, scale_inv: Tensor, block: tuple[int, int], name: str = "weight"):
        """A stored ``weight`` / ``weight_scale_inv`` pair, shapes checked (ValueError names ``name``)."""
        if w.dtype != FP8_DTYPE or w.dim() != 2:
            raise ValueError(f"{name}: expected a 2-D {FP8_DTYPE} weight, got {w.dtype} {tuple(w.shape)}")
        n, k = w.shape
        bn, bk = block
        want = (-(-n // bn), -(-k // bk))
        if tuple(scale_inv.shape) != want:
            raise ValueError(
                f"{name}_scale_inv must be {want} for a {(n, k)} weight in {bn}x{bk} blocks, "
                f"got {tuple(scale_inv.shape)}"
            )
        if not scale_inv.is_floating_point():
            raise ValueError(f"{name}_scale_inv must be floating point, got {scale_inv.dtype}")
        rows = torch.arange(n, dtype=torch.int32, device=w.device) // bn
        return cls(w.contiguous(), scale_inv.float().contiguous(), (bn, bk), rows)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def nbytes(self) -> int:
        """Resident bytes: 1 per value, the block scales and the row map."""
        return self.weight.nbytes + self.scale.nbytes + self.row_block.nbytes

    def scales_for_rows(self, r0: int = 0, r1: int | None = None) -> Tensor:
        """float32 ``[r1 - r0, K]``: every element's scale for rows [r0, r1)."""
        s = self.scale[self.row_block[r0:r1].long()]
        return s.repeat_interleave(self.block[1], dim=1)[:, : self.in_features]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The exact float32 values ``w * scale`` (then cast to ``dtype``)."""
        return self.dequantize_rows(0, self.out_features).to(dtype)

    def dequantize_rows(self, r0: int, r1: int) -> Tensor:
        """float32 ``w * scale`` of rows [r0, r1): the e4m3 bits decoded by the vectorized bf16 trick
        and the block scale folded with its 2**120 (both factors exact, so the product rounds once,
        as ``w.float() * scale`` does); the plain product where a folded scale would overflow."""
        s = self.scale[self.row_block[r0:r1].long()]
        folded = s * FP8_BF16_BIAS
        if not torch.isfinite(folded).all():
            return self.weight[r0:r1].float() * self.scales_for_rows(r0, r1)
        out = fp8_to_float_scaled_down(self.weight[r0:r1].view(torch.uint8))
        bk, kb = self.block[1], s.shape[1]
        whole = min(kb, self.in_features // bk)
        if whole:
            out[:, : whole * bk].unflatten(1, (whole, bk)).mul_(folded[:, :whole, None])
        if whole < kb:
            out[:, whole * bk :].mul_(folded[:, whole:])
        return out

    def to(self, device: torch.device | str) -> Fp8BlockWeight:
        return Fp8BlockWeight(
            self.weight.to(device), self.scale.to(device), self.block, self.row_block.to(device)
        )

    def take_rows(self, start: int, end: int) -> Fp8BlockWeight:
        """Rows [start, end): the same scales, the row map sliced (and its scale rows kept only)."""
        rows = self.row_block[start:end]
        if rows.numel() == 0:
            return Fp8BlockWeight(self.weight[start:end].contiguous(), self.scale[:0], self.block, rows)
        lo, hi = int(rows.min()), int(rows.max())
        return Fp8BlockWeight(
            self.weight[start:end].contiguous(),
            self.scale[lo : hi + 1].contiguous(),
            self.block,
            (rows - lo).contiguous(),
        )

    def take_cols(self, start: int, end: int) -> Fp8BlockWeight:
        """Columns [start, end), which must start on a block edge and end on one (or at K)."""
        bk, k = self.block[1], self.in_features
        if start % bk or (end % bk and end != k):
            raise ValueError(
                f"a column slice [{start}, {end}) splits the FP8 blocks of {bk} columns: use a "
                f"tensor-parallel degree that cuts at multiples of {bk}"
            )
        cols = slice(start // bk, -(-end // bk))
        return Fp8BlockWeight(
            self.weight[:, start:end].contiguous(),
            self.scale[:, cols].contiguous(),
            self.block,
            self.row_block,
        )

    def apply(self, x: Tensor, bias: Tensor | None = None, backend: str | None = None) -> Tensor:
        return fp8_block_linear(x, self, bias, backend)


def concat_block_rows(ws: list[Fp8BlockWeight]) -> Fp8BlockWeight | None:
    """Weights stacked along N (one fused GEMM), or None when their K or column blocks differ."""
    if len({(w.in_features, w.block[1]) for w in ws}) != 1:
        return None
    maps, offset = [], 0
    for w in ws:
        maps.append(w.row_block + offset)
        offset += w.scale.shape[0]
    return Fp8BlockWeight(
        torch.cat([w.weight for w in ws]),
        torch.cat([w.scale for w in ws]),
        ws[0].block,
        torch.cat(maps).to(torch.int32),
    )


def quantize_fp8_block(w: Tensor, block: tuple[int, int] = (128, 128)) -> Fp8BlockWeight:
    """``w [N, K]`` -> e4m3 with one scale per block (amax / 448), as DeepSeek-V3's converter does."""
    n, k = w.shape
    bn, bk = block
    nb, kb = -(-n // bn), -(-k // bk)
    padded = torch.zeros(nb * bn, kb * bk, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.float()
    blocks = padded.reshape(nb, bn, kb, bk)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp_(min=SCALE_FLOOR)
    q = (blocks / scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.reshape(nb * bn, kb * bk)[:n, :k].contiguous()
    return Fp8BlockWeight.from_checkpoint(q, scale, block)


def fp8_block_reference(x: Tensor, w: Fp8BlockWeight, bias: Tensor | None = None) -> Tensor:
    """Plain torch: dequantize the blocks, one float32 matmul (the ground truth, weight-only)."""
    out = F.linear(x.float(), w.dequantize(), None if bias is None else bias.float())
    return out.to(x.dtype)


def fp8_block_act_reference(x: Tensor, w: Fp8BlockWeight, bias: Tensor | None = None) -> Tensor:
    """The reference with the Triton kernel's activation rounding (per token and ``bk`` group)."""
    bk = w.block[1]
    xq, xs = quantize_token_groups(x.reshape(-1, x.shape[-1]), bk)
    xd = xq.float() * xs.repeat_interleave(bk, dim=1)[:, : x.shape[-1]]
    return fp8_block_reference(xd, w, bias).reshape(*x.shape[:-1], -1).to(x.dtype)


def _fp8_block_cpu(x: Tensor, w: Fp8BlockWeight, bias: Tensor | None) -> Tensor:
    """The reference's float32 values, ``_CPU_ROWS`` weight rows dequantized at a time."""
    n = w.out_features
    xf = x.float()
    out = torch.empty(x.shape[0], n, dtype=torch.float32, device=x.device)
    for r0 in range(0, n, _CPU_ROWS):
        r1 = min(n, r0 + _CPU_ROWS)
        torch.matmul(xf, w.dequantize_rows(r0, r1).T, out=out[:, r0:r1])
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


def fp8_block_linear(
    x: Tensor, w: Fp8BlockWeight, bias: Tensor | None = None, backend: str | None = None
) -> Tensor:
    """``x [..., K] @ dequant(w).T + bias`` -> ``[..., N]`` in ``x.dtype`` (see the module doc)."""
    k = w.in_features
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, weight expects {k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    be = resolve("fp8_block_linear", x.device, backend)
    if be == "triton":
        from .triton_fp8_block import fp8_block_gemm, fp8_block_supported

        if fp8_block_supported(w):
            out = fp8_block_gemm(x2, w, bias)
        else:
            record("fp8_block_linear", "cpu")
            out = _fp8_block_cpu(x2, w, bias)
    elif be == "reference":
        out = fp8_block_reference(x2, w, bias)
    else:
        out = _fp8_block_cpu(x2, w, bias)
    return out.reshape(*lead, w.out_features)
