"""Group-wise INT4 weights: quantization, packing, and the INT4 linear layer.

Canonical layout (what ``pagoda quantize`` stores and the reference/Triton paths read):
  * ``packed``  uint8 [N, K//2]: weight k = 2j in the low nibble of byte j, k = 2j+1 in the high one;
  * ``scales``  float32 [N, K//group];
  * ``zeros``   uint8 [N, K//group] integer zero points 0..15 (asymmetric), or None (symmetric: 8);
  * ``mins``    float32 [N, K//group] float offsets instead of integer zero points, or None.
Dequantized weight: ``(q - zero) * scale``, or ``q * scale + min`` when ``mins`` is set: the float
zero of GGUF Q4_1 (and of Q4_0, with ``min = -8 * scale``), which holds such blocks exactly.

A float32 CPU engine holds float16 scales and offsets where that is exact, and then, where the weight
has at most 4,096 distinct values of them, 12-bit codes into a table instead
(:mod:`kernels.int4_codes`): 19 bytes per group of 32 instead of 20, no value changed.

The bf16 CPU path uses torch's int4pack layout (``_convert_weight_to_int4pack_for_cpu``), whose
dequant is ``(q - 8) * s + z'``; ours maps onto it with ``s = scale`` and ``z' = offset + 8 * scale``
(``offset`` = ``-zero * scale`` or ``min``). N is padded to a multiple of 16 (a requirement of that op).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from .dispatch import record, select_backend
from .int4_codes import MAX_VALUES as MAX_CODE_VALUES
from .int4_codes import ParamCodes, codes_nbytes, distinct_values, encode_params
from .vnni_layout import deinterleave16, interleave16

SUPPORTED_GROUPS = (32, 64, 128, 256)
# torch's CPU int4 matmul is ~10x faster with bf16 activations than with float32 ones (measured on
# a 2-core x86 VM), so the CPU path always feeds it bf16 and casts the result back.
CPU_COMPUTE_DTYPE = torch.bfloat16
_CPU_N_ALIGN = 16
_SCALE_FLOOR = 1e-12


def pick_group_size(k: int, preferred: int = 128) -> int:
    """``preferred`` if it divides ``k``, else the largest of 128/64/32 below it that does."""
    if preferred not in SUPPORTED_GROUPS:
        raise ValueError(f"group size must be one of {SUPPORTED_GROUPS}, got {preferred}")
    for g in (preferred, 128, 64, 32):
        if g <= preferred and k % g == 0:
            return g
    raise ValueError(f"no INT4 group size in {SUPPORTED_GROUPS} (<= {preferred}) divides K={k}")


def pack_nibbles(q: Tensor) -> Tensor:
    """uint8 values 0..15 [N, K] (K even) -> uint8 [N, K//2], even k in the low nibble."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_nibbles(packed: Tensor) -> Tensor:
    """Inverse of :func:`pack_nibbles`: uint8 [N, K//2] -> uint8 [N, K]."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack([lo, hi], dim=-1).reshape(packed.shape[0], -1)


@dataclass(eq=False)
class Int4Weight:
    """A group-wise INT4 weight plus lazily built backend layouts.

    ``nbytes`` counts every tensor the object holds right now: the canonical tensors (unless
    dropped by ``prepare(..., keep_canonical=False)``) and any CPU int4pack layouts built.
    """

    out_features: int
    in_features: int
    group_size: int
    symmetric: bool
    packed: Tensor | None
    scales: Tensor | None
    zeros: Tensor | None
    mins: Tensor | None = None
    _cpu: dict[torch.dtype, tuple[Tensor, Tensor]] = field(default_factory=dict, repr=False)
    # "float32": float32 activations on the CPU run the exact native kernel (cpu_int4.c) over the
    # canonical tensors; "bf16": torch's int4pack op with bf16 activations, scales and offsets
    cpu_compute: str = "bf16"
    _offsets: Tensor | None = field(default=None, repr=False)
    # the float16 scales and offsets as codes into a table (compact_for_native); scales, mins and
    # offsets are then None until something needs them (_need_canonical expands the codes)
    codes: ParamCodes | None = field(default=None, repr=False)
    # the nibbles in the VNNI kernel's 16-row layout (interleave16), held instead of ``packed`` by a
    # float32-compute CPU weight when that kernel runs here; _need_canonical restores ``packed``
    packed16: Tensor | None = field(default=None, repr=False)

    @property
    def num_groups(self) -> int:
        return self.in_features // self.group_size

    @property
    def nbytes(self) -> int:
        total = sum(t.nbytes for t in (self.packed, self.scales, self.zeros, self.mins) if t is not None)
        if self._offsets is not None and self._offsets is not self.mins:
            total += self._offsets.nbytes
        if self.codes is not None:
            total += self.codes.nbytes
        if self.packed16 is not None:
            total += self.packed16.nbytes
        for packed, sz in self._cpu.values():
            total += packed.nbytes + sz.nbytes
        return total

    @property
    def zero_points(self) -> Tensor:
        """Integer zero points as float32 [N, K//group] (8 for symmetric weights)."""
        self._need_params()
        if self.mins is not None:
            raise ValueError("this INT4 weight has float offsets (mins), not integer zero points")
        if self.zeros is None:
            return torch.full_like(self.scales, 8.0)
        return self.zeros.float()

    def offsets(self) -> Tensor:
        """float32 [N, K//group] with ``w = q * scale + offset`` for every form of zero."""
        self._need_params()
        if self.mins is not None:
            return self.mins.float()
        return -self.zero_points * self.scales.float()

    def _need_canonical(self) -> None:
        if self.packed is None and self.packed16 is not None:
            self.packed, self.packed16 = deinterleave16(self.packed16, self.out_features), None
        if self.packed is None:
            self._restore_canonical()
        if self.scales is None and self.codes is not None:
            self._expand_codes()

    def _need_params(self) -> None:
        """Scales (and mins) as tensors, leaving the nibbles in whatever layout they are held."""
        if self.scales is not None:
            return
        if self.codes is not None:
            self._expand_codes()
        else:
            self._need_canonical()

    def _expand_codes(self) -> None:
        """Back from codes to float16 scales and offsets (the same values)."""
        scales, offsets = self.codes.decode()
        self.codes = None
        self.scales, self._offsets = scales, offsets
        if self._float_zero:
            self.mins = offsets

    def cpu_layout(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """(int4pack [Npad, K//2] uint8, scales_and_zeros [K//group, Npad, 2] in ``dtype``), cached."""
        if dtype not in self._cpu:
            self._need_canonical()
            n, g = self.out_features, self.num_groups
            npad = -(-n // _CPU_N_ALIGN) * _CPU_N_ALIGN
            q = unpack_nibbles(self.packed).to(torch.int32)
            s = self.scales.float()
            z = self.offsets() + 8.0 * s
            if npad != n:
                q = F.pad(q, (0, 0, 0, npad - n), value=8)
                s = F.pad(s, (0, 0, 0, npad - n))
                z = F.pad(z, (0, 0, 0, npad - n))
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
            sz = torch.stack([s.t(), z.t()], dim=-1).to(dtype).contiguous()
            assert sz.shape == (g, npad, 2)
            self._cpu[dtype] = (packed, sz)
        return self._cpu[dtype]

    def native_nibbles(self) -> tuple[Tensor, bool] | None:
        """(nibbles, interleaved) as the native kernels read them: the 16-row layout (VNNI kernel) or
        the canonical one (float32 kernel); None when neither is held (a bf16 layout only)."""
        if self.packed16 is not None:
            return self.packed16, True
        return None if self.packed is None else (self.packed, False)

    def native_params(self) -> tuple[Tensor, Tensor, int] | None:
        """(scales, offsets, mode) as ``kernels/cpu_int4.c`` reads them: float32 (mode 0), float16 (1),
        or codes and their table (2); None when scales and offsets differ in dtype."""
        if self.codes is not None:
            return self.codes.codes, self.codes.table, 2
        self._need_params()
        scales, offsets = self.scales, self.native_offsets()
        if scales.dtype != offsets.dtype or scales.dtype not in (torch.float32, torch.float16):
            return None
        return scales, offsets, int(scales.dtype == torch.float16)

    def native_offsets(self) -> Tensor:
        """Offsets kept for the native float32 kernel (the mins themselves when float-zero), in the
        scales' dtype (see :meth:`compact_for_native`)."""
        if self._offsets is None:
            self._offsets = self.offsets().to(self.scales.dtype).contiguous()
        return self._offsets

    def params_fit_fp16(self) -> bool:
        """Whether float16 holds the scales and offsets exactly (GGUF's own precision)."""
        if self.codes is not None:
            return True
        scales, offsets = self.scales.float(), self.offsets()
        return torch.equal(scales.half().float(), scales) and torch.equal(offsets.half().float(), offsets)

    def resident_nbytes(self, compute: str) -> int:
        """Bytes the CPU path will hold for this weight once prepared for ``compute`` ("float32":
        nibbles, scales and offsets (+ integer zeros): codes where they fit, else float16 when exact,
        else float32; "bf16": torch's int4pack layout with bf16 scales and offsets, N padded to 16)."""
        n, k, g = self.out_features, self.in_features, self.num_groups
        if compute == "bf16":
            npad = -(-n // _CPU_N_ALIGN) * _CPU_N_ALIGN
            return npad * k // 2 + g * npad * 2 * 2
        zeros = n * g if self.zeros is not None else 0
        nibbles = (-(-n // 16) * 16 if self.group_size % 32 == 0 and _vnni_layout(k) else n) * k // 2
        if self.codes is not None:
            return nibbles + self.codes.nbytes + zeros
        if not self.params_fit_fp16():
            return nibbles + n * g * 2 * 4 + zeros
        values = distinct_values(self.scales.half(), self.offsets().half())
        params = codes_nbytes(n, g, values) if values <= MAX_CODE_VALUES else n * g * 2 * 2
        return nibbles + params + zeros

    def compact_for_native(self) -> None:
        """Hold scales (and mins or offsets) as codes into a float16 table where float16 is exact
        (GGUF's own precision) and the distinct values fit one, else in float16 when exact, else keep
        float32: the native kernel reads all three, the values never change."""
        if self.codes is not None or not self.params_fit_fp16():
            return
        s16, o16 = self.scales.half().contiguous(), self.offsets().half().contiguous()
        codes = encode_params(s16, o16)
        if codes is not None:
            self.codes = codes
            self.scales = self.mins = self._offsets = None
            return
        self.scales = s16
        if self.mins is not None:
            self.mins = o16
        self._offsets = o16

    def prepare(self, backend: str, dtype: torch.dtype = torch.float32, keep_canonical: bool = True) -> None:
        """Build the layout ``backend`` reads; optionally free the canonical tensors (CPU only).
        With ``cpu_compute == "float32"`` the canonical tensors are what the CPU reads: kept."""
        if backend != "cpu":
            return
        if self.cpu_compute == "float32":
            self.compact_for_native()
            if self.codes is None:
                self.native_offsets()
            if self.packed is not None and self.group_size % 32 == 0 and _vnni_layout(self.in_features):
                self.packed16, self.packed = interleave16(self.packed), None
            return
        self.cpu_layout(dtype)
        if not keep_canonical:
            self.packed = self.scales = self.zeros = self.mins = None

    def _restore_canonical(self) -> None:
        """Recover canonical tensors from a cached CPU layout.

        Exact from a float32 layout (integer q and zero points survive unchanged); from a bf16
        layout the scales come back rounded to bf16 (integer zero points are still exact, float
        offsets are rounded like the scales).
        """
        if not self._cpu:
            raise RuntimeError("canonical INT4 tensors were dropped and no CPU layout is cached")
        packed, sz = self._cpu.get(torch.float32) or next(iter(self._cpu.values()))
        sz = sz.float()
        k, n = self.in_features, self.out_features
        eye = torch.eye(k, dtype=torch.float32)
        unit = torch.zeros_like(sz)
        unit[..., 0] = 1.0
        q = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, packed, self.group_size, unit)
        q = (q.t()[:n] + 8.0).round().to(torch.uint8)
        s = sz[..., 0].t()[:n].contiguous()
        self.packed = pack_nibbles(q)
        self.scales = s
        if self.float_zero:
            self.mins = (sz[..., 1].t()[:n] - 8.0 * s).contiguous()
            return
        zero = (8.0 - sz[..., 1].t()[:n] / s.clamp(min=_SCALE_FLOOR)).round().clamp(0, 15)
        self.zeros = None if self.symmetric else zero.to(torch.uint8)

    @property
    def float_zero(self) -> bool:
        """Whether the weight keeps float offsets (``mins``) rather than integer zero points."""
        return self._float_zero if self.mins is None else True

    def __post_init__(self) -> None:
        self._float_zero = self.mins is not None
        if self.mins is not None and (self.zeros is not None or self.symmetric):
            raise ValueError("an INT4 weight has either integer zero points or float mins, not both")

    def state(self) -> dict[str, Tensor]:
        """Canonical tensors for a safetensors file; see :meth:`meta` for the rest."""
        self._need_canonical()
        d = {"packed": self.packed, "scales": self.scales}
        if self.zeros is not None:
            d["zeros"] = self.zeros
        if self.mins is not None:
            d["mins"] = self.mins
        return d

    def meta(self) -> dict[str, str]:
        """String metadata (safetensors headers hold strings)."""
        return {
            "format": "int4",
            "out_features": str(self.out_features),
            "in_features": str(self.in_features),
            "group_size": str(self.group_size),
            "symmetric": str(int(self.symmetric)),
            "float_zero": str(int(self.float_zero)),
        }

    @classmethod
    def from_state(cls, d: dict[str, Tensor], meta: dict) -> Int4Weight:
        n, k, g = int(meta["out_features"]), int(meta["in_features"]), int(meta["group_size"])
        sym = str(meta.get("symmetric", "0")).lower() in ("1", "true")
        fz = str(meta.get("float_zero", "0")).lower() in ("1", "true")
        packed, scales, zeros, mins = d["packed"], d["scales"], d.get("zeros"), d.get("mins")
        if packed.shape != (n, k // 2) or packed.dtype != torch.uint8:
            raise ValueError(f"packed must be uint8 {(n, k // 2)}, got {packed.dtype} {tuple(packed.shape)}")
        if scales.shape != (n, k // g):
            raise ValueError(f"scales must be {(n, k // g)}, got {tuple(scales.shape)}")
        if fz:
            if mins is None or zeros is not None or sym or mins.shape != scales.shape:
                raise ValueError(f"a float-zero weight needs mins {(n, k // g)} and no zeros")
            return cls(n, k, g, False, packed, scales.float(), None, mins.float())
        if (zeros is None) != sym:
            raise ValueError("zeros must be present exactly when the weight is asymmetric")
        return cls(n, k, g, sym, packed, scales.float(), None if zeros is None else zeros.to(torch.uint8))

    def dequantize(self) -> Tensor:
        return dequantize_int4(self)

    def apply(self, x: Tensor, bias: Tensor | None = None, backend: str | None = None) -> Tensor:
        return int4_linear(x, self, bias, backend)


def quantize_int4(w: Tensor, group_size: int | None = None, symmetric: bool = False) -> Int4Weight:
    """Round-to-nearest group-wise INT4 of ``w [N, K]`` (asymmetric min/max by default).

    Asymmetric groups span ``[min(w, 0), max(w, 0)]`` so that 0 is exact and zero points fit 0..15.
    Symmetric groups use ``scale = amax / 7`` and q in [-8, 7] (stored +8).
    """
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight [N, K], got shape {tuple(w.shape)}")
    n, k = w.shape
    g = pick_group_size(k) if group_size is None else group_size
    if k % g or g % 2:
        raise ValueError(f"group size {g} must be even and divide K={k}")
    wg = w.detach().float().reshape(n, k // g, g)
    if symmetric:
        scale = (wg.abs().amax(dim=-1) / 7.0).clamp(min=_SCALE_FLOOR)
        zero = torch.full_like(scale, 8.0)
    else:
        lo = wg.amin(dim=-1).clamp(max=0.0)
        hi = wg.amax(dim=-1).clamp(min=0.0)
        scale = ((hi - lo) / 15.0).clamp(min=_SCALE_FLOOR)
        zero = (-lo / scale).round().clamp(0, 15)
    q = (torch.round(wg / scale[..., None]) + zero[..., None]).clamp(0, 15).reshape(n, k)
    return Int4Weight(
        out_features=n,
        in_features=k,
        group_size=g,
        symmetric=symmetric,
        packed=pack_nibbles(q),
        scales=scale.contiguous(),
        zeros=None if symmetric else zero.to(torch.uint8).contiguous(),
    )


def dequantize_int4(qw: Int4Weight) -> Tensor:
    """Reference dequantization -> float32 [N, K]."""
    qw._need_canonical()
    n, k, g = qw.out_features, qw.in_features, qw.group_size
    q = unpack_nibbles(qw.packed).float().reshape(n, k // g, g)
    if qw.mins is not None:
        w = q * qw.scales.float()[..., None] + qw.mins.float()[..., None]
    else:
        w = (q - qw.zero_points[..., None]) * qw.scales.float()[..., None]
    return w.reshape(n, k)


def int4_linear(x: Tensor, qw: Int4Weight, bias: Tensor | None = None, backend: str | None = None) -> Tensor:
    """``x [..., K] @ dequant(qw).T + bias`` -> ``[..., N]`` in ``x.dtype``."""
    k, n = qw.in_features, qw.out_features
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, weight expects {k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    be = select_backend(x.device, backend)
    if be == "cpu" and not _cpu_op_ok(x2, qw):
        be = "reference"  # torch's int4pack op is CPU-only; counted as what actually runs
    record("int4_linear", be)
    if be == "triton":
        from .triton_int4 import int4_gemm

        qw._need_canonical()
        out = int4_gemm(x2, qw.packed, qw.scales, qw.zeros, qw.group_size, bias, mins=qw.mins)
    elif be == "cpu":
        out = cpu_int4_matmul(x2, qw)
        out = out.to(x.dtype) if bias is None else (out.float() + bias.float()).to(x.dtype)
    else:
        out = F.linear(x2.float(), dequantize_int4(qw), None if bias is None else bias.float()).to(x.dtype)
    return out.reshape(*lead, n)


def cpu_int4_matmul(x2: Tensor, qw: Int4Weight) -> Tensor:
    """``x2 [M, K] @ dequant(qw).T`` on the CPU as ``qw.cpu_compute`` says: the exact native kernel
    for float32 activations of a "float32" weight (float32 out), else torch's int4pack op in bf16
    (also when the native kernel is unavailable, logged once)."""
    nibbles = qw.native_nibbles() if qw.cpu_compute == "float32" and x2.dtype == torch.float32 else None
    if nibbles is not None:
        from .cpu_int4_native import native_int4_mm

        params = qw.native_params()
        if params is not None:
            out = native_int4_mm(
                x2, nibbles[0], params[0], params[1], qw.group_size, mode=params[2], interleaved=nibbles[1]
            )
            if out is not None:
                return out
    return cpu_int4_mm(x2, qw)


def cpu_int4_mm(x: Tensor, qw: Int4Weight, dtype: torch.dtype = CPU_COMPUTE_DTYPE) -> Tensor:
    """``x [M, K] @ dequant(qw).T`` with torch's CPU int4pack kernel, computed in ``dtype``."""
    packed, sz = qw._cpu.get(dtype) or qw.cpu_layout(dtype)
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(dtype).contiguous(), packed, qw.group_size, sz)
    return out if packed.shape[0] == qw.out_features else out[:, : qw.out_features]


def _vnni_layout(k: int) -> bool:
    """Whether float32-compute CPU weights of K inputs take the 16-row layout: the VNNI kernel runs
    here (``PAGODA_NATIVE_VNNI=0`` turns it off) and K is whole 32-wide blocks."""
    if k % 32:
        return False
    from .cpu_int4_native import vnni_available

    return vnni_available()


def _cpu_op_ok(x: Tensor, qw: Int4Weight) -> bool:
    return (
        x.device.type == "cpu"
        and x.is_floating_point()
        and qw.group_size in SUPPORTED_GROUPS
        and qw.in_features % qw.group_size == 0
    )
