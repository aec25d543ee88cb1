import pytest
import torch
from kernel_testing import ALL_BACKENDS, DEVICE, native_library, needs_triton

from pagoda.kernels import cpu_fp8_native
from pagoda.kernels.fp8 import Fp8Weight, fp8_linear, fp8_linear_scaled_mm
from pagoda.kernels.fp8_format import (
    FP8_BF16_BIAS,
    FP8_DTYPE,
    FP8_MAX,
    dequantize_fp8,
    fp8_to_float_scaled_down,
    quantize_fp8,
    quantize_fp8_weight,
)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_quantize_clamps_and_never_nan():
    x = torch.tensor([0.0, 1.0, -1.0, 1e6, -1e6, 447.0, 449.0])
    q = quantize_fp8(x, torch.tensor(1.0))
    assert q.dtype == FP8_DTYPE
    back = q.float()
    assert not torch.isnan(back).any()
    assert back[3] == FP8_MAX and back[4] == -FP8_MAX and back[6] == FP8_MAX
    assert back[1] == 1.0 and back[0] == 0.0


def test_roundtrip_error_within_e4m3_precision():
    x = torch.randn(64, 32) * 5
    scale = x.abs().amax() / FP8_MAX
    back = dequantize_fp8(quantize_fp8(x, scale), scale)
    # e4m3 keeps 3 mantissa bits: relative rounding error <= 2**-4 for normal values.
    big = x.abs() > scale * 2**-6 * 8
    assert ((back - x).abs()[big] <= x.abs()[big] * 2**-4 + 1e-7).all()


def test_weight_quant_per_channel_scales():
    w = torch.randn(8, 16) * torch.arange(1, 9)[:, None]
    wq, s = quantize_fp8_weight(w)
    assert wq.shape == (8, 16) and s.shape == (8,) and s.dtype == torch.float32
    torch.testing.assert_close(s, w.abs().amax(1) / FP8_MAX)
    assert (wq.float().abs().amax(1) == FP8_MAX).all()


