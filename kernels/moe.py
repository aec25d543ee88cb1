"""Fused mixture-of-experts (MoE) feed-forward: stacked SwiGLU experts in dense, INT4 or FP8 form.

``fused_moe`` computes, for every token t and each of its k routed experts e = topk_ids[t, j]::

    out[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t]))

grouped by expert: the T*k (token, expert) assignments are sorted by expert, and every expert that
received rows runs one GEMM over them (no per-token loop). Formats of an :class:`ExpertStack`:

  * ``dense`` - ``gate_up [E, 2I, H]`` / ``down [E, H, I]`` in the compute dtype (bf16 or float32);
  * ``int4``  - kernels.int4's canonical group-wise layout with a leading expert axis: packed uint8
    ``[E, N, K//2]``, float32 scales ``[E, N, K//g]``, uint8 zeros ``[E, N, K//g]`` or None
    (symmetric); one group size g for both projections (it divides H and I). On a CPU each expert
    computes as ``cpu_compute`` says (``--int4-compute``): "float32", the exact native kernel of the
    dense INT4 layer over the rows routed to it (float32 activations); "bf16", torch's int4pack op;
  * ``fp8``   - float8_e4m3fn ``[E, N, K]`` with per-output-channel float32 scales ``[E, N]``
    (kernels.fp8's scheme, one scale per row of every expert);
  * ``fp8_block`` - float8_e4m3fn ``[E, N, K]`` with a checkpoint's block scales per expert
    (kernels.fp8_block's scheme: scales ``[E, R, ceil(K/bk)]`` and each row's scale row
    ``[E, N]``), computed as stored; only built from a block-scaled checkpoint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from .dispatch import record, select_backend
from .fp8 import _fp8_linear_dequant_rows, fp8_linear_scaled_mm
from .fp8_block import Fp8BlockWeight, fp8_block_linear
from .fp8_format import FP8_DTYPE, dequantize_fp8, quantize_fp8_weight
from .int4 import (
    CPU_COMPUTE_DTYPE,
    SUPPORTED_GROUPS,
    Int4Weight,
    cpu_int4_matmul,
    dequantize_int4,
    pick_group_size,
    quantize_int4,
)

FORMATS = ("dense", "int4", "fp8", "fp8_block")


@dataclass(eq=False)
class ExpertStack:
    """The E experts of one MoE layer in one weight format, stacked on a leading expert axis.

    gate_up rows [0, I) are the gate projection, [I, 2I) the up projection (SwiGLU: silu(gate) * up).
    FP8 scales are per output channel: ``gate_up_scales [E, 2I]``, ``down_scales [E, H]`` float32.
    """

    fmt: str  # "dense" | "int4" | "fp8" | "fp8_block"
    num_experts: int
    hidden: int  # H
    intermediate: int  # I (per expert)
    # gate_up/down (and the INT4 scales/zeros) are None only after prepare(keep_canonical=False).
    gate_up: Tensor  # dense [E, 2I, H] | int4 uint8 [E, 2I, H//2] | fp8 [E, 2I, H]
    down: Tensor  # dense [E, H, I] | int4 uint8 [E, H, I//2] | fp8 [E, H, I]
    gate_up_scales: Tensor | None = None
    gate_up_zeros: Tensor | None = None
    down_scales: Tensor | None = None
    down_zeros: Tensor | None = None
    group_size: int = 0
    block: tuple[int, int] = (0, 0)  # fp8_block: the checkpoint's (rows, columns) per scale
    gate_up_rows: Tensor | None = None  # fp8_block: int32 [E, 2I], each row's scale row
    down_rows: Tensor | None = None  # fp8_block: int32 [E, H]
    # Per-expert views built lazily by the CPU path (int4: Int4Weight with its int4pack layout).
    _cpu: dict[tuple[str, int], object] = field(default_factory=dict, repr=False)
    # False once prepare("cpu", keep_canonical=False) dropped the stacked tensors.
    canonical: bool = field(default=True, init=False)
    # how INT4 experts compute on a CPU with float32 activations (see prepare): "float32" | "bf16"
    cpu_compute: str = field(default="bf16", init=False)
    _symmetric: bool = field(default=True, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"unknown expert format {self.fmt!r}; expected one of {', '.join(FORMATS)}")
        e, h, i = self.num_experts, self.hidden, self.intermediate
        kdiv = 2 if self.fmt == "int4" else 1
        _check_shape("gate_up", self.gate_up, (e, 2 * i, h // kdiv))
        _check_shape("down", self.down, (e, h, i // kdiv))
        if self.fmt == "int4":
            g = self.group_size
            if g <= 0 or g % 2 or h % g or i % g:
                raise ValueError(f"int4 group size {g} must be even and divide H={h} and I={i}")
            if self.gate_up.dtype != torch.uint8 or self.down.dtype != torch.uint8:
                raise ValueError("int4 experts must be packed uint8")
            _check_shape("gate_up_scales", self.gate_up_scales, (e, 2 * i, h // g))
            _check_shape("down_scales", self.down_scales, (e, h, i // g))
            if (self.gate_up_zeros is None) != (self.down_zeros is None):
                raise ValueError("int4 zeros must be given for both projections or for neither")
            if self.gate_up_zeros is not None:
                _check_shape("gate_up_zeros", self.gate_up_zeros, (e, 2 * i, h // g))
                _check_shape("down_zeros", self.down_zeros, (e, h, i // g))
        elif self.fmt == "fp8":
            if self.gate_up.dtype != FP8_DTYPE or self.down.dtype != FP8_DTYPE:
                raise ValueError(f"fp8 experts must be {FP8_DTYPE}")
            _check_shape("gate_up_scales", self.gate_up_scales, (e, 2 * i))
            _check_shape("down_scales", self.down_scales, (e, h))
        elif self.fmt == "fp8_block":
            if self.gate_up.dtype != FP8_DTYPE or self.down.dtype != FP8_DTYPE:
                raise ValueError(f"fp8_block experts must be {FP8_DTYPE}")
            bk = self.block[1]
            _check_shape("gate_up_rows", self.gate_up_rows, (e, 2 * i))
            _check_shape("down_rows", self.down_rows, (e, h))
            for name, t, k in (
                ("gate_up_scales", self.gate_up_scales, h),
                ("down_scales", self.down_scales, i),
            ):
                if t is None or t.dim() != 3 or t.shape[0] != e or t.shape[2] != -(-k // bk):
                    raise ValueError(f"{name} must be [E={e}, R, {-(-k // bk)}] block scales")
        elif not self.gate_up.is_floating_point() or self.gate_up.dtype != self.down.dtype:
            raise ValueError("dense experts must share one floating-point dtype")
        self._symmetric = self.gate_up_zeros is None

    @property
    def symmetric(self) -> bool:
        """INT4 without zero points (8 is the implicit zero)."""
        return self._symmetric

    def tensors(self) -> list[Tensor]:
        """Every canonical tensor held (None fields left out)."""
        ts = (self.gate_up, self.down, self.gate_up_scales, self.gate_up_zeros, self.down_scales)
        return [t for t in (*ts, self.down_zeros, self.gate_up_rows, self.down_rows) if t is not None]

    def nbytes(self) -> int:
        """Bytes of every tensor held, including layouts cached by the CPU path."""
        total = sum(t.nbytes for t in self.tensors())
        for v in self._cpu.values():
            if isinstance(v, Int4Weight):
                # Canonical per-expert tensors are views of the stacks, unless those were dropped.
                total += (
                    v.nbytes if not self.canonical else sum(p.nbytes + sz.nbytes for p, sz in v._cpu.values())
                )
        return total

    def prepare(self, backend: str, keep_canonical: bool = True, compute: str = "bf16") -> None:
        """Build every expert's layout for ``backend`` now instead of on first use.

        Only INT4 on a CPU has one. ``compute`` "bf16": torch's int4pack per expert (bf16 scales);
        with ``keep_canonical=False`` the stacked INT4 tensors are dropped so only those layouts stay
        resident (as the dense INT4 linear layer does); the stack then runs the ``cpu`` path for a
        ``triton`` request, and the reference dequantizes from the layouts (scales rounded to bf16).
        ``compute`` "float32" (where the native kernels run, else "bf16"): each expert holds its
        nibbles, scales and zeros in the native float32 kernel's layout (exact, as a float32-compute
        INT4 linear), and the stacks are dropped whatever ``keep_canonical`` says (those are the
        canonical values, recoverable per expert without loss).
        """
        if backend != "cpu" or self.fmt != "int4" or not self.canonical:
            return
        if self.gate_up.device.type != "cpu" or self.group_size not in SUPPORTED_GROUPS:
            return
        if compute == "float32" and not _native_available():
            compute = "bf16"
        self.cpu_compute = compute
        for proj in ("gate_up", "down"):
            for e in range(self.num_experts):
                w = self.int4_weight(proj, e)
                if compute == "float32":
                    w.cpu_compute = "float32"
                    # its own storage (the stacks are dropped below)
                    w.packed, w.scales = w.packed.clone(), w.scales.clone()
                    w.zeros = None if w.zeros is None else w.zeros.clone()
                    w.prepare("cpu")
                else:
                    w.prepare("cpu", CPU_COMPUTE_DTYPE, keep_canonical=keep_canonical)
        if not keep_canonical or compute == "float32":
            self.gate_up = self.down = None  # type: ignore[assignment]
            self.gate_up_scales = self.gate_up_zeros = self.down_scales = self.down_zeros = None
            self.canonical = False

    def dequantize(self, expert: int) -> tuple[Tensor, Tensor]:
        """Expert ``expert``'s (gate_up [2I, H], down [H, I]) as float32 (the reference's weights)."""
        if self.fmt == "dense":
            return self.gate_up[expert].float(), self.down[expert].float()
        if self.fmt == "fp8":
            gu = dequantize_fp8(self.gate_up[expert], self.gate_up_scales[expert][:, None])
            return gu, dequantize_fp8(self.down[expert], self.down_scales[expert][:, None])
        if self.fmt == "fp8_block":
            return self.block_weight("gate_up", expert).dequantize(), self.block_weight(
                "down", expert
            ).dequantize()
        return dequantize_int4(self.int4_weight("gate_up", expert)), dequantize_int4(
            self.int4_weight("down", expert)
        )

    def block_weight(self, proj: str, expert: int) -> Fp8BlockWeight:
        """An :class:`Fp8BlockWeight` viewing one expert's projection (fp8_block stacks)."""
        if proj == "gate_up":
            t = (self.gate_up, self.gate_up_scales, self.gate_up_rows)
        else:
            t = (self.down, self.down_scales, self.down_rows)
        w, s, rows = (a[expert] for a in t)
        return Fp8BlockWeight(w, s, self.block, rows)

    def int4_weight(self, proj: str, expert: int) -> Int4Weight:
        """An :class:`Int4Weight` viewing one expert's projection (cached: it carries the CPU layout)."""
        key = (proj, expert)
        w = self._cpu.get(key)
        if w is None:
            if not self.canonical:
                raise RuntimeError("the stacked INT4 tensors were dropped before this expert was prepared")
            if proj == "gate_up":
                n, k = 2 * self.intermediate, self.hidden
                t = (self.gate_up, self.gate_up_scales, self.gate_up_zeros)
            else:
                n, k = self.hidden, self.intermediate
                t = (self.down, self.down_scales, self.down_zeros)
            packed, scales, zeros = (None if a is None else a[expert] for a in t)
            w = Int4Weight(n, k, self.group_size, zeros is None, packed, scales, zeros)
            self._cpu[key] = w
        return w  # type: ignore[return-value]


