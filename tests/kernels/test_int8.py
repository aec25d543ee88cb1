"""INT8 weights (the decode LM head's int8 format): per-row quantization and both paths; exact
Q8_0-style blocks recovered from a float weight, and the native float32 kernel over them."""

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


def q8_blocks(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """A float32 weight made of GGUF Q8_0 blocks: float16 scale times int8 in [-127, 127], one
    value of each block at +-127 (as llama.cpp's quantizer leaves it)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-126, 127, (n, k // 32, 32), generator=gen).float()
    q[..., 0] = torch.where(torch.rand(n, k // 32, generator=gen) < 0.5, -127.0, 127.0)
    d = (torch.rand(n, k // 32, generator=gen) * 1e-2 + 1e-4).half().float()
    d[0, 0] = 0.0  # an all-zero block
    q[0, 0] = 0.0
    return (q * d[..., None]).reshape(n, k)


def test_exact_blocks_hold_q8_0_weights_and_refuse_others():
    w = q8_blocks(48, 96)
    qw = Int8Weight.exact_blocks(w)
    assert qw is not None and qw.group_size == 32 and qw.scales.dtype == torch.float16
    assert qw.scales.shape == (48, 3) and torch.equal(qw.dequantize(), w)
    assert Int8Weight.exact_blocks(torch.randn(48, 96)) is None  # not blocks: nothing claimed
    assert Int8Weight.exact_blocks(w[:, :40]) is None  # K not a multiple of the block
    lin = make_linear_weight(w, "int8", torch.float32)
    assert lin.weight.group_size == 32 and lin.nbytes == 48 * 96 + 48 * 3 * 2


@pytest.mark.parametrize("m", [1, 5, 9, 16, 17])  # fused (<= 16 rows, blocks of 8) and buffered
def test_native_block_kernel_matches_the_float32_weights(m):
    w = q8_blocks(65, 160, seed=m)  # odd N: rows of W in pairs and one alone
    qw = Int8Weight.exact_blocks(w)
    x = torch.randn(m, 160, generator=torch.Generator().manual_seed(m))
    out = int8_linear(x, qw, backend="cpu")
    ref = x @ w.t()
    assert out.dtype == torch.float32 and out.shape == (m, 65)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)  # float32 arithmetic, exact weights
    torch.testing.assert_close(int8_linear(x, qw, backend="reference"), ref, rtol=1e-5, atol=1e-5)


def test_the_builtin_int8_head_is_its_q8_0_embedding(make_engine):
    """The built-in model's tied embedding is GGUF Q8_0: the int8 head holds it exactly."""
    dense = make_engine(kv_memory=16 << 20, decode_lm_head="dense")
    int8 = make_engine(kv_memory=16 << 20, decode_lm_head="int8")
    head = int8.model.lm_head.by_phase["decode"].weight
    assert head.group_size == 32 and torch.equal(head.dequantize(), dense.model.embed)
    ids = dense.tokenize("The capital of France is Paris, and the capital of Italy is")
    a, b = dense.score(ids, phase="decode"), int8.score(ids, phase="decode")
    assert (a - b).abs().max().item() < 1e-3  # the same weights; only the summation order differs
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_the_auto_head_is_int8_only_where_that_loses_nothing(make_engine):
    """``auto`` (the default) takes int8 blocks for a Q8_0 head with float32 CPU compute, else dense."""
    from kernel_testing import require_native

    from pagoda.kernels.int8 import exact_int8_head

    cpu = torch.device("cpu")
    q8 = q8_blocks(64, 160, seed=3)
    require_native()
    assert exact_int8_head(q8, torch.float32, cpu) is not None
    assert exact_int8_head(q8 + 1e-3, torch.float32, cpu) is None  # not blocks: rounding would lose
    assert exact_int8_head(q8.bfloat16(), torch.bfloat16, cpu) is None
    assert exact_int8_head(q8, torch.float32, torch.device("meta")) is None
    auto = make_engine(kv_memory=16 << 20)
    assert auto.config.decode_lm_head == "auto"
    assert isinstance(auto.model.lm_head.by_phase["decode"].weight, Int8Weight)
    assert not isinstance(auto.model.lm_head.by_phase["prefill"].weight, Int8Weight)  # prefill stays dense


def test_vnni_layout_round_trips_and_serves_the_head():
    """The VNNI kernel's biased 16-row layout holds the int8 weights exactly (-128 and 127 included,
    N padded); a prepared block weight computes what the float32 kernel does, and NaN or inf in x
    gets the float32 kernel's answer."""
    from pagoda.kernels.cpu_int4_native import native_int8_mm, vnni8_available
    from pagoda.kernels.int8 import deinterleave16_i8, interleave16_i8

    q = torch.randint(-128, 128, (37, 96), generator=torch.Generator().manual_seed(0), dtype=torch.int8)
    q[0, 0], q[1, 1] = -128, 127
    q16 = interleave16_i8(q)
    assert q16.shape == (3, 24, 16, 4) and q16.dtype == torch.uint8
    assert torch.equal(deinterleave16_i8(q16, 37), q) and not deinterleave16_i8(q16, 48)[37:].any()
    if not vnni8_available():
        pytest.skip("the VNNI INT8 kernel does not run here (no AVX-512 VNNI, or no compiler)")
    w = q8_blocks(37, 576, seed=3)
    qw = Int8Weight.exact_blocks(w)
    x = torch.randn(9, 576, generator=torch.Generator().manual_seed(4))
    x[2, 5], x[6, 300] = float("-inf"), float("nan")
    plain = native_int8_mm(x, qw.qweight, qw.scales, 32)
    lin = make_linear_weight(w, "int8", torch.float32)
    assert lin.weight.qweight is None and lin.weight.q16 is not None and lin.nbytes == 48 * 576 + 37 * 18 * 2
    torch.testing.assert_close(
        lin.apply(x), plain, rtol=0, atol=2e-6 * float(plain[[0, 1, 3]].abs().max()), equal_nan=True
    )
    finite = [0, 1, 3, 4, 5, 7, 8]
    torch.testing.assert_close(lin.apply(x[finite]), x[finite] @ w.t(), rtol=1e-5, atol=1e-5)
    assert torch.equal(lin.weight.dequantize(), w) and lin.weight.q16 is None  # back to int8 [N, K]
