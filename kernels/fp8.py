"""FP8 (OCP e4m3fn, max 448) quantization and the FP8 weight linear layer."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .cpu_fp8_native import available as fp8_native_available
from .cpu_fp8_native import fp8_gemm_f32, fp8_rows_f32
from .dispatch import resolve
from .fp8_format import (
    FP8_BF16_BIAS,
    FP8_DTYPE,
    dequantize_fp8,
    fp8_to_float_scaled_down,
    quantize_activations,
    quantize_fp8_weight,
)

log = logging.getLogger("pagoda.kernels")
_scaled_mm_failures: set[tuple] = set()


@dataclass(eq=False)
class Fp8Weight:
    """An FP8 weight with per-output-channel scales (what ``pagoda quantize`` stores)."""

    weight: Tensor  # [N, K] float8_e4m3fn
    scale: Tensor  # [N] float32

    @classmethod
    def quantize(cls, w: Tensor) -> Fp8Weight:
        return cls(*quantize_fp8_weight(w))

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def nbytes(self) -> int:
        """Resident bytes: 1 per weight plus 4 per output channel."""
        return self.weight.nbytes + self.scale.nbytes

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return dequantize_fp8(self.weight, self.scale[:, None], dtype)

    def state(self) -> dict[str, Tensor]:
        """Tensors for a safetensors file (``weight`` stays float8_e4m3fn)."""
        return {"weight": self.weight, "scale": self.scale}

    @classmethod
    def from_state(cls, d: dict[str, Tensor], meta: dict | None = None) -> Fp8Weight:
        w, s = d["weight"], d["scale"]
        if w.dtype != FP8_DTYPE:
            raise ValueError(f"FP8 weight must be {FP8_DTYPE}, got {w.dtype}")
        if s.shape != (w.shape[0],):
            raise ValueError(f"FP8 scale shape {tuple(s.shape)} does not match weight rows {w.shape[0]}")
        return cls(w, s.float())

    def apply(self, x: Tensor, bias: Tensor | None = None, backend: str | None = None) -> Tensor:
        return fp8_linear(x, self.weight, self.scale, bias, backend)


def fp8_linear(
    x: Tensor, w_fp8: Tensor, w_scale: Tensor, bias: Tensor | None = None, backend: str | None = None
) -> Tensor:
    """``x [..., K] @ (w_fp8 * w_scale[:, None]).T + bias`` -> ``[..., N]`` in ``x.dtype``."""
    if w_fp8.dtype != FP8_DTYPE:
        raise ValueError(f"fp8_linear needs a {FP8_DTYPE} weight, got {w_fp8.dtype}")
    n, k = w_fp8.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, weight expects {k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    be = resolve("fp8_linear", x.device, backend)
    if be == "triton":
        from .triton_fp8 import fp8_gemm

        out = fp8_gemm(x2, w_fp8, w_scale, bias)
    elif be == "cpu" and x.device.type == "cpu":
        out = _fp8_linear_dequant_rows(x2, w_fp8, w_scale, bias)
    elif be == "cpu":
        out = fp8_linear_scaled_mm(x2, w_fp8, w_scale, bias)
    else:
        out = _fp8_linear_reference(x2, w_fp8, w_scale, bias)
    return out.reshape(*lead, n)


def _fp8_linear_reference(x: Tensor, w_fp8: Tensor, w_scale: Tensor, bias: Tensor | None) -> Tensor:
    w = dequantize_fp8(w_fp8, w_scale[:, None], torch.float32)
    out = F.linear(x.float(), w, None if bias is None else bias.float())
    return out.to(x.dtype)


# Weight elements decoded per block in the CPU path. Few activation rows (decode, small prefill chunks):
# ~1 MB of float32 temporaries stays in cache. Many rows: blocks of up to 16 MB (a small model's whole
# matrix), so the float32 GEMM runs in few calls (1 MB blocks lose up to 1.4x at 512 rows).
_DEQUANT_BLOCK_ELEMS = 1 << 18
_DEQUANT_BIG_BLOCK_ELEMS = 1 << 22
_DEQUANT_BIG_FROM_ROWS = 64
# Below this many activation rows the fused native kernel runs (codes decoded in registers for up to 4
# rows, else once per chunk into L1); from here the decode-then-matmul path is faster (the crossover
# measured in docs/measurements.md, "Prefill rows share one decode of the codes").
FUSED_BELOW_ROWS = 256


def _fp8_linear_dequant_rows(x: Tensor, w_fp8: Tensor, w_scale: Tensor, bias: Tensor | None) -> Tensor:
    """CPU path: float32 products with the e4m3 codes, row scales applied once.

    Weight-only (activations stay exact). Below 256 rows the fused native kernel (``cpu_fp8.c``) decodes
    the codes on the fly; otherwise they decode to float32 blocks in one native pass and torch
    multiplies. Without the native library torch's bit trick decodes (to ``value * 2**-120``, whose
    products with small activations are slow float32 subnormals: see ``cpu_fp8.c``). On a 2-core AVX2
    VM the torch decode ran 4-5x faster than ``torch._scaled_mm`` (whose fp8 casts are scalar) and is
    more accurate (2.6% vs 3.7% error).
    """
    n, k = w_fp8.shape
    xf = x.float()
    raw = w_fp8.view(torch.uint8)
    native = fp8_native_available()  # the wrappers decline what they do not take (strided codes...)
    out = fp8_gemm_f32(xf.contiguous(), raw) if native and x.shape[0] < FUSED_BELOW_ROWS else None
    if out is None and native:
        out = _decoded_blocks_matmul(xf, raw, fp8_rows_f32)
    if out is None:  # torch's decode reads value * 2**-120: scale back
        out = _decoded_blocks_matmul(xf, raw, fp8_to_float_scaled_down)
        out *= w_scale.float() * FP8_BF16_BIAS
    else:
        out *= w_scale.float()
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


def _decoded_blocks_matmul(
    xf: Tensor, raw: Tensor, decode: Callable[[Tensor], Tensor | None]
) -> Tensor | None:
    """``xf @ decode(codes).T`` block by block, float32 matmuls; None if ``decode`` declines."""
    n, k = raw.shape
    out = torch.empty(xf.shape[0], n, dtype=torch.float32, device=xf.device)
    elems = _DEQUANT_BIG_BLOCK_ELEMS if xf.shape[0] >= _DEQUANT_BIG_FROM_ROWS else _DEQUANT_BLOCK_ELEMS
    step = max(1, elems // k)
    for r0 in range(0, n, step):
        w = decode(raw[r0 : r0 + step])
        if w is None:
            return None
        torch.matmul(xf, w.T, out=out[:, r0 : r0 + step])
    return out


def fp8_linear_scaled_mm(x: Tensor, w_fp8: Tensor, w_scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """``torch._scaled_mm`` with dynamic per-token activation scales (row-wise scaling).

    The path for CUDA without Triton; on CPU it works but is slow (see docs/kernels.md). Falls
    back to the reference when ``_scaled_mm`` rejects the shape/dtype.
    """
    out_dtype = x.dtype if x.dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
    key = (x.device.type, x.dtype, w_fp8.shape)
    if key not in _scaled_mm_failures:
        try:
            xq, xs = quantize_activations(x)
            out = torch._scaled_mm(
                xq,
                w_fp8.t(),
                scale_a=xs,
                scale_b=w_scale.float().reshape(1, -1).contiguous(),
                out_dtype=out_dtype,
            )
            if bias is not None:
                out = out + bias.to(out_dtype)
            return out.to(x.dtype)
        except (RuntimeError, NotImplementedError) as exc:
            _scaled_mm_failures.add(key)
            log.warning("torch._scaled_mm rejected %s (%s); using the reference fp8 path", key, exc)
    return _fp8_linear_reference(x, w_fp8, w_scale, bias)