def _native_available() -> bool:
    from .cpu_int4_native import library

    return library() is not None


def _check_shape(name: str, t: Tensor | None, shape: tuple[int, ...]) -> None:
    if t is None:
        raise ValueError(f"{name} is required for this expert format")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")


def make_expert_stack(
    gate: Tensor,
    up: Tensor,
    down: Tensor,
    fmt: str,
    group_size: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    symmetric: bool = False,
) -> ExpertStack:
    """gate/up [E, I, H], down [E, H, I] float tensors (as loaded from a checkpoint) -> one format.

    ``dense`` casts to ``dtype``. ``int4`` quantizes group-wise with kernels.int4's quantizer
    (asymmetric unless ``symmetric``); the group size is ``group_size`` if given, else
    :func:`pick_group_size` over gcd(H, I) so one size fits both projections. ``fp8`` quantizes
    per output channel like kernels.fp8.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown expert format {fmt!r}; expected one of {', '.join(FORMATS)}")
    if fmt == "fp8_block":
        raise ValueError("fp8_block experts are read from a block-scaled checkpoint, not quantized here")
    if gate.dim() != 3 or up.shape != gate.shape:
        raise ValueError(f"gate and up must both be [E, I, H], got {tuple(gate.shape)}, {tuple(up.shape)}")
    e, i, h = gate.shape
    if down.shape != (e, h, i):
        raise ValueError(f"down must be [E, H, I] = {(e, h, i)}, got {tuple(down.shape)}")
    gate_up = torch.cat([gate, up], dim=1)
    if fmt == "dense":
        return ExpertStack("dense", e, h, i, gate_up.to(dtype).contiguous(), down.to(dtype).contiguous())
    if fmt == "fp8":
        gu_q, gu_s = quantize_fp8_weight(gate_up.reshape(e * 2 * i, h))
        d_q, d_s = quantize_fp8_weight(down.reshape(e * h, i))
        return ExpertStack(
            "fp8",
            e,
            h,
            i,
            gu_q.reshape(e, 2 * i, h),
            d_q.reshape(e, h, i),
            gate_up_scales=gu_s.reshape(e, 2 * i),
            down_scales=d_s.reshape(e, h),
        )
    if group_size is None:
        try:
            g = pick_group_size(math.gcd(h, i))
        except ValueError:
            raise ValueError(
                f"no INT4 group size in {SUPPORTED_GROUPS} divides both H={h} and I={i}"
            ) from None
    else:
        g = group_size
    if g <= 0 or g % 2 or h % g or i % g:
        raise ValueError(f"int4 group size {g} must be even and divide H={h} and I={i}")
    # Group-wise quantization is per row, so all experts' rows quantize as one matrix.
    gu = quantize_int4(gate_up.reshape(e * 2 * i, h), g, symmetric=symmetric)
    dq = quantize_int4(down.reshape(e * h, i), g, symmetric=symmetric)

    def split(t: Tensor | None, n: int) -> Tensor | None:
        return None if t is None else t.reshape(e, n, -1)

    return ExpertStack(
        "int4",
        e,
        h,
        i,
        split(gu.packed, 2 * i),
        split(dq.packed, h),
        gate_up_scales=split(gu.scales, 2 * i),
        gate_up_zeros=split(gu.zeros, 2 * i),
        down_scales=split(dq.scales, h),
        down_zeros=split(dq.zeros, h),
        group_size=g,
    )


def _check_inputs(x: Tensor, topk_weights: Tensor, topk_ids: Tensor, experts: ExpertStack) -> None:
    """Shapes, dtypes and the expert-id range (one device sync on GPU)."""
    if x.dim() != 2 or x.shape[1] != experts.hidden:
        raise ValueError(f"x must be [T, {experts.hidden}], got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"x must be floating point, got {x.dtype}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_weights/topk_ids must both be [T={x.shape[0]}, k], got "
            f"{tuple(topk_weights.shape)}, {tuple(topk_ids.shape)}"
        )
    if topk_ids.dtype.is_floating_point or topk_ids.dtype.is_complex or topk_ids.dtype == torch.bool:
        raise ValueError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
    if topk_ids.numel():
        lo, hi = (int(v) for v in torch.aminmax(topk_ids))
        if lo < 0 or hi >= experts.num_experts:
            raise ValueError(f"topk_ids must lie in [0, {experts.num_experts}), got [{lo}, {hi}]")


def moe_reference(x: Tensor, topk_weights: Tensor, topk_ids: Tensor, experts: ExpertStack) -> Tensor:
    """Plain torch, float32 math: loops over the experts used, dequantizing each one's weights."""
    _check_inputs(x, topk_weights, topk_ids, experts)
    i = experts.intermediate
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    xf, wf = x.float(), topk_weights.float()
    for e in torch.unique(topk_ids).tolist():
        t_idx, j_idx = torch.nonzero(topk_ids == e, as_tuple=True)
        gu, dw = experts.dequantize(e)
        h = xf[t_idx] @ gu.T
        y = (F.silu(h[:, :i]) * h[:, i:]) @ dw.T
        out.index_add_(0, t_idx, y * wf[t_idx, j_idx, None])
    return out.to(x.dtype)


