"""Per-output-channel INT8 weights (weight-only): the decode LM head's ``int8`` format.

Layout: ``qweight`` int8 [N, K], ``scales`` float32 [N]; dequantized weight ``q * scale[n]``.
The CPU path is torch's ``_weight_int8pack_mm`` (bf16 activations, the fast case on CPUs with
AVX-512 BF16; float32 activations run ~10x slower there); the reference dequantizes and
multiplies in float32. On CUDA the reference serves (no Triton kernel yet).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .dispatch import record, select_backend

CPU_COMPUTE_DTYPE = torch.bfloat16


@dataclass(eq=False)
class Int8Weight:
    qweight: Tensor  # int8 [N, K]
    scales: Tensor  # float32 [N]

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
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1]

    @property
    def nbytes(self) -> int:
        return self.qweight.nbytes + self.scales.nbytes + getattr(self, "_cpu_scales_nbytes", 0)

    def dequantize(self) -> Tensor:
        return self.qweight.float() * self.scales[:, None]

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
    if be == "cpu" and x.device.type == "cpu":
        record("int8_linear", "cpu")
        out = torch.ops.aten._weight_int8pack_mm(
            x2.to(CPU_COMPUTE_DTYPE).contiguous(), qw.qweight, qw._cpu_scales()
        )
    else:
        record("int8_linear", "reference")
        out = F.linear(x2.float(), qw.dequantize())
    return out.to(x.dtype).reshape(*lead, qw.out_features)