def test_zero_weight_row_stays_finite():
    w = torch.zeros(2, 16)
    w[1] = 1.0
    wq, s = quantize_fp8_weight(w)
    assert torch.isfinite(s).all() and (wq[0].float() == 0).all()


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("m,n,k", [(1, 16, 32), (3, 24, 64), (17, 40, 96)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_matches_reference(backend, m, n, k, dtype):
    gen = torch.Generator().manual_seed(m * n + k)
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen)
    wq, s = quantize_fp8_weight(w)
    ref = fp8_linear(x, wq, s, bias, backend="reference")
    out = fp8_linear(x.to(DEVICE), wq.to(DEVICE), s.to(DEVICE), bias.to(DEVICE), backend=backend).cpu()
    assert out.shape == (m, n) and out.dtype == dtype
    # cpu (on CPU tensors) is weight-only like the reference: rounding-order differences only.
    # triton also quantizes activations per token to e4m3 (about 2-3% relative error alone).
    # bf16 outputs add < 1%.
    tol = 0.06 if backend == "triton" else 1e-5
    assert rel_err(out, ref) <= tol + (1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("m", [1, 4])
def test_scaled_mm_path_close_to_reference(m):
    gen = torch.Generator().manual_seed(m)
    w, x = torch.randn(48, 64, generator=gen), torch.randn(m, 64, generator=gen)
    wq, s = quantize_fp8_weight(w)
    ref = fp8_linear(x, wq, s, backend="reference")
    # Dynamic per-token e4m3 activations add ~2-3% relative error on top of the weights'.
    assert rel_err(fp8_linear_scaled_mm(x, wq, s), ref) < 0.05


def test_fp8_linear_leading_dims_and_bad_shapes():
    w = torch.randn(8, 16)
    wq, s = quantize_fp8_weight(w)
    x = torch.randn(2, 3, 16)
    assert fp8_linear(x, wq, s, backend="cpu").shape == (2, 3, 8)
    with pytest.raises(ValueError, match="features"):
        fp8_linear(torch.randn(2, 15), wq, s)
    with pytest.raises(ValueError, match="float8"):
        fp8_linear(x, w, s)


def test_fp8_weight_state_roundtrip_and_nbytes():
    fw = Fp8Weight.quantize(torch.randn(12, 32))
    assert fw.nbytes == 12 * 32 + 12 * 4
    back = Fp8Weight.from_state(fw.state())
    assert torch.equal(back.weight.view(torch.uint8), fw.weight.view(torch.uint8))
    assert torch.equal(back.scale, fw.scale)
    with pytest.raises(ValueError):
        Fp8Weight.from_state({"weight": torch.zeros(2, 2), "scale": torch.ones(2)})


@needs_triton
@pytest.mark.parametrize("m,n,k", [(1, 16, 32), (5, 70, 100), (33, 24, 64)])
def test_triton_fp8_gemm_matches_scaled_mm(m, n, k):
    """Both quantize activations per token identically, so only accumulation order differs."""
    gen = torch.Generator().manual_seed(k)
    w, x, bias = (
        torch.randn(n, k, generator=gen),
        torch.randn(m, k, generator=gen),
        torch.randn(n, generator=gen),
    )
    wq, s = quantize_fp8_weight(w)
    cpu = fp8_linear_scaled_mm(x, wq, s, bias)
    out = fp8_linear(x.to(DEVICE), wq.to(DEVICE), s.to(DEVICE), bias.to(DEVICE), backend="triton").cpu()
    torch.testing.assert_close(out, cpu, rtol=1e-5, atol=1e-5 * cpu.abs().max().item())


def test_fast_fp8_decode_matches_torch_cast_for_every_finite_code():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    want = codes.view(FP8_DTYPE).float()
    finite = ~torch.isnan(want)
    got = fp8_to_float_scaled_down(codes) * FP8_BF16_BIAS
    assert torch.equal(got[finite], want[finite])


@pytest.fixture
def native_fp8() -> None:
    """The native library: a skip only where no C compiler exists, a failure where it did not build."""
    native_library()


@pytest.fixture
def fused_fp8(native_fp8: None) -> None:
    if not cpu_fp8_native.fused_available():
        pytest.skip("the fused FP8 kernel needs AVX-512 F, which this CPU (or its build) lacks")


def test_native_fp8_decode_gives_every_finite_codes_value(native_fp8):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(3).reshape(12, 64)
    got = cpu_fp8_native.fp8_rows_f32(codes)
    assert got is not None and got.shape == (12, 64)
    want = codes.view(FP8_DTYPE).float()
    finite = ~torch.isnan(want)
    assert torch.equal(got[finite], want[finite])
    assert torch.equal(
        got[~finite].abs(), torch.full_like(got[~finite], 480.0)
    )  # NaN codes: as the torch trick
    assert cpu_fp8_native.fp8_rows_f32(codes[:, ::2]) is None  # strided: the caller decodes in torch


@pytest.mark.parametrize("m, k", [(260, 96), (3, 40)])  # 260 rows: past the fused kernel; K 40: not % 16
def test_natively_decoded_fp8_linear_matches_the_torch_decoded_one(m, k, monkeypatch, native_fp8):
    gen = torch.Generator().manual_seed(m)
    w = torch.randn(1031, k, generator=gen)  # 1031 rows: a last block shorter than the rest
    x, bias = torch.randn(m, k, generator=gen), torch.randn(1031, generator=gen)
    wq, s = quantize_fp8_weight(w)
    native = fp8_linear(x, wq, s, bias, backend="cpu")
    monkeypatch.setenv("PAGODA_NATIVE_FP8", "0")
    torch_decoded = fp8_linear(x, wq, s, bias, backend="cpu")
    torch.testing.assert_close(native, torch_decoded, rtol=1e-5, atol=1e-5 * torch_decoded.abs().max().item())


@pytest.mark.parametrize("m, n", [(1, 1031), (5, 7), (70, 64), (127, 3)])  # full and partial tiles
def test_fused_native_fp8_gemm_matches_the_reference(m, n, fused_fp8):
    gen = torch.Generator().manual_seed(m * n)
    w = torch.randn(n, 160, generator=gen)
    w[0, :7] = 1e-4  # subnormal e4m3 codes
    x, bias = torch.randn(m, 160, generator=gen), torch.randn(n, generator=gen)
    x[0, :40] = 1e-30  # products that would be float32 subnormals if the codes were read scaled down
    wq, s = quantize_fp8_weight(w)
    assert cpu_fp8_native.fp8_gemm_f32(x, wq.view(torch.uint8)) is not None  # the fused kernel runs
    out = fp8_linear(x, wq, s, bias, backend="cpu")
    ref = fp8_linear(x, wq, s, bias, backend="reference")
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_fused_native_fp8_gemm_rows_do_not_depend_on_the_batch(fused_fp8):
    """Rows decoded in registers (up to 4) and rows sharing a decoded chunk (more) give the same bits;
    K 4128: two full chunks of 2048 and a short one; N 7: a full block of 4 weight rows and a partial."""
    gen = torch.Generator().manual_seed(7)
    w, x = torch.randn(7, 4128, generator=gen), torch.randn(13, 4128, generator=gen)
    wq, s = quantize_fp8_weight(w)
    raw = wq.view(torch.uint8)
    many = cpu_fp8_native.fp8_gemm_f32(x, raw)
    assert many is not None
    ref = x.double() @ wq.float().double().T
    torch.testing.assert_close(many.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    for i in range(13):
        assert torch.equal(cpu_fp8_native.fp8_gemm_f32(x[i : i + 1], raw)[0], many[i])
    assert torch.equal(cpu_fp8_native.fp8_gemm_f32(x[:3].contiguous(), raw), many[:3])
    assert torch.equal(cpu_fp8_native.fp8_gemm_f32(x[5:12].contiguous(), raw), many[5:12])


def test_fused_native_fp8_gemm_declines_what_it_does_not_take(fused_fp8):
    raw = torch.zeros(4, 40, dtype=torch.uint8)
    assert cpu_fp8_native.fp8_gemm_f32(torch.ones(2, 40), raw) is None  # K not a multiple of 16
    raw = torch.zeros(4, 32, dtype=torch.uint8)
    assert cpu_fp8_native.fp8_gemm_f32(torch.ones(2, 32, dtype=torch.float64), raw) is None
    assert cpu_fp8_native.fp8_gemm_f32(torch.ones(32, 2).T, raw) is None  # not contiguous