def sort_by_expert(topk_ids: Tensor, num_experts: int) -> tuple[Tensor, list[int]]:
    """(order, counts): flat assignment indices sorted by expert, and rows per expert (host ints)."""
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return order, counts


def _expert_mm(x: Tensor, experts: ExpertStack, proj: str, e: int) -> Tensor:
    """``x @ W_e.T`` for one expert's projection on the CPU backend; result in float32."""
    if experts.fmt == "dense":
        w = experts.gate_up[e] if proj == "gate_up" else experts.down[e]
        return (x.to(w.dtype) @ w.T).float()
    if experts.fmt == "fp8":
        w, s = (
            (experts.gate_up[e], experts.gate_up_scales[e])
            if proj == "gate_up"
            else (experts.down[e], experts.down_scales[e])
        )
        xf = x.float()
        if x.device.type == "cpu":
            return _fp8_linear_dequant_rows(xf, w, s, None)
        return fp8_linear_scaled_mm(xf, w, s)
    if experts.fmt == "fp8_block":  # the tiled float32 path on a CPU, the Triton kernel on CUDA
        return fp8_block_linear(x.float(), experts.block_weight(proj, e), None, _block_backend(x))
    qw = experts.int4_weight(proj, e)
    if x.device.type == "cpu" and qw.group_size in SUPPORTED_GROUPS:
        return cpu_int4_matmul(x, qw).float()
    return x.float() @ dequantize_int4(qw).T


