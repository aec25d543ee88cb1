"""Per-row INT8 weights (the decode LM head's int8 format): quantization and both paths."""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels.int8 import Int8Weight, int8_linear
from pagoda.kernels.linear import make_linear_weight


def test_quantize_error_is_half_a_step():
    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(0))
    qw = Int8Weight.quantize(w)
    assert qw.qweight.dtype == torch.int8 and qw.scales.shape == (40,)
    err = (qw.dequantize() - w).abs()
    assert bool((err <= qw.scales[:, None] / 2 + 1e-7).all())
    with pytest.raises(ValueError, match="2-D"):
        Int8Weight.quantize(torch.zeros(3))


@pytest.mark.parametrize("m", [1, 7])
def test_cpu_path_matches_reference(m):
    gen = torch.Generator().manual_seed(m)
    qw = Int8Weight.quantize(torch.randn(64, 128, generator=gen))
    x = torch.randn(m, 128, generator=gen)
    ref = int8_linear(x, qw, backend="reference")
    torch.testing.assert_close(ref, x @ qw.dequantize().t())
    out = int8_linear(x, qw, backend="cpu")
    assert out.dtype == torch.float32 and out.shape == (m, 64)
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel < 1e-2  # bf16 activations on the CPU path
    with pytest.raises(ValueError, match="features"):
        int8_linear(torch.zeros(1, 5), qw)


def test_linear_factory_int8_counts_bytes():
    lin = make_linear_weight(torch.randn(32, 64), "int8", torch.float32)
    assert lin.fmt == "int8" and lin.nbytes == 32 * 64 + 32 * 4
    lin.apply(torch.randn(2, 64))
    assert lin.nbytes == 32 * 64 + 32 * 4 + 32 * 2  # + the bf16 scales the CPU path keeps
