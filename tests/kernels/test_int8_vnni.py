"""The AVX-512 VNNI INT8 GEMM (kernels/cpu_int8_vnni.c) against a float64 reference of q * scale and
against the float32 INT8 kernel on the canonical layout."""

from __future__ import annotations

import ctypes

import pytest
import torch
from kernel_testing import native_library, one_torch_thread  # noqa: F401 (a fixture)

from pagoda.kernels.vnni_layout import interleave16_i8

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MS = (1, 2, 8, 9, 16, 17, 64)
NS = (1, 37, 50, 16)
KG = ((32, 32), (96, 32), (576, 32), (576, 64), (128, 64))
XLIMIT = 8323072  # 127 * 2^16: the largest |x / step| of a 32-block


def _weights(n: int, k: int, group: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q int8 [N, K] holding -128 and 127, float16 scales [N, K/group] of both signs, float64 q * scale)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int16).to(torch.int8)
    q[0, 0], q[-1, -1] = -128, 127
    scales = (torch.rand(n, k // group, generator=gen, dtype=torch.float64) * 0.01 + 1e-4).half()
    scales[0, 0] = -scales[0, 0]
    w = q.double().view(n, k // group, group) * scales.double()[..., None]
    return q.contiguous(), scales.contiguous(), w.view(n, k)


def _x(m: int, k: int, seed: int) -> torch.Tensor:
    """N(0, 1) with outliers x20, exact zeros and tiny (down to denormal) values."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    pick = torch.rand(m, k, generator=gen)
    x = torch.where(pick < 0.02, x * 20, x)
    x = torch.where((pick > 0.1) & (pick < 0.15), torch.zeros(()), x)
    x = torch.where((pick > 0.2) & (pick < 0.22), x * 1e-30, x)
    x = torch.where((pick > 0.3) & (pick < 0.31), x * 1e-39, x)  # denormal
    if k > 32:
        x[0, :32] = 0.0  # an all-zero block
    return x.contiguous()


def _gemm(fn, x: torch.Tensor, q, scales, n: int, group: int, threads: int = 1) -> tuple[int, torch.Tensor]:
    m, k = x.shape
    y = torch.full((m, n), float("nan"))
    rc = fn(x.data_ptr(), m, k, q.data_ptr(), scales.data_ptr(), n, group, y.data_ptr(), threads)
    return rc, y


def _vnni(lib: ctypes.CDLL, *args, **kwargs) -> tuple[int, torch.Tensor]:
    rc, y = _gemm(lib.pagoda_int8_vnni_gemm_f32, *args, **kwargs)
    if rc == 5:
        pytest.skip("the VNNI kernel was built without AVX-512 VNNI (this CPU lacks it)")
    return rc, y


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Elementwise error bound [M, N]: x is rounded to a step e <= 2 max|x| / XLIMIT of its 32-block (error
    <= e / 2 per element), plus float32 rounding of the sums (a few ulps of |x| @ |w|)."""
    m, k = x.shape
    amax = x.double().abs().view(m, k // 32, 32).amax(-1)  # [M, K/32]
    wsum = w.abs().view(w.shape[0], k // 32, 32).sum(-1)  # [N, K/32]
    return amax / XLIMIT @ wsum.t() + 4e-7 * (x.double().abs() @ w.abs().t())


def test_int8_vnni_matches_float64_reference_and_float32_kernel():
    lib = native_library()
    worst = 0.0
    for n in NS:
        for k, group in KG:
            q, scales, w = _weights(n, k, group, seed=n * 1000 + k + group)
            q16 = interleave16_i8(q)
            for m in MS:
                x = _x(m, k, seed=m + k)
                ref = x.double() @ w.t()
                rc, y = _vnni(lib, x, q16, scales, n, group, threads=2 if m == 17 else 1)
                assert rc == 0
                rc, y32 = _gemm(lib.pagoda_int8_gemm_f32, x, q, scales, n, group)
                assert rc == 0
                case = (m, n, k, group)
                err, bound = (y.double() - ref).abs(), _bound(x, w)
                assert (err <= bound).all(), (case, (err / bound).max().item())
                assert ((y - y32).double().abs() <= 2 * bound).all(), case
                if n >= 16:  # max|y| is the output's scale, not one cancelled sum
                    scale = ref.abs().max().item()
                    worst = max(worst, err.max().item() / scale)
                    assert err.max().item() <= 1e-6 * scale, (case, err.max().item() / scale)
                    assert (y - y32).abs().max().item() <= 1e-6 * scale, case
    assert worst > 0  # the comparison saw real rounding, not two identical paths


def test_int8_vnni_extreme_weights_and_x():
    """Rows of all 127 or all -128 against x blocks at their largest |X| (the int32 sums' extremes)."""
    lib = native_library()
    n, k = 20, 96
    q = torch.randint(-128, 128, (n, k), generator=torch.Generator().manual_seed(5), dtype=torch.int16)
    q = q.to(torch.int8)
    q[0], q[1], q[2] = 127, -128, 0
    q[3, 0::2], q[3, 1::2] = 127, -128
    scales = torch.full((n, k // 32), 0.5, dtype=torch.float16)
    w = q.double() * 0.5
    x = torch.tensor([[3.0] * k, [-3.0] * k, [1.0, -1.0] * (k // 2), [1e30] * k, [2.0**-120] * k])
    ref = x.double() @ w.t()
    rc, y = _vnni(lib, x, interleave16_i8(q), scales, n, 32)
    assert rc == 0
    assert ((y.double() - ref).abs() <= _bound(x, w)).all()
    assert (y[:, 2] == 0).all()


def test_int8_vnni_error_codes():
    lib = native_library()
    q, scales, _ = _weights(20, 64, 32, seed=1)
    q16 = interleave16_i8(q)
    x = _x(3, 64, seed=2)
    rc, y = _vnni(lib, x, q16, scales, 20, 32)
    assert rc == 0 and torch.isfinite(y).all()
    fn = lib.pagoda_int8_vnni_gemm_f32
    assert _gemm(fn, x[:, :48].contiguous(), q16, scales, 20, 16)[0] == 1  # k % 32 != 0
    assert _gemm(fn, x, q16, scales, 20, 48)[0] == 1  # group % 32 != 0
    assert _gemm(fn, x[:, :32].contiguous(), q16, scales, 20, 64)[0] == 1  # k % group != 0
    assert _gemm(fn, x, q16, scales, 0, 32)[0] == 1  # n < 1
    assert _gemm(fn, x[:0], q16, scales, 20, 32)[0] == 1  # m < 1
    for bad in (float("inf"), float("-inf"), float("nan")):
        xb = x.clone()
        xb[2, 37] = bad
        assert _gemm(fn, xb, q16, scales, 20, 32)[0] == 6, bad
    q, scales, _ = _weights(20, 576, 32, seed=3)
    x = _x(64, 576, seed=4)  # enough 32-blocks (1152) for the threads to prepare x together
    x[50, 300] = float("nan")
    assert _gemm(fn, x, interleave16_i8(q), scales, 20, 32, threads=2)[0] == 6
