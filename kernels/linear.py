"""One linear-layer interface over dense, FP8 and INT4 weights."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor

from pagoda.vocabulary import DEFAULT_INT4_COMPUTE, INT4_COMPUTES

from .dispatch import record, select_backend
from .fp8 import Fp8Weight, fp8_linear
from .fp8_block import Fp8BlockWeight, fp8_block_linear
from .int4 import CPU_COMPUTE_DTYPE, Int4Weight, int4_linear, pick_group_size, quantize_int4
from .int8 import Int8Weight, int8_linear
from .switches import switch_on

FORMATS = ("bf16", "fp32", "fp8", "int4", "int8")
# INT4_COMPUTES and DEFAULT_INT4_COMPUTE (``--int4-compute``) live in the torch-free vocabulary: config
# and the CLI read them on the router path too. The engine's choice travels as an explicit argument
# (kernels/selector.py's KernelSelection).


def check_int4_compute(mode: str) -> str:
    if mode not in INT4_COMPUTES:
        raise ValueError(f"int4 compute must be one of {', '.join(INT4_COMPUTES)}, got {mode!r}")
    return mode


def native_available() -> bool:
    from .cpu_int4_native import library

    return library() is not None


@runtime_checkable
class LinearWeight(Protocol):
    """What the model calls: ``apply(x)``, plus its resident size and format name."""

    fmt: str

    @property
    def nbytes(self) -> int: ...

    def apply(self, x: Tensor) -> Tensor: ...


def _bias_bytes(bias: Tensor | None) -> int:
    return 0 if bias is None else bias.nbytes


def onednn_enabled() -> bool:
    """oneDNN prepacked fp32 GEMMs on the CPU (``PAGODA_ONEDNN=0`` turns them off)."""
    return switch_on("onednn") and torch.backends.mkldnn.is_available()


class DenseLinear:
    """Dense weight in the compute dtype. On the CPU in float32 the weight is prepacked once for
    oneDNN, whose GEMM keeps its speed for skinny batches where the default BLAS path stalls
    (3x faster for SmolLM2's LM head at batch 8-64 on a busy 2-core AMD host); ``F.linear``
    otherwise. Either way it is the same float32 product (summation order aside)."""

    def __init__(self, w: Tensor, dtype: torch.dtype, bias: Tensor | None, fmt: str) -> None:
        self.fmt = fmt
        self.weight = w.detach().to(dtype).contiguous()
        self.bias = None if bias is None else bias.detach().to(dtype)
        self._packed: Tensor | None = None
        if self.weight.device.type == "cpu" and dtype == torch.float32 and onednn_enabled():
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, 64)
            record("dense_linear", "onednn")

    @property
    def nbytes(self) -> int:
        w = self._packed if self._packed is not None else self.weight
        return w.numel() * w.element_size() + _bias_bytes(self.bias)

    def apply(self, x: Tensor) -> Tensor:
        if self._packed is not None and x.dtype == torch.float32 and x.dim() == 2:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias).to(x.dtype)


class Fp8Linear:
    """FP8 e4m3 weight with per-output-channel scales."""

    fmt = "fp8"

    def __init__(self, weight: Fp8Weight, bias: Tensor | None, backend: str | None) -> None:
        self.weight = weight
        self.bias = None if bias is None else bias.detach().float()
        self.backend = backend

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + _bias_bytes(self.bias)

    def apply(self, x: Tensor) -> Tensor:
        return fp8_linear(x, self.weight.weight, self.weight.scale, self.bias, self.backend)


class Fp8BlockLinear(Fp8Linear):
    """FP8 e4m3 weight with its checkpoint's block scales (DeepSeek-V3's ``weight_scale_inv``),
    computed as stored: the ``fp8`` phase format of a layer a checkpoint holds in FP8 blocks."""

    fmt = "fp8_block"
    weight: Fp8BlockWeight

    def apply(self, x: Tensor) -> Tensor:
        return fp8_block_linear(x, self.weight, self.bias, self.backend)


class Int4Linear:
    """Group-wise INT4 weight. ``int4_compute`` (``INT4_COMPUTES``): how a CPU weight computes with
    float32 activations; "float32" needs the native kernel and becomes "bf16" without it (the
    weight's ``cpu_compute`` says which ran; the engine's selector refuses that case beforehand)."""

    fmt = "int4"

    def __init__(
        self,
        weight: Int4Weight,
        dtype: torch.dtype,
        bias: Tensor | None,
        backend: str | None,
        int4_compute: str = DEFAULT_INT4_COMPUTE,
    ) -> None:
        check_int4_compute(int4_compute)
        self.weight = weight
        self.dtype = dtype
        self.bias = None if bias is None else bias.detach().float()
        self.backend = backend
        device = weight.packed.device
        if select_backend(device, backend) == "cpu" and device.type == "cpu":
            weight.cpu_compute = "float32" if dtype == torch.float32 and int4_compute == "float32" else "bf16"
            if weight.cpu_compute == "float32" and native_available():
                weight.prepare("cpu")  # the exact native kernel reads the canonical tensors
            else:
                # Keep only torch's CPU int4pack layout (bf16 scales/zeros) resident; the canonical
                # tensors are recoverable from it (scales rounded to bf16).
                weight.cpu_compute = "bf16"
                weight.prepare("cpu", CPU_COMPUTE_DTYPE, keep_canonical=False)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + _bias_bytes(self.bias)

    def apply(self, x: Tensor) -> Tensor:
        if x.dtype == self.dtype:  # the usual case: skip two no-op conversions per call
            return int4_linear(x, self.weight, self.bias, self.backend)
        return int4_linear(x.to(self.dtype), self.weight, self.bias, self.backend).to(x.dtype)


class Int8Linear:
    """Per-output-channel INT8 weight (the decode LM head's ``int8`` format)."""

    fmt = "int8"

    def __init__(self, weight: Int8Weight, dtype: torch.dtype, backend: str | None) -> None:
        self.weight = weight
        self.dtype = dtype
        self.backend = backend
        if dtype == torch.float32 and select_backend(weight.scales.device, backend) == "cpu":
            weight.prepare_native()  # block weights: the VNNI kernel's layout where it runs

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes

    def apply(self, x: Tensor) -> Tensor:
        return int8_linear(x, self.weight, self.backend)


def make_linear_weight(
    w: Tensor | Int4Weight | Fp8Weight | Fp8BlockWeight,
    fmt: str,
    dtype: torch.dtype,
    bias: Tensor | None = None,
    group_size: int | None = None,
    backend: str | None = None,
    int4_compute: str = DEFAULT_INT4_COMPUTE,
) -> LinearWeight:
    """Quantize/convert ``w [N, K]`` into ``fmt``; ``dtype`` is the engine's compute dtype,
    ``int4_compute`` how an INT4 weight computes on a CPU (``Int4Linear``).

    ``w`` may be a prequantized Int4Weight / Fp8Weight: used as is for its own format, dequantized
    for any other. A block-scaled Fp8BlockWeight serves ``fp8`` as stored (its block scales) and
    dequantizes exactly for the others (float32 for ``bf16`` under a float32 compute dtype)."""
    if isinstance(w, Int4Weight) and fmt == "int4":
        return Int4Linear(w, dtype, bias, backend, int4_compute)
    if isinstance(w, Fp8Weight) and fmt == "fp8":
        return Fp8Linear(w, bias, backend)
    if isinstance(w, Fp8BlockWeight) and fmt == "fp8":
        return Fp8BlockLinear(w, bias, backend)
    if isinstance(w, Int4Weight | Fp8Weight | Fp8BlockWeight):
        w = w.dequantize()
    if fmt == "bf16":
        return DenseLinear(w, dtype, bias, fmt)
    if fmt == "fp32":
        return DenseLinear(w, torch.float32, bias, fmt)
    if fmt == "fp8":
        return Fp8Linear(Fp8Weight.quantize(w), bias, backend)
    if fmt == "int4":
        g = pick_group_size(w.shape[1], group_size or 128)  # the largest allowed group dividing K
        return Int4Linear(quantize_int4(w, g), dtype, bias, backend, int4_compute)
    if fmt == "int8":
        if bias is not None:
            raise ValueError("the int8 format (a decode LM head) takes no bias")
        # lossless when the weight holds int8 blocks (GGUF Q8_0), else rounded per row
        exact = Int8Weight.exact_blocks(w) if dtype == torch.float32 else None
        return Int8Linear(exact or Int8Weight.quantize(w), dtype, backend)
    raise ValueError(f"unknown weight format {fmt!r}; accepted formats: {', '.join(FORMATS)}")
