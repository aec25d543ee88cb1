import pytest
import torch

from pagoda.kernels.linear import LinearWeight, make_linear_weight


@pytest.mark.parametrize("fmt", ["bf16", "fp32", "fp8", "int4"])
def test_make_linear_weight_formats(fmt):
    torch.manual_seed(0)
    w = torch.randn(32, 128)
    b = torch.randn(32)
    x = torch.randn(3, 128)
    lw = make_linear_weight(w, fmt, torch.float32, bias=b, group_size=64)
    assert isinstance(lw, LinearWeight) and lw.fmt == fmt
    y = lw.apply(x)
    want = x @ w.T + b
    assert y.shape == (3, 32) and y.dtype == torch.float32
    # dense exact-ish; fp8 ~2.6% (weight-only on CPU); int4 group 64 ~9-10% (bf16 compute on CPU).
    bound = {"bf16": 1e-6, "fp32": 1e-6, "fp8": 0.035, "int4": 0.12}[fmt]
    assert ((y - want).norm() / want.norm()).item() < bound
    expected_bytes = {
        "bf16": 32 * 128 * 4 + 32 * 4,
        "fp32": 32 * 128 * 4 + 32 * 4,
        "fp8": 32 * 128 + 32 * 4 + 32 * 4,
        # CPU backend, float32 compute (the default): the exact native kernel reads the canonical
        # packed nibbles [N, K/2], float32 scales and uint8 zeros, plus float32 offsets [N, K/group]
        "int4": 32 * 64 + 32 * 2 * 4 + 32 * 2 + 32 * 2 * 4 + 32 * 4,
    }[fmt]
    if fmt == "int4" and lw.weight.cpu_compute == "bf16":  # no C compiler here: torch's int4pack
        # layout alone stays resident: packed [N, K/2] and scales_and_zeros [K/group, N, 2] bf16
        expected_bytes = 32 * 64 + 2 * 32 * 2 * 2 + 32 * 4
    assert lw.nbytes == expected_bytes


def test_bf16_uses_compute_dtype():
    lw = make_linear_weight(torch.randn(16, 32), "bf16", torch.bfloat16)
    assert lw.weight.dtype == torch.bfloat16
    assert lw.nbytes == 16 * 32 * 2
    assert lw.apply(torch.randn(2, 32)).dtype == torch.float32


def test_int4_default_group_for_k576():
    lw = make_linear_weight(torch.randn(16, 576), "int4", torch.float32)
    assert lw.weight.group_size == 64


def test_int4_reference_backend_keeps_canonical_layout():
    lw = make_linear_weight(torch.randn(32, 128), "int4", torch.float32, group_size=64, backend="reference")
    assert lw.weight.packed is not None
    assert lw.nbytes == 32 * 64 + 32 * 2 * 4 + 32 * 2  # packed + float32 scales + uint8 zeros


def test_int4_bf16_compute_dtype_roundtrips_state():
    w = torch.randn(16, 128)
    lw = make_linear_weight(w, "int4", torch.bfloat16, group_size=32)
    x = torch.randn(2, 128)
    y = lw.apply(x)
    assert y.dtype == torch.float32
    # Recovered from the bf16 layout: zero points exact, scales rounded to bf16.
    from pagoda.kernels.int4 import quantize_int4

    want = quantize_int4(w, 32)
    st = lw.weight.state()
    assert torch.equal(st["packed"], want.packed) and torch.equal(st["zeros"], want.zeros)
    torch.testing.assert_close(st["scales"], want.scales, rtol=2**-8, atol=0)


def test_unknown_format():
    with pytest.raises(ValueError, match="bf16, fp32, fp8, int4, int8"):
        make_linear_weight(torch.randn(2, 2), "int3", torch.float32)
    with pytest.raises(ValueError, match="no bias"):
        make_linear_weight(torch.randn(2, 2), "int8", torch.float32, bias=torch.zeros(2))