def _block_backend(x: Tensor) -> str:
    return "cpu" if x.device.type == "cpu" else "triton"


def _moe_cpu(x: Tensor, topk_weights: Tensor, topk_ids: Tensor, experts: ExpertStack) -> Tensor:
    """Sort rows by expert, one GEMM pair per expert with rows, weighted scatter-add per token."""
    t, k = topk_ids.shape
    i = experts.intermediate
    order, counts = sort_by_expert(topk_ids, experts.num_experts)
    tokens = order // k
    xs = x[tokens]  # [T*k, H] rows grouped by expert
    ys = torch.empty(t * k, experts.hidden, dtype=torch.float32, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = slice(start, start + n)
        h = _expert_mm(xs[rows], experts, "gate_up", e)
        act = (F.silu(h[:, :i]) * h[:, i:]).to(x.dtype)
        ys[rows] = _expert_mm(act, experts, "down", e)
        start += n
    ys *= topk_weights.reshape(-1)[order].float()[:, None]
    out = torch.zeros(t, experts.hidden, dtype=torch.float32, device=x.device)
    out.index_add_(0, tokens, ys)
    return out.to(x.dtype)


def fused_moe(
    x: Tensor, topk_weights: Tensor, topk_ids: Tensor, experts: ExpertStack, backend: str | None = None
) -> Tensor:
    """x [T, H]; topk_weights [T, k] float32 (already normalized/scaled by the router);
    topk_ids [T, k] int64 in [0, E). Returns [T, H] in x's dtype:
    out[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e = topk_ids[t, j].

    Raises ValueError on bad shapes, dtypes or expert ids (checked before any compute).
    """
    _check_inputs(x, topk_weights, topk_ids, experts)
    be = select_backend(x.device, backend)
    if be == "triton":
        from .triton_moe import triton_supports

        if not triton_supports(experts, x.device):
            be = "cpu"  # e.g. FP8 experts on a GPU without FP8 (sm89+): counted as what runs
    record("fused_moe", be)
    if x.shape[0] == 0 or topk_ids.shape[1] == 0:
        return torch.zeros_like(x)
    if be == "reference":
        return moe_reference(x, topk_weights, topk_ids, experts)
    if be == "triton":
        from .triton_moe import triton_fused_moe

        return triton_fused_moe(x, topk_weights, topk_ids, experts)
    return _moe_cpu(x, topk_weights, topk_ids, experts)
