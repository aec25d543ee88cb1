"""Building blocks shared by the decoder families: RMSNorm, the per-phase linear layer (and its
row-concatenated form, one GEMM for q/k/v or gate/up), and the dense SwiGLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.kernels.fp8 import Fp8Weight
from pagoda.kernels.fp8_block import Fp8BlockWeight, concat_block_rows
from pagoda.kernels.fp8_format import amax_scale, quantize_fp8
from pagoda.kernels.int4 import Int4Weight
from pagoda.kernels.linear import DEFAULT_INT4_COMPUTE, Fp8Linear, LinearWeight, make_linear_weight
from pagoda.kernels.selector import KernelSelection
from pagoda.node_agent.models.lazy_tensor import LazyTensor
from pagoda.node_agent.models.parallel import ColumnShard
from pagoda.node_agent.models.step_ops import OPS, rms_norm
from pagoda.vocabulary import STORED

PHASES = ("prefill", "decode")


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def args(self) -> tuple[torch.Tensor, float]:
        return self.weight, self.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def prequantized_format(w: object) -> str | None:
    """'int4' / 'fp8' for a prequantized weight (a `pagoda quantize` checkpoint, or a released one's
    INT4 groups or FP8 blocks), None for a tensor."""
    if isinstance(w, Int4Weight):
        return "int4"
    if isinstance(w, LazyTensor):  # a prequantized layer not read yet (deferred_quant)
        return w.quantized_as
    return "fp8" if isinstance(w, Fp8Weight | Fp8BlockWeight) else None


def as_stored(fmt: str, w: object) -> str:
    """The format a layer runs under the phase format ``fmt``: ``stored`` keeps a prequantized
    weight's own format and holds a dense one in the compute dtype (``bf16``); others as given."""
    if fmt != STORED:
        return fmt
    return prequantized_format(w) or "bf16"


class PhaseLinear:
    """A linear layer holding a weight per phase (shared when both phases use the same format).

    A tensor-parallel column slice (ColumnShard) is quantized as its share of the whole row: the
    row's INT4 group size and FP8 scale. ``kernels``: the engine's kernel selection (the requested
    backend and the INT4 compute), None for the automatic backend and the default compute."""

    def __init__(
        self,
        weight: torch.Tensor | Int4Weight | Fp8Weight | Fp8BlockWeight | ColumnShard,
        bias: torch.Tensor | None,
        formats: dict[str, str],
        dtype: torch.dtype,
        kernels: KernelSelection | None = None,
        group_size: int | None = None,
        built: dict[str, LinearWeight] | None = None,
    ) -> None:
        backend = None if kernels is None else kernels.backend
        int4_compute = DEFAULT_INT4_COMPUTE if kernels is None else kernels.int4_compute
        self.by_phase: dict[str, LinearWeight] = {}
        made: dict[str, LinearWeight] = dict(built or {})  # formats the caller already built
        shard = weight if isinstance(weight, ColumnShard) else None
        formats = {p: as_stored(f, shard.weight if shard is not None else weight) for p, f in formats.items()}
        if shard is not None:
            weight = shard.weight
            if "int4" in formats.values() and not isinstance(weight, Int4Weight):
                group_size = shard.int4_group(group_size)
        stored = prequantized_format(weight)
        dense = weight  # a prequantized weight serves its own format as is, others dequantized
        if stored is not None and any(f != stored for f in formats.values()):
            dense = weight.dequantize()  # before the packed object is used (the CPU path repacks it)
        for phase in PHASES:
            fmt = formats[phase]
            if fmt not in made:
                src = weight if fmt == stored else dense
                if fmt == "fp8" and stored != "fp8" and shard is not None and shard.row_amax is not None:
                    scale = amax_scale(shard.row_amax)  # the whole row's per-channel scale
                    w8 = Fp8Weight(quantize_fp8(src.detach(), scale[:, None]), scale)
                    made[fmt] = Fp8Linear(w8, bias, backend)
                else:
                    made[fmt] = make_linear_weight(src, fmt, dtype, bias, group_size, backend, int4_compute)
            self.by_phase[phase] = made[fmt]
        self.out_features = weight.shape[0] if stored is None else weight.out_features

    def __call__(self, x: torch.Tensor, phase: str) -> torch.Tensor:
        return self.by_phase[phase].apply(x)

    def unique_weights(self) -> list[LinearWeight]:
        seen: dict[int, LinearWeight] = {id(w): w for w in self.by_phase.values()}
        return list(seen.values())


