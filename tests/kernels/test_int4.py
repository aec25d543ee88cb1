import pytest
import torch
from kernel_testing import DEVICE, native_built, needs_triton, require_native

from pagoda.kernels.int4 import (
    Int4Weight,
    cpu_int4_mm,
    dequantize_int4,
    int4_linear,
    pack_nibbles,
    pick_group_size,
    quantize_int4,
    unpack_nibbles,
)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize(
    "k,preferred,expected",
    [(576, 128, 64), (1536, 128, 128), (96, 128, 32), (4096, 128, 128), (512, 256, 256), (576, 256, 64)],
)
def test_pick_group_size(k, preferred, expected):
    assert pick_group_size(k, preferred) == expected


def test_pick_group_size_rejects():
    with pytest.raises(ValueError, match="K=48"):
        pick_group_size(48)
    with pytest.raises(ValueError):
        pick_group_size(128, preferred=100)


def test_pack_unpack_roundtrip():
    q = torch.randint(0, 16, (5, 34), dtype=torch.uint8)
    packed = pack_nibbles(q)
    assert packed.shape == (5, 17)
    assert torch.equal(unpack_nibbles(packed), q)
    assert packed[0, 0] == q[0, 0] | (q[0, 1] << 4)


@pytest.mark.parametrize("symmetric", [False, True])
def test_quantize_error_bounded_by_half_step(symmetric):
    w = torch.randn(6, 128) * 3
    qw = quantize_int4(w, 32, symmetric=symmetric)
    err = (dequantize_int4(qw) - w).abs().reshape(6, 4, 32)
    step = qw.scales[..., None]
    # round-to-nearest: at most half a step away (symmetric clamps +amax at 7 steps: 7 * s = amax).
    assert (err <= step * 0.5 + 1e-5).all()


def test_asymmetric_zero_is_exact_and_constant_group():
    w = torch.zeros(2, 64)
    w[1, :32] = 5.0
    qw = quantize_int4(w, 32)
    torch.testing.assert_close(dequantize_int4(qw), w)


