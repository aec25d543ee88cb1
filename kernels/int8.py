"""INT8 weights (weight-only): the decode LM head's ``int8`` format.

Two layouts, both ``qweight`` int8 [N, K] with dequantized weight ``q * scale``:
- per output channel: ``scales`` float32 [N] (``quantize``, round to nearest per row). The CPU path
  is torch's ``_weight_int8pack_mm`` (bf16 activations, the fast case on CPUs with AVX-512 BF16;
  float32 activations run ~10x slower there);
- blocks of ``group_size`` (32) along K: ``scales`` [N, K/32], float16 (GGUF Q8_0's own precision).
  ``exact_blocks`` recovers them from a float weight that holds such blocks exactly (the built-in
  model's tied embedding is Q8_0), so the head loses nothing. Float32 activations on the CPU run a
  native kernel at float32 accuracy on the exact weights: with AVX-512 VNNI ``cpu_int8_vnni.c``
  over the weights biased by 128 and interleaved 16 rows at a time (``interleave16_i8``, held
  instead of ``qweight``), else the float32 one of ``cpu_int4.c``.
The reference dequantizes and multiplies in float32. On CUDA the reference serves (no Triton kernel
yet).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from .dispatch import record, select_backend
from .vnni_layout import deinterleave16_i8, interleave16_i8

CPU_COMPUTE_DTYPE = torch.bfloat16


Q8_BLOCK = 32  # GGUF Q8_0's block


@dataclass(eq=False)
class Int8Weight:
    qweight: Tensor | None  # int8 [N, K]; None while q16 holds the weights
    scales: Tensor  # float32 [N], or [N, K / group_size] (float16 when exact) for block scales
    group_size: int | None = None
    q16: Tensor | None = field(default=None, repr=False)  # interleave16_i8 layout (prepare_native)

    @classmethod
    def exact_blocks(cls, w: Tensor, group: int = Q8_BLOCK) -> Int8Weight | None:
        """The block layout holding ``w [N, K]`` exactly (each block ``scale * q``, |q| <= 127, the
        scale a float16), or None when ``w`` is not such a weight (then nothing is lost by asking)."""
        if w.dim() != 2 or w.shape[1] % group or w.dtype != torch.float32:
            return None
        n, k = w.shape
        wg = w.detach().reshape(n, k // group, group)
        scale = wg.abs().amax(dim=-1) / 127.0
        if not torch.equal(scale.half().float(), scale):
            return None
        q = torch.where(scale[..., None] > 0, wg / scale.clamp(min=1e-30)[..., None], torch.zeros_like(wg))
        qr = q.round()
        if qr.abs().max() > 127 or not torch.equal(qr * scale[..., None], wg):
            return None
        return cls(qr.to(torch.int8).reshape(n, k).contiguous(), scale.half().contiguous(), group)

    @classmethod
    def quantize(cls, w: Tensor) -> Int8Weight:
        """Symmetric round-to-nearest per row: ``scale = amax / 127``."""
        if w.dim() != 2:
            raise ValueError(f"expected a 2-D weight [N, K], got shape {tuple(w.shape)}")
        wf = w.detach().float()
        scales = (wf.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        q = torch.round(wf / scales[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(q.contiguous(), scales.contiguous())

    @property
    def out_features(self) -> int:
        return self.scales.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1] if self.qweight is not None else self.q16.shape[1] * 4

    @property
    def nbytes(self) -> int:
        held = sum(t.nbytes for t in (self.qweight, self.q16, self.scales) if t is not None)
        return held + getattr(self, "_cpu_scales_nbytes", 0)

    def prepare_native(self) -> None:
        """Hold block weights in the VNNI kernel's layout when that kernel runs here (CPU tensors,
        K and the blocks multiples of 32); otherwise leave them as they are."""
        if self.q16 is not None or self.group_size is None or self.group_size % 32:
            return
        if self.qweight.device.type != "cpu" or self.in_features % 32:
            return
        from .cpu_int4_native import vnni8_available

        if vnni8_available():
            self.q16, self.qweight = interleave16_i8(self.qweight), None

    def _need_q(self) -> Tensor:
        """``qweight``, restored from the VNNI layout when that is what is held."""
        if self.qweight is None:
            self.qweight, self.q16 = deinterleave16_i8(self.q16, self.out_features), None
        return self.qweight

    def dequantize(self) -> Tensor:
        self._need_q()
        if self.group_size is None:
            return self.qweight.float() * self.scales[:, None]
        n, k = self.qweight.shape
        q = self.qweight.float().reshape(n, k // self.group_size, self.group_size)
        return (q * self.scales.float()[..., None]).reshape(n, k)

    def _cpu_scales(self) -> Tensor:
        cached = getattr(self, "_cpu_scales_t", None)
        if cached is None:
            cached = self._cpu_scales_t = self.scales.to(CPU_COMPUTE_DTYPE).contiguous()
            self._cpu_scales_nbytes = cached.nbytes
        return cached


def int8_linear(x: Tensor, qw: Int8Weight, backend: str | None = None) -> Tensor:
    """``x [..., K] @ dequant(qw).T`` -> ``[..., N]`` in ``x.dtype``."""
    k = qw.in_features
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, weight expects {k}")
    lead, x2 = x.shape[:-1], x.reshape(-1, k)
    be = select_backend(x.device, backend)
    if qw.group_size is not None:
        out = _blocks_linear(x2, qw, be)
    elif be == "cpu" and x.device.type == "cpu":
        record("int8_linear", "cpu")
        out = torch.ops.aten._weight_int8pack_mm(
            x2.to(CPU_COMPUTE_DTYPE).contiguous(), qw.qweight, qw._cpu_scales()
        )
    else:
        record("int8_linear", "reference")
        out = F.linear(x2.float(), qw.dequantize())
    return out.to(x.dtype).reshape(*lead, qw.out_features)


def _blocks_linear(x2: Tensor, qw: Int8Weight, be: str) -> Tensor:
    """Block scales: the native float32 kernel on the CPU, else the reference."""
    if be == "cpu" and x2.device.type == "cpu" and x2.dtype == torch.float32:
        from .cpu_int4_native import native_int8_mm

        interleaved = qw.q16 is not None
        q = qw.q16 if interleaved else qw.qweight
        out = native_int8_mm(x2, q, qw.scales, qw.group_size, interleaved=interleaved)
        if out is not None:
            record("int8_linear", "cpu")
            return out
    record("int8_linear", "reference")
    return F.linear(x2.float(), qw.dequantize())


def exact_int8_head(w: Tensor, dtype: torch.dtype, device: torch.device) -> Int8Weight | None:
    """The int8 blocks holding the head ``w`` exactly (GGUF Q8_0) when the native float32 kernel runs
    them (float32 compute on a CPU), else None: the ``auto`` decode LM head (None: dense)."""
    if device.type != "cpu" or dtype != torch.float32 or w.dtype != torch.float32:
        return None
    from .cpu_int4_native import library

    return Int8Weight.exact_blocks(w) if library() is not None else None