def concat_rows(ws: list) -> torch.Tensor | Int4Weight | Fp8Weight | None:
    """Weights ``[N_i, K]`` of one kind stacked along N (what a fused projection runs), or None
    when they cannot be stacked without changing a value (mixed kinds, groups or widths)."""
    if all(isinstance(w, torch.Tensor) for w in ws):
        return torch.cat(ws, dim=0) if len({w.shape[1] for w in ws}) == 1 else None
    if all(isinstance(w, Fp8Weight) for w in ws):
        return Fp8Weight(torch.cat([w.weight for w in ws]), torch.cat([w.scale for w in ws]))
    if all(isinstance(w, Fp8BlockWeight) for w in ws):
        return concat_block_rows(ws)
    if not all(isinstance(w, Int4Weight) for w in ws):
        return None
    if len({(w.in_features, w.group_size) for w in ws}) != 1:
        return None
    n, first = sum(w.out_features for w in ws), ws[0]
    packed = torch.cat([w.state()["packed"] for w in ws])
    scales = torch.cat([w.state()["scales"] for w in ws])
    if any(w.float_zero for w in ws) or len({w.symmetric for w in ws}) > 1:
        mins = torch.cat([w.offsets() for w in ws])  # one float-zero form holds every kind exactly
        return Int4Weight(n, first.in_features, first.group_size, False, packed, scales, None, mins)
    zeros = None if first.symmetric else torch.cat([w.state()["zeros"] for w in ws])
    return Int4Weight(n, first.in_features, first.group_size, first.symmetric, packed, scales, zeros)


def fused_linear(
    w: dict,
    names: list[str],
    formats: dict[str, str],
    dtype: torch.dtype,
    kernels: KernelSelection | None,
    group_size: int | None,
) -> PhaseLinear | None:
    """One PhaseLinear over the row-stacked weights (and biases) of ``names``, or None when they
    cannot be fused exactly."""
    weight = concat_rows([w[n + ".weight"] for n in names])
    if weight is None:
        return None
    biases = [w.get(n + ".bias") for n in names]
    bias = None
    if any(b is not None for b in biases):
        sizes = [_rows(w[n + ".weight"]) for n in names]
        bias = torch.cat([b if b is not None else torch.zeros(k) for b, k in zip(biases, sizes, strict=True)])
    return PhaseLinear(weight, bias, formats, dtype, kernels, group_size)


def _rows(w: torch.Tensor | Int4Weight | Fp8Weight) -> int:
    return w.shape[0] if isinstance(w, torch.Tensor) else w.out_features


class DenseMLP:
    """SwiGLU MLP ``down(silu(gate(h)) * up(h))``; gate and up run as one fused GEMM
    (``gate_up_proj``) when their weights stack exactly, else as ``gate_proj`` / ``up_proj``."""

    def __init__(
        self,
        prefix: str,
        w: dict[str, torch.Tensor],
        formats: dict[str, str],
        dtype: torch.dtype,
        kernels: KernelSelection | None,
        group_size: int | None = None,
    ) -> None:
        def lin(name: str) -> PhaseLinear:
            full = f"{prefix}.{name}"
            return PhaseLinear(
                w[full + ".weight"], w.get(full + ".bias"), formats, dtype, kernels, group_size
            )

        names = [f"{prefix}.gate_proj", f"{prefix}.up_proj"]
        self.gate_up_proj = fused_linear(w, names, formats, dtype, kernels, group_size)
        self.gate_proj = self.up_proj = None
        if self.gate_up_proj is None:
            self.gate_proj, self.up_proj = lin("gate_proj"), lin("up_proj")
        self.down_proj = lin("down_proj")

    def linears(self) -> list[PhaseLinear]:
        if self.gate_up_proj is not None:
            return [self.gate_up_proj, self.down_proj]
        return [self.gate_proj, self.up_proj, self.down_proj]

    def __call__(self, h: torch.Tensor, phase: str) -> torch.Tensor:
        if self.gate_up_proj is not None:
            return self.down_proj(OPS["swiglu"](self.gate_up_proj(h, phase)), phase)
        return self.down_proj(F.silu(self.gate_proj(h, phase)) * self.up_proj(h, phase), phase)