def _case(m, n, k, g, sym, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(m, k, generator=gen)
    b = torch.randn(n, generator=gen)
    return quantize_int4(w, g, symmetric=sym), x, b


@pytest.mark.parametrize("m", [1, 3, 17, 64])
@pytest.mark.parametrize("n,k,g", [(32, 576, 64), (7, 128, 32), (48, 256, 128), (16, 512, 256)])
@pytest.mark.parametrize("sym", [False, True])
def test_cpu_layout_maps_exactly_in_fp32(m, n, k, g, sym):
    """Our (q - z) * s mapped onto torch's (q - 8) * s + z' layout, run in float32."""
    qw, x, _ = _case(m, n, k, g, sym)
    ref = int4_linear(x, qw, backend="reference")
    out = cpu_int4_mm(x, qw, torch.float32)
    assert out.shape == (m, n) and out.dtype == torch.float32
    # Same math in fp32 ((q-8)*s + (8-z)*s vs (q-z)*s): only summation order/rounding differs.
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("m", [1, 3, 17, 64])
@pytest.mark.parametrize("n,k,g", [(32, 576, 64), (7, 128, 32), (24, 1536, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_int4_linear_matches_reference(m, n, k, g, dtype):
    qw, x, b = _case(m, n, k, g, False, seed=m)
    ref = int4_linear(x, qw, b, backend="reference")
    out = int4_linear(x.to(dtype), qw, b, backend="cpu")
    assert out.shape == (m, n) and out.dtype == dtype
    # The CPU path computes in bf16 (activations, scales and zeros rounded to 8 bits).
    assert rel_err(out, ref) < 1e-2


@needs_triton
@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("n,k,g,sym", [(32, 576, 64, False), (7, 128, 32, True), (48, 256, 128, False)])
def test_triton_int4_matches_reference(m, n, k, g, sym):
    qw, x, b = _case(m, n, k, g, sym, seed=m)
    ref = int4_linear(x, qw, b, backend="reference")
    qd = Int4Weight.from_state({kk: v.to(DEVICE) for kk, v in qw.state().items()}, qw.meta())
    out = int4_linear(x.to(DEVICE), qd, b.to(DEVICE), backend="triton").cpu()
    assert out.shape == (m, n) and out.dtype == torch.float32
    # fp32 accumulation in tiles / split-K partial sums: rounding-order differences only
    # (tf32 is disabled in the kernel).
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@needs_triton
def test_triton_int4_bf16_m64():
    qw, x, b = _case(64, 16, 128, 64, False, seed=5)
    ref = int4_linear(x.bfloat16(), qw, None, backend="reference")
    qd = Int4Weight.from_state({kk: v.to(DEVICE) for kk, v in qw.state().items()}, qw.meta())
    out = int4_linear(x.bfloat16().to(DEVICE), qd, None, backend="triton").cpu()
    assert out.dtype == torch.bfloat16
    assert rel_err(out, ref) < 1e-2  # bf16 inputs/outputs, fp32 accumulate


def test_state_roundtrip_and_meta():
    qw, _, _ = _case(1, 24, 192, 64, False)
    back = Int4Weight.from_state(qw.state(), qw.meta())
    assert torch.equal(back.packed, qw.packed) and torch.equal(back.zeros, qw.zeros)
    assert back.group_size == 64 and not back.symmetric
    sym, _, _ = _case(1, 24, 192, 64, True)
    assert "zeros" not in sym.state()
    assert Int4Weight.from_state(sym.state(), sym.meta()).symmetric
    with pytest.raises(ValueError, match="zeros"):
        Int4Weight.from_state(sym.state(), qw.meta())


def test_nbytes_counts_what_is_resident():
    n, k, g = 24, 192, 64
    qw, x, _ = _case(1, n, k, g, False)
    canonical = n * k // 2 + n * (k // g) * 4 + n * (k // g)
    assert qw.nbytes == canonical
    want = dequantize_int4(qw)
    qw.prepare("cpu", torch.float32, keep_canonical=False)
    npad = 32  # torch's CPU int4pack needs N % 16 == 0
    assert qw.packed is None
    assert qw.nbytes == npad * k // 2 + (k // g) * npad * 2 * 4
    # Canonical tensors are recovered exactly from the CPU layout when needed.
    torch.testing.assert_close(dequantize_int4(qw), want, rtol=0, atol=0)
    torch.testing.assert_close(
        cpu_int4_mm(x, qw, torch.float32), x @ want.T, rtol=1e-4, atol=1e-4 * want.abs().max().item()
    )


@needs_triton
@pytest.mark.parametrize("split_k", [1, 2, 5, 9])
def test_triton_int4_split_k(split_k):
    """K=576, group 64: nine K blocks; uneven splits must sum to the same result."""
    from pagoda.kernels.triton_int4 import int4_gemm

    qw, x, b = _case(3, 40, 576, 64, False, seed=split_k)
    ref = int4_linear(x, qw, b, backend="reference")
    dev = [t.to(DEVICE) for t in (x, qw.packed, qw.scales, qw.zeros, b)]
    out = int4_gemm(dev[0], dev[1], dev[2], dev[3], 64, dev[4], split_k=split_k).cpu()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def _float_zero_case(n: int, k: int, g: int, seed: int = 0) -> tuple[Int4Weight, torch.Tensor]:
    """A Q4_1-style weight: integer q, float scale and float min per group (fp16-representable)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(n, k // g, generator=gen) * 0.02 + 1e-3).half().float()
    mins = (-torch.rand(n, k // g, generator=gen) * 0.1).half().float()
    qw = Int4Weight(n, k, g, False, pack_nibbles(q), scales, None, mins)
    w = (q.float().view(n, k // g, g) * scales[..., None] + mins[..., None]).view(n, k)
    return qw, w


def test_float_zero_dequantizes_exactly():
    qw, w = _float_zero_case(24, 128, 32)
    assert qw.float_zero and torch.equal(dequantize_int4(qw), w)
    back = Int4Weight.from_state(qw.state(), qw.meta())
    assert back.float_zero and torch.equal(back.mins, qw.mins) and torch.equal(dequantize_int4(back), w)
    with pytest.raises(ValueError, match="not integer zero points"):
        _ = qw.zero_points
    with pytest.raises(ValueError, match="mins"):
        Int4Weight.from_state({"packed": qw.packed, "scales": qw.scales}, qw.meta())
    with pytest.raises(ValueError, match="either"):
        Int4Weight(24, 128, 32, False, qw.packed, qw.scales, torch.zeros_like(qw.packed[:, :4]), qw.mins)


@pytest.mark.parametrize("m", [1, 5])
def test_float_zero_cpu_layout_fp32_and_restore(m):
    qw, w = _float_zero_case(40, 256, 32, seed=m)
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m))
    ref = x @ w.t()
    torch.testing.assert_close(cpu_int4_mm(x, qw, torch.float32), ref, rtol=1e-5, atol=1e-5)
    assert rel_err(int4_linear(x, qw, backend="cpu"), ref) < 1e-2  # bf16 compute on the fast path
    qw.prepare("cpu", torch.float32, keep_canonical=False)
    torch.testing.assert_close(dequantize_int4(qw), w, rtol=0, atol=1e-6)  # restored from the layout


@needs_triton
@pytest.mark.parametrize("m", [1, 17])
def test_triton_int4_float_zero(m):
    qw, w = _float_zero_case(48, 256, 32, seed=m)
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m))
    qd = Int4Weight.from_state({kk: v.to(DEVICE) for kk, v in qw.state().items()}, qw.meta())
    out = int4_linear(x.to(DEVICE), qd, backend="triton").cpu()
    torch.testing.assert_close(out, x @ w.t(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("m", [1, 5, 9, 16, 17])  # fused (<= 16 rows, blocks of 8) and buffered
@pytest.mark.parametrize("g,sym", [(32, False), (64, True), (128, False)])
def test_native_float32_kernel_matches_reference(m, g, sym):
    """The float32 CPU kernel (cpu_int4.c, built at run time) against the reference dequant + matmul."""
    from pagoda.kernels.cpu_int4_native import native_int4_mm

    qw, x, _ = _case(m, 41, 256, g, sym, seed=m)  # odd N: rows of W in pairs and one alone
    require_native()
    y = native_int4_mm(x, qw.packed, qw.scales, qw.offsets().contiguous(), g)
    ref = x @ dequantize_int4(qw).t()
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    fz, w = _float_zero_case(24, 96, 32, seed=m)
    y = native_int4_mm(x[:, :96].contiguous(), fz.packed, fz.scales, fz.mins, 32)
    torch.testing.assert_close(y, x[:, :96] @ w.t(), rtol=1e-5, atol=1e-5)


def test_int4_linear_compute_modes(monkeypatch, tmp_path):
    """float32 compute runs a native kernel over the weight's own nibbles (canonical, or 16-row
    interleaved for the VNNI kernel); bf16 (or no compiler) the int4pack op over bf16 copies, so only
    the float32 path agrees with the reference to 1e-5."""
    from pagoda.kernels import cpu_int4_native
    from pagoda.kernels.linear import make_linear_weight

    w, x = torch.randn(48, 128), torch.randn(3, 128)
    ref = x @ dequantize_int4(quantize_int4(w, 32)).t()
    exact = make_linear_weight(w, "int4", torch.float32, group_size=32, int4_compute="float32")
    if native_built():
        assert exact.weight.cpu_compute == "float32"
        assert exact.weight.native_nibbles() is not None and not exact.weight._cpu  # no bf16 copy
        torch.testing.assert_close(exact.apply(x), ref, rtol=1e-5, atol=1e-5)
    fast = make_linear_weight(w, "int4", torch.float32, group_size=32, int4_compute="bf16")
    assert fast.weight.cpu_compute == "bf16" and fast.weight.packed is None  # only the int4pack layout
    assert rel_err(fast.apply(x), ref) < 1e-2
    with pytest.raises(ValueError, match="float32, bf16"):
        make_linear_weight(w, "int4", torch.float32, group_size=32, int4_compute="fp16")
    # no compiler: the float32 request falls back to the bf16 op, saying why (status)
    monkeypatch.setattr(cpu_int4_native, "_lib", None)
    monkeypatch.setitem(cpu_int4_native.status, "reason", "not built yet")
    monkeypatch.setitem(cpu_int4_native.status, "loaded", False)
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path))
    fallback = make_linear_weight(w, "int4", torch.float32, group_size=32, int4_compute="float32")
    assert fallback.weight.cpu_compute == "bf16" and cpu_int4_native.status["loaded"] is False
    assert rel_err(fallback.apply(x), ref) < 1e-2


def test_float32_compute_keeps_exact_fp16_params_in_fp16():
    """GGUF-style scales and mins (float16 values) are held as 12-bit codes into a float16 table for
    the native kernel: under 5 bits a weight, the same values; with more distinct values than codes
    reach they stay float16; float32 ones that float16 cannot hold stay float32."""
    from pagoda.kernels.linear import make_linear_weight

    require_native()
    qw, w = _float_zero_case(32, 128, 32, seed=3)
    lin = make_linear_weight(qw, "int4", torch.float32)
    assert lin.weight.cpu_compute == "float32"
    codes = lin.weight.codes
    assert codes is not None and lin.weight.scales is None and lin.weight.mins is None
    assert codes.table.dtype == torch.float16 and codes.codes.shape == (32, 4, 3)
    assert lin.nbytes == 32 * 64 + 32 * 4 * 3 + 2 * codes.table.numel()  # nibbles + codes + table
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(lin.apply(x), x @ w.t(), rtol=1e-5, atol=1e-5)
    assert torch.equal(dequantize_int4(lin.weight), w)  # (expands the codes back to float16)
    assert lin.weight.codes is None and lin.weight.scales.dtype == torch.float16
    many, w_many = _float_zero_case(64, 4096, 32, seed=4)  # 8192 groups: > 4096 distinct values
    wide = make_linear_weight(many, "int4", torch.float32)
    assert wide.weight.codes is None and wide.weight.scales.dtype == torch.float16
    assert wide.nbytes == 64 * 2048 + 2 * (64 * 128 * 2)
    torch.testing.assert_close(
        wide.apply(x.repeat(1, 32)), x.repeat(1, 32) @ w_many.t(), rtol=1e-5, atol=1e-4
    )
    fresh, _ = _float_zero_case(32, 128, 32, seed=3)  # (make_linear_weight adopts the object it gets)
    odd = Int4Weight(32, 128, 32, False, fresh.packed, fresh.scales * (1 + 2**-20), None, fresh.mins)
    kept = make_linear_weight(odd, "int4", torch.float32)
    assert kept.weight.scales.dtype == torch.float32


def test_interleaved_nibbles_round_trip_and_serve_the_native_matmul():
    """The VNNI kernel's 16-row layout (N padded to 16) holds the canonical nibbles exactly, and a
    prepared float32-compute weight computes what the canonical layout does; NaN and inf in x give
    the float32 kernel's answer (float semantics), not a fixed-point one."""
    from pagoda.kernels.cpu_int4_native import native_int4_mm, vnni_available
    from pagoda.kernels.int4 import deinterleave16, interleave16

    qw, w = _float_zero_case(37, 256, 32, seed=5)
    p16 = interleave16(qw.packed)
    assert p16.shape == (3, 32, 16, 4) and torch.equal(deinterleave16(p16, 37), qw.packed)
    assert not deinterleave16(p16, 48)[37:].any()  # zero padding rows
    if not vnni_available():
        pytest.skip("the VNNI INT4 kernel does not run here (no AVX-512 VNNI, or no compiler)")
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(2))
    x[1, 7], x[3, 100] = float("inf"), float("nan")
    s, o = qw.scales.half(), qw.mins.half()
    canonical = native_int4_mm(x, qw.packed, s, o, 32)
    via16 = native_int4_mm(x, p16, s, o, 32, interleaved=True)
    torch.testing.assert_close(
        via16, canonical, rtol=0, atol=0, equal_nan=True
    )  # rows 1, 3: the float kernel
    finite = [0, 2, 4]
    torch.testing.assert_close(via16[finite], x[finite] @ w.t(), rtol=1e-5, atol=1e-5)
    qw.cpu_compute = "float32"
    qw.prepare("cpu")
    assert qw.packed is None and qw.packed16 is not None and qw.codes is not None
    torch.testing.assert_close(int4_linear(x[finite], qw), x[finite] @ w.t(), rtol=1e-5, atol=1e-5)
    assert torch.equal(dequantize_int4(qw), w) and qw.packed16 is None  # back to the canonical layout
    plain = quantize_int4(torch.randn(40, 256, generator=torch.Generator().manual_seed(3)), 64)
    want = x[finite] @ dequantize_int4(plain).t()
    plain.cpu_compute = "float32"  # float32 scales and integer zeros: no codes, offsets derived
    plain.prepare("cpu")
    for _ in range(2):  # reading the parameters leaves the nibbles where they are
        torch.testing.assert_close(int4_linear(x[finite], plain), want, rtol=1e-5, atol=1e-5)
        assert plain.packed16 is not None and plain.packed is None


def test_the_vnni_switch_keeps_the_float32_kernels(monkeypatch):
    """PAGODA_NATIVE_VNNI=0: float32-compute weights keep their canonical layouts (the float32 kernels)."""
    from pagoda.kernels import cpu_int4_native
    from pagoda.kernels.int8 import Int8Weight

    monkeypatch.setattr(cpu_int4_native, "_vnni_runs", {})
    monkeypatch.setenv("PAGODA_NATIVE_VNNI", "0")
    assert not cpu_int4_native.vnni_available() and not cpu_int4_native.vnni8_available()
    qw, w = _float_zero_case(32, 128, 32, seed=6)
    qw.cpu_compute = "float32"
    qw.prepare("cpu")
    assert qw.packed16 is None and qw.native_nibbles()[1] is False
    q8 = Int8Weight(torch.randint(-127, 128, (16, 64), dtype=torch.int8), torch.ones(16, 2).half(), 32)
    q8.prepare_native()
    assert q8.q16 is None and q8.qweight is not None
    x = torch.randn(3, 128)
    if cpu_int4_native.library() is not None:
        torch.testing.assert_close(int4_linear(x, qw), x @ w.t(), rtol=1e-5, atol=1e-5)
