"""The AVX-512 VNNI INT4 GEMM (kernels/cpu_int4_vnni.c) against a float64 reference of the dequantized
weights and against the float32 kernel on the canonical layout, for every parameter mode."""

from __future__ import annotations

import ctypes

import pytest
import torch
from kernel_testing import native_library, one_torch_thread  # noqa: F401 (a fixture)

from pagoda.kernels.int4_codes import encode_params
from pagoda.kernels.vnni_layout import interleave16

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MS = (1, 2, 7, 8, 9, 16, 17, 64)
NS = (37, 1, 16, 50)
KG = ((32, 32), (96, 32), (576, 32), (576, 64), (128, 64))


def _weights(n: int, k: int, group: int, mode: int, seed: int):
    """(packed, scales argument, offsets argument, dequantized float64 [N, K]) for parameter `mode`."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()
    shape = (n, k // group)
    if mode == 2:  # few distinct float16 values, as real weights have
        scales = (torch.randint(1, 9, shape, generator=gen).double() * 1e-3).half()
        offsets = (-8 * scales.double() * (1 + 0.05 * torch.randint(-3, 4, shape, generator=gen))).half()
    else:
        scales = torch.rand(shape, generator=gen, dtype=torch.float64) * 0.01 + 1e-3
        offsets = -8 * scales * (1 + 0.05 * torch.randn(shape, generator=gen, dtype=torch.float64))
        scales, offsets = (scales.float(), offsets.float()) if mode == 0 else (scales.half(), offsets.half())
    w = q.double().view(n, k // group, group) * scales.double()[..., None] + offsets.double()[..., None]
    if mode == 2:
        codes = encode_params(scales, offsets)
        assert codes is not None
        scales, offsets = codes.codes, codes.table
    return packed, scales.contiguous(), offsets.contiguous(), w.view(n, k)


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


def _gemm(fn, x: torch.Tensor, packed, scales, offsets, mode: int, n: int, group: int, threads: int = 1):
    m, k = x.shape
    y = torch.full((m, n), float("nan"))
    rc = fn(
        x.data_ptr(), m, k, packed.data_ptr(), scales.data_ptr(), offsets.data_ptr(), mode, n, group,
        y.data_ptr(), threads,
    )  # fmt: skip
    return rc, y


def _vnni(lib: ctypes.CDLL, *args, **kwargs):
    rc, y = _gemm(lib.pagoda_int4_vnni_gemm_f32, *args, **kwargs)
    if rc == 5:
        pytest.skip("the VNNI kernel was built without AVX-512 VNNI (this CPU lacks it)")
    return rc, y


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Elementwise error bound [M, N]: x is rounded to a step e <= 2^-21.98 max|x| of its 32-block (error
    <= e / 2 per element), plus float32 rounding of the sums (a few ulps of |x| @ |w|)."""
    m, k = x.shape
    amax = x.double().abs().view(m, k // 32, 32).amax(-1)  # [M, K/32]
    wsum = w.abs().view(w.shape[0], k // 32, 32).sum(-1)  # [N, K/32]
    return amax * (2 / 8323072 / 2) @ wsum.t() + 4e-7 * (x.double().abs() @ w.abs().t())


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_vnni_matches_float64_reference_and_float32_kernel(mode):
    lib = native_library()
    worst = 0.0
    for n in NS:
        for k, group in KG:
            packed, scales, offsets, w = _weights(n, k, group, mode, seed=n * 1000 + k + group)
            packed16 = interleave16(packed)
            for m in MS:
                x = _x(m, k, seed=m + k)
                ref = x.double() @ w.t()
                rc, y = _vnni(lib, x, packed16, scales, offsets, mode, n, group, threads=2 if m == 17 else 1)
                assert rc == 0
                rc, y32 = _gemm(lib.pagoda_int4_gemm_f32, x, packed, scales, offsets, mode, n, group)
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


def test_vnni_error_codes():
    lib = native_library()
    packed, scales, offsets, _ = _weights(20, 64, 32, 0, seed=1)
    packed16 = interleave16(packed)
    x = _x(3, 64, seed=2)
    rc, y = _vnni(lib, x, packed16, scales, offsets, 0, 20, 32)
    assert rc == 0 and torch.isfinite(y).all()
    rc, _ = _gemm(lib.pagoda_int4_vnni_gemm_f32, x[:, :48].contiguous(), packed16, scales, offsets, 0, 20, 16)
    assert rc == 1  # k % 32 != 0
    rc, _ = _gemm(lib.pagoda_int4_vnni_gemm_f32, x, packed16, scales, offsets, 0, 20, 48)
    assert rc == 1  # group % 32 != 0
    rc, _ = _gemm(lib.pagoda_int4_vnni_gemm_f32, x, packed16, scales, offsets, 7, 20, 32)
    assert rc == 4
    for bad in (float("inf"), float("-inf"), float("nan")):
        xb = x.clone()
        xb[2, 37] = bad
        rc, _ = _gemm(lib.pagoda_int4_vnni_gemm_f32, xb, packed16, scales, offsets, 0, 20, 32)
        assert rc == 6, bad
    packed, scales, offsets, _ = _weights(20, 576, 32, 0, seed=3)
    x = _x(64, 576, seed=4)  # enough 32-blocks (1152) for the threads to prepare x together
    x[50, 300] = float("nan")
    rc, _ = _gemm(
        lib.pagoda_int4_vnni_gemm_f32, x, interleave16(packed), scales, offsets, 0, 20, 32, threads=2
    )
    assert rc == 6
