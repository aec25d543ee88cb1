"""Building blocks shared by the decoder families: RMSNorm, the per-phase linear layer and the
dense SwiGLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.kernels.fp8 import Fp8Weight
from pagoda.kernels.int4 import Int4Weight
from pagoda.kernels.linear import LinearWeight, make_linear_weight

PHASES = ("prefill", "decode")


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def prequantized_format(w: object) -> str | None:
    """'int4' / 'fp8' for a prequantized weight (a `pagoda quantize` checkpoint), None for a tensor."""
    return "int4" if isinstance(w, Int4Weight) else "fp8" if isinstance(w, Fp8Weight) else None


class PhaseLinear:
    """A linear layer holding a weight per phase (shared when both phases use the same format)."""

    def __init__(
        self,
        weight: torch.Tensor | Int4Weight | Fp8Weight,
        bias: torch.Tensor | None,
        formats: dict[str, str],
        dtype: torch.dtype,
        backend: str | None = None,
        group_size: int | None = None,
    ) -> None:
        self.by_phase: dict[str, LinearWeight] = {}
        made: dict[str, LinearWeight] = {}
        stored = prequantized_format(weight)
        dense = weight  # a prequantized weight serves its own format as is, others dequantized
        if stored is not None and any(f != stored for f in formats.values()):
            dense = weight.dequantize()  # before the packed object is used (the CPU path repacks it)
        for phase in PHASES:
            fmt = formats[phase]
            if fmt not in made:
                src = weight if fmt == stored else dense
                made[fmt] = make_linear_weight(
                    src, fmt, dtype, bias=bias, backend=backend, group_size=group_size
                )
            self.by_phase[phase] = made[fmt]
        self.out_features = weight.shape[0] if stored is None else weight.out_features

    def __call__(self, x: torch.Tensor, phase: str) -> torch.Tensor:
        return self.by_phase[phase].apply(x)

    def unique_weights(self) -> list[LinearWeight]:
        seen: dict[int, LinearWeight] = {id(w): w for w in self.by_phase.values()}
        return list(seen.values())


class DenseMLP:
    """SwiGLU MLP ``down(silu(gate(h)) * up(h))`` of three PhaseLinears named ``<prefix>.gate_proj``..."""

    def __init__(
        self,
        prefix: str,
        w: dict[str, torch.Tensor],
        formats: dict[str, str],
        dtype: torch.dtype,
        backend: str | None,
        group_size: int | None = None,
    ) -> None:
        def lin(name: str) -> PhaseLinear:
            full = f"{prefix}.{name}"
            return PhaseLinear(
                w[full + ".weight"], w.get(full + ".bias"), formats, dtype, backend, group_size
            )

        self.gate_proj, self.up_proj, self.down_proj = lin("gate_proj"), lin("up_proj"), lin("down_proj")

    def linears(self) -> list[PhaseLinear]:
        return [self.gate_proj, self.up_proj, self.down_proj]

    def __call__(self, h: torch.Tensor, phase: str) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(h, phase)) * self.up_proj(h, phase), phase)
