"""INT4 parameter codes: float16 scales and offsets as 12-bit indices into one table, lossless."""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels.int4 import Int4Weight, interleave16, pack_nibbles
from pagoda.kernels.int4_codes import MAX_VALUES, encode_params


def _fp16(bits: list[int] | torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(bits, dtype=torch.int16).view(torch.float16)


def test_codes_round_trip_every_bit_pattern():
    """Decoding gives back the very bit patterns: -0.0 and 0.0 stay apart, subnormals survive."""
    gen = torch.Generator().manual_seed(0)
    scales = (torch.rand(7, 9, generator=gen) * 0.02 + 1e-3).half()
    offsets = (-torch.rand(7, 9, generator=gen) * 0.1).half()
    offsets[0, 0], offsets[0, 1], offsets[1, 0] = 0.0, -0.0, _fp16([1])[0]  # +0, -0, a subnormal
    codes = encode_params(scales, offsets)
    assert codes is not None and codes.codes.dtype == torch.uint8 and codes.codes.shape == (7, 9, 3)
    s, o = codes.decode()
    assert torch.equal(s.view(torch.int16), scales.view(torch.int16))
    assert torch.equal(o.view(torch.int16), offsets.view(torch.int16))
    distinct = len(set(scales.view(torch.int16).flatten().tolist())) + len(
        set(offsets.view(torch.int16).flatten().tolist())
    )
    assert codes.table.numel() == distinct
    assert codes.nbytes == 7 * 9 * 3 + 2 * distinct


def test_codes_hold_up_to_4096_values_then_decline():
    positive = torch.arange(0x0400, 0x0400 + MAX_VALUES, dtype=torch.int32).to(torch.int16)  # normals
    scales = _fp16(positive[: MAX_VALUES - 1]).reshape(1, -1)
    offsets = torch.full_like(scales, -1.0)
    full = encode_params(scales, offsets)  # 4095 scales + 1 offset: every index in use
    assert full is not None and full.table.numel() == MAX_VALUES
    s, o = full.decode()
    assert torch.equal(s, scales) and torch.equal(o, offsets)
    offsets[0, 0] = -2.0  # one value more
    assert encode_params(scales, offsets) is None


@pytest.mark.parametrize(
    ("scales", "offsets", "match"),
    [
        (torch.ones(2, 3), torch.ones(2, 3, dtype=torch.float16), "float16"),
        (torch.ones(2, 3, dtype=torch.float16), torch.ones(2, 4, dtype=torch.float16), r"\[N, groups\]"),
        (torch.ones(6, dtype=torch.float16), torch.ones(6, dtype=torch.float16), r"\[N, groups\]"),
    ],
)
def test_codes_refuse_bad_parameters(scales, offsets, match):
    with pytest.raises(ValueError, match=match):
        encode_params(scales, offsets)


def _q4_1(n: int, k: int, seed: int) -> Int4Weight:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-3).half().float()
    mins = (-torch.rand(n, k // 32, generator=gen) * 0.1).half().float()
    return Int4Weight(n, k, 32, False, pack_nibbles(q), scales, None, mins)


@pytest.fixture(scope="module")
def native():
    from kernel_testing import require_native

    from pagoda.kernels import cpu_int4_native

    require_native()
    return cpu_int4_native


def _wide_q4_1(n: int, k: int, seed: int) -> Int4Weight:
    """2,200 distinct scales and 1,800 distinct mins, each used: indices reach every bit of 12."""
    gen = torch.Generator().manual_seed(seed)
    groups = n * k // 32
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    s_bits = torch.arange(0x1400, 0x1400 + 2200)[torch.arange(groups) % 2200]
    o_bits = torch.arange(0x8400, 0x8400 + 1800)[torch.arange(groups) % 1800]
    perm = torch.randperm(groups, generator=gen)
    scales = _fp16(s_bits[perm]).float().reshape(n, -1)
    mins = _fp16(o_bits[torch.randperm(groups, generator=gen)]).float().reshape(n, -1)
    return Int4Weight(n, k, 32, False, pack_nibbles(q), scales, None, mins)


@pytest.mark.parametrize("m", [1, 3, 8, 9, 16, 17])
def test_native_kernel_reads_codes_as_it_reads_float16(native, m):
    """The same weight with float16 parameters (mode 1) and with codes (mode 2): identical outputs,
    through the register path (m <= 16, rows of W in pairs from 8) and the buffered one (m = 17)."""
    w = _wide_q4_1(37, 2624, seed=m)  # 3,034 groups, odd N
    w.compact_for_native()
    assert w.codes is not None and w.codes.table.numel() == 4000
    s16, o16 = w.codes.decode()
    x = torch.randn(m, 2624, generator=torch.Generator().manual_seed(1))
    via_half = native.native_int4_mm(x, w.packed, s16, o16, 32)
    via_codes = native.native_int4_mm(x, w.packed, w.codes.codes, w.codes.table, 32, mode=2)
    assert torch.equal(via_half, via_codes)
    if native.vnni_available():  # the VNNI kernel decodes the same codes
        p16 = interleave16(w.packed)
        vnni_half = native.native_int4_mm(x, p16, s16, o16, 32, interleaved=True)
        vnni_codes = native.native_int4_mm(x, p16, w.codes.codes, w.codes.table, 32, mode=2, interleaved=True)
        assert torch.equal(vnni_half, vnni_codes)
        torch.testing.assert_close(vnni_codes, via_half, rtol=0, atol=2e-6 * float(via_half.abs().max()))


def test_native_kernel_refuses_malformed_codes(native):
    w = _q4_1(16, 64, seed=0)
    w.compact_for_native()
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="codes must be uint8"):
        native.native_int4_mm(x, w.packed, w.codes.codes[:, :1], w.codes.table, 32, mode=2)
    with pytest.raises(ValueError, match="code table"):
        native.native_int4_mm(x, w.packed, w.codes.codes, w.codes.table.float(), 32, mode=2)
    with pytest.raises(ValueError, match="does not match"):
        s16, o16 = w.codes.decode()
        native.native_int4_mm(x, w.packed, s16, o16, 32, mode=0)


def test_resident_bytes_are_predicted_before_compaction():
    """The memory estimate (resident_nbytes, read before weights are prepared) is what the weight
    holds once compacted: codes when they fit, float16 otherwise."""
    for n, k in ((37, 128), (64, 4096)):  # (N = 37: the VNNI layout pads to 48 rows where it runs)
        w = _q4_1(n, k, seed=n)
        w.cpu_compute = "float32"
        predicted = w.resident_nbytes("float32")
        w.prepare("cpu")
        assert (w.codes is not None) == (n == 37)
        assert w.nbytes == predicted
