"""The native CPU paged KV write and decode (kernels/cpu_attention.c): writes byte-equal to the torch
paths (FP8 and int8 pages), the e4m3 converter equal to torch's cast and the int8 quantizer to
``quantize_int8``, decode within float32 rounding of the reference, the torch fallback behind
``PAGODA_NATIVE_ATTENTION=0``, and the engine's greedy output unchanged."""

from __future__ import annotations

import ctypes
import math
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from kernel_testing import make_paged_kv, require_native

from pagoda.kernels import cpu_attention_native as native
from pagoda.kernels import paged_attention as pa
from pagoda.kernels.cpu_int4_native import library
from pagoda.kernels.fp8_format import FP8_DTYPE, FP8_MAX
from pagoda.kernels.int8_format import INT8_DTYPE, quantize_int8
from pagoda.kernels.paged_attention import (
    calibrate_kv_scales,
    empty_page_scales,
    paged_decode_attention,
    write_kv,
)


@pytest.fixture(autouse=True)
def needs_native() -> None:
    """Every test here runs the native library: skipped without a C compiler, failed if it broke."""
    require_native()


# per-token K + static V (the default pool), static both, float32, int8 (per-token scales both)
KINDS = ["fp8tok", "fp8", "fp32", "int8"]


@pytest.fixture
def torch_path(monkeypatch):
    """Runs the body with the native path off (``PAGODA_NATIVE_ATTENTION=0``)."""
    monkeypatch.setenv(native.ENV_VAR, "0")


def _pool(kind: str, num_pages: int, page_size: int, hkv: int, d: int, calib: tuple[torch.Tensor, ...]):
    """Empty caches and scales of one kind (static scales calibrated on ``calib`` K and V)."""
    dtype = {"fp32": torch.float32, "int8": INT8_DTYPE}.get(kind, FP8_DTYPE)
    k = torch.zeros(num_pages, page_size, hkv, d, dtype=dtype)
    v = torch.zeros_like(k)
    if kind == "fp32":
        return k, v, None, None
    if kind == "int8":
        return k, v, *(empty_page_scales(num_pages, page_size, hkv, "cpu") for _ in range(2))
    ks, vs = calibrate_kv_scales(*calib)
    if kind == "fp8tok":
        ks = empty_page_scales(num_pages, page_size, hkv, "cpu")
    return k, v, ks, vs


def _raw(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16)


def _hard_values(t: int, h: int, d: int, seed: int) -> torch.Tensor:
    """Random K/V rows with zeros, tiny (e4m3 subnormal) rows, values at and beyond the clamp."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, d, generator=gen) * 3
    x[0] = 0.0  # all-zero token: the scale floor
    x[1, 0] = torch.randn(d, generator=gen) * 1e-3  # subnormal codes under the static scales
    x[1, 1] = torch.randn(d, generator=gen) * 1e-20  # below the scale floor under per-token scales
    x[2, :, : d // 2] = 448.0 * 0.02  # at the clamp of a 0.02 static scale
    x[2, :, d // 2 :] = -1e4  # far beyond it
    x[3] = -0.0
    x[4, 0, 0] = 7.0 * 2**-9 * 0.02 * 0.5  # halfway cases under a 0.02 scale
    x[6, 0, 0] = 448.0 * (1 + 2**-8)  # amax / 448 halfway between two bfloat16: rounds to even
    x[6, 1, 0] = -448.0 * (1 + 3 * 2**-8)
    return x


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("d", [64, 20])
def test_write_is_byte_equal_to_torch_and_reference(kind, d, monkeypatch):
    hkv, ps, pages, t = 3, 4, 12, 24
    k, v = _hard_values(t, hkv, d, 1), _hard_values(t, hkv, d, 2)
    k = torch.cat([k, k], dim=2)[:, :, :d]  # non-contiguous token rows (stride 2 * d)
    slots = torch.randperm(pages * ps, generator=torch.Generator().manual_seed(3))[:t]
    slots[[5, 9, 17]] = -1  # padding
    calib = (torch.full((1, hkv, 1), 448.0 * 0.02), torch.full((1, hkv, 1), 448.0 * 0.02))
    results = []
    for path in ("native", "cpu", "reference"):
        monkeypatch.setenv(native.ENV_VAR, "0" if path == "cpu" else "1")
        kc, vc, ks, vs = _pool(kind, pages, ps, hkv, d, calib)
        kc.view(torch.uint8).fill_(0x5A)  # untouched slots must keep their bytes
        write_kv(kc, vc, k, v, slots, ks, vs, backend="reference" if path == "reference" else "cpu")
        results.append([_raw(x) for x in (kc, vc, ks, vs)])
    assert native.native_write_kv(kc, vc, k, v, slots, ks, vs)  # the native path serves this pool
    for other in results[1:]:
        for got, want in zip(results[0], other, strict=True):
            assert (got is None) == (want is None)
            if got is not None:
                assert torch.equal(got, want)
    if kind == "fp8":
        codes = results[0][0].view(pages * ps, hkv, d)[slots[2]]
        assert (codes[:, : d // 2] == 0x7E).all() and (codes[:, d // 2 :] == 0xFE).all()  # +-448


def test_write_rejects_a_slot_beyond_the_pool():
    kc, vc, ks, vs = _pool("fp8tok", 2, 4, 1, 16, (torch.ones(1, 1, 1), torch.ones(1, 1, 1)))
    x = torch.randn(2, 1, 16)
    with pytest.raises(ValueError, match="slot 8 but the KV pool has 8 slots"):
        write_kv(kc, vc, x, x, torch.tensor([0, 8]), ks, vs, backend="cpu")
    assert (kc.view(torch.uint8) == 0).all() and (ks.view(torch.int16) == 0).all()  # nothing written


def _e4m3_sweep() -> torch.Tensor:
    """Every 61st float32 bit pattern within +-448 (and beyond it, to the clamp), every e4m3 value,
    every midpoint between neighbours exactly and one float32 ulp either side."""
    bits = torch.arange(0, 0x7F800001, 61, dtype=torch.int64).to(torch.int32)
    dense = bits.view(torch.float32)
    dense = dense[dense <= 1000.0]
    codes = torch.arange(0, 0x7F, dtype=torch.uint8).view(FP8_DTYPE).float()  # 0 .. 448
    mids = (codes[1:].double() + codes[:-1].double()).div(2).float()
    assert torch.equal(mids.double(), (codes[1:].double() + codes[:-1].double()) / 2)  # exact
    near = torch.cat([torch.nextafter(mids, torch.tensor(-1.0)), torch.nextafter(mids, torch.tensor(1e9))])
    edges = torch.tensor([FP8_MAX, 449.0, 464.0, 480.0, 1e30, float("inf"), 2**-6, 2**-10, 1e-45])
    x = torch.cat([dense, codes, mids, near, edges])
    return torch.cat([x, -x])


@pytest.mark.parametrize("scalar", [False, True], ids=["vector", "scalar"])
def test_e4m3_converter_matches_torch_cast(scalar):
    x = _e4m3_sweep()
    want = x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(torch.uint8)
    got = native.f32_to_e4m3_bits(x, scalar=scalar)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} of {x.numel()} differ, e.g. {x[bad[:4]].tolist()}"


def _int8_sweep() -> torch.Tensor:
    """Every 997th float32 bit pattern up to 300 (0.37 * 300 > 127: the clamp), every tie k + 0.5 up
    to 130.5 and one float32 ulp either side (times 0.37: x / s is then near a tie), NaN, inf, huge
    values, denormals and -0.0."""
    dense = torch.arange(0, 0x7F800001, 997, dtype=torch.int64).to(torch.int32).view(torch.float32)
    dense = dense[dense <= 300.0]
    ties = torch.arange(0, 131, dtype=torch.float32) + 0.5
    near = torch.cat([torch.nextafter(ties, torch.tensor(-1.0)), torch.nextafter(ties, torch.tensor(1e9))])
    edges = torch.tensor([127.0, 127.5, 128.0, 1e30, float("inf"), float("nan"), 1e-45, 1e-40, -0.0])
    x = torch.cat([dense, ties * 0.37, near * 0.37, ties, edges])
    return torch.cat([x, -x])


@pytest.mark.parametrize("scale", [0.37, 1.0, 2.0**-20])
@pytest.mark.parametrize("scalar", [False, True], ids=["vector", "scalar"])
def test_int8_quantizer_matches_torch(scalar, scale):
    """round(x / s) half to even, clamped to +-127, NaN -> 0: equal to ``quantize_int8``."""
    x = _int8_sweep()
    want = quantize_int8(x, torch.tensor(scale))
    got = native.f32_to_int8(x, scale, scalar=scalar)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} of {x.numel()} differ, e.g. {x[bad[:4]].tolist()}"


def _int8_edge_rows(d: int) -> torch.Tensor:
    """K/V rows [8, 2, d] at the int8 format's edges (row, head): zeros (0, 0) and -0.0 (0, 1);
    ties k + 0.5 under a scale of 1 (1, 0) and of 0.5 (1, 1); an amax whose scale is a bfloat16 tie
    rounding down (2, 0) or up (2, 1); NaN (3, 0) and inf (3, 1); denormals alone (4, 0) and in a row
    at the scale floor (4, 1); random values after."""
    gen = torch.Generator().manual_seed(d)
    x = torch.randn(8, 2, d, generator=gen) * 3
    x[0, 0], x[0, 1] = 0.0, -0.0
    ties = torch.randint(-127, 127, (2, d), generator=gen).float() + 0.5
    x[1, 0], x[1, 1] = ties[0], ties[1] * 0.5
    x[1, 0, 0], x[1, 1, 0] = 127.0, -63.5  # scales exactly 1 and 0.5
    x[2] = torch.rand(2, d, generator=gen) * 100 - 50
    x[2, 0, 1], x[2, 1, 2] = 127.0 * (1 + 2**-8), -127.0 * (1 + 3 * 2**-8)
    x[3, 0, d // 2], x[3, 1, 1] = float("nan"), float("inf")
    x[4, 0] = 1e-40
    x[4, 1] = torch.randn(d, generator=gen) * 1e-12
    x[4, 1, ::3] = -1e-41
    return x


@pytest.mark.parametrize("d", [16, 40])
def test_int8_write_edges_are_byte_equal_to_reference(d, monkeypatch):
    """Native, vectorized torch and reference writes give the same bytes on the edge rows."""
    pages, ps = 6, 4
    k, v = _int8_edge_rows(d), _int8_edge_rows(d).flip(0)
    slots = torch.tensor([9, 2, 23, 14, 17, 0, -5, 12])  # row i of K at slots[i]; -5: padding
    results = []
    for path in ("native", "cpu", "reference"):
        monkeypatch.setenv(native.ENV_VAR, "0" if path == "cpu" else "1")
        kc, vc, ks, vs = _pool("int8", pages, ps, 2, d, ())
        kc.view(torch.uint8).fill_(0x5A)  # untouched slots must keep their bytes
        write_kv(kc, vc, k, v, slots, ks, vs, backend="reference" if path == "reference" else "cpu")
        results.append([_raw(x) for x in (kc, vc, ks, vs)])
    assert native.native_write_kv(kc, vc, k, v, slots, ks, vs)
    for other in results[1:]:
        for got, want in zip(results[0], other, strict=True):
            assert torch.equal(got, want)
    codes, scales = kc.view(-1, 2, d), ks.view(-1, 2)
    floor = torch.tensor(1e-12).bfloat16()
    assert (codes[9] == 0).all() and (scales[9] == floor).all()  # zero rows: the floor
    assert scales[2].tolist() == [1.0, 0.5]  # ties k + 0.5 round half to even
    assert torch.equal(codes[2, 0].float(), k[1, 0].round()) and torch.equal(
        codes[2, 1].float(), k[1, 1].mul(2).round()
    )
    assert scales[23].tolist() == [1.0, 1.0 + 2**-6]  # amax / 127 a bfloat16 tie: to even
    assert scales[14, 0].isnan() and scales[14, 1] == float("inf") and (codes[14] == 0).all()  # NaN, inf
    assert (codes[17, 0] == 0).all() and scales[17, 0] == floor  # denormals
    assert (codes.view(torch.uint8)[[1, 3]] == 0x5A).all()  # never written


def _decode_pool(kind: str, lens: list[int], hkv: int, d: int, page_size: int, seed: int):
    """Random K/V for ``lens`` on randomly permuted pages (the reference write), of one kind."""
    pk = make_paged_kv(lens, page_size, hkv, d, torch.float32, seed=seed)
    if kind == "fp32":
        return pk
    calib = (torch.cat(pk.keys), torch.cat(pk.values))
    kc, vc, ks, vs = _pool(kind, pk.k_cache.shape[0], page_size, hkv, d, calib)
    for b, n in enumerate(lens):
        pages = pk.block_tables[b, : math.ceil(n / page_size)].long()
        slots = (pages[:, None] * page_size + torch.arange(page_size)).flatten()[:n]
        write_kv(kc, vc, pk.keys[b], pk.values[b], slots, ks, vs, backend="reference")
    pk.k_cache, pk.v_cache, pk.k_scale, pk.v_scale = kc, vc, ks, vs
    return pk


DECODE_LENS = {
    1: [[37]],
    16: [[0, 1, 16, 17, 5, 64, 31, 2, 48, 9, 0, 33, 15, 50, 3, 20]],
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("bsz", [1, 16])
def test_decode_matches_reference(kind, group, bsz):
    hkv, d, ps = 3, 64, 16
    lens = DECODE_LENS[bsz][0]
    pk = _decode_pool(kind, lens, hkv, d, ps, seed=bsz + group)
    q = torch.randn(bsz, hkv * group, d, generator=torch.Generator().manual_seed(5))
    args = (q, pk.k_cache, pk.v_cache, pk.block_tables, pk.context_lens, d**-0.5, pk.k_scale, pk.v_scale)
    out = native.native_paged_decode(*args)
    assert out is not None
    ref = pa._decode_reference(*args)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    for b, n in enumerate(lens):
        if n == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b]))
    assert torch.equal(paged_decode_attention(*args, backend="cpu"), out)  # the backend runs it


@pytest.mark.parametrize("d", [16, 64, 72])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_int8_decode_matches_reference(group, d):
    """int8 pages on randomly ordered pages: lengths around a page (0, 1, 15, 16, 17) and past
    several; D not a multiple of 16 (72); G of 1, 3 and 4."""
    hkv, lens = 2, [0, 1, 15, 16, 17, 100]
    pk = _decode_pool("int8", lens, hkv, d, 16, seed=group * d)
    q = torch.randn(len(lens), hkv * group, d, generator=torch.Generator().manual_seed(d))
    args = (q, pk.k_cache, pk.v_cache, pk.block_tables, pk.context_lens, d**-0.5, pk.k_scale, pk.v_scale)
    out = native.native_paged_decode(*args)
    assert out is not None
    ref = paged_decode_attention(*args, backend="reference")
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.equal(paged_decode_attention(*args, backend="cpu"), out)


def test_int8_without_page_scales_keeps_the_torch_path():
    """int8 pages with static-like or mistyped scales are not the native path's (None / False)."""
    kc, vc, ks, vs = _pool("int8", 2, 4, 1, 16, ())
    q, slots = torch.randn(1, 1, 16), torch.tensor([0])
    tables, lens = torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    for bad in (torch.ones(1), ks.float(), ks[:1], None):
        assert native.native_paged_decode(q, kc, vc, tables, lens, 0.25, bad, vs) is None
        assert not native.native_write_kv(kc, vc, q, q, slots, ks, bad)
    assert native.native_paged_decode(q, kc, vc, tables, lens, 0.25, ks, vs) is not None


@pytest.mark.parametrize("kind", ["fp8tok", "fp32"])
@pytest.mark.parametrize("d,group", [(24, 2), (80, 5)])
def test_decode_odd_head_dim_and_bf16_queries(kind, d, group):
    """D not a multiple of 16 (the vector loops' tails) or above 64, G above 4 (two head blocks)."""
    lens = [7, 0, 12, 1]
    pk = _decode_pool(kind, lens, 2, d, 4, seed=11)
    q = torch.randn(4, 2 * group, d).bfloat16()
    args = (q, pk.k_cache, pk.v_cache, pk.block_tables, pk.context_lens, 0.2, pk.k_scale, pk.v_scale)
    out = paged_decode_attention(*args, backend="cpu")
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), pa._decode_reference(*args).float(), rtol=1e-2, atol=1e-2)
    out = native.native_paged_decode(q.float(), *args[1:])
    ref = pa._decode_reference(q.float(), *args[1:])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def test_decode_rejects_pages_outside_the_pool_or_table():
    pk = _decode_pool("fp8tok", [5, 9], 1, 16, 4, seed=2)
    args = (pk.k_cache, pk.v_cache)
    q = torch.randn(2, 1, 16)
    tables = pk.block_tables.clone()
    tables[1, 2] = pk.k_cache.shape[0]  # the third page of a 9-token sequence
    with pytest.raises(ValueError, match="sequence 1: context length 9"):
        paged_decode_attention(q, *args, tables, pk.context_lens, 0.3, pk.k_scale, pk.v_scale, "cpu")
    lens = torch.tensor([5, 4 * tables.shape[1] + 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="outside the table"):
        paged_decode_attention(q, *args, pk.block_tables, lens, 0.3, pk.k_scale, pk.v_scale, "cpu")
    tables = pk.block_tables.clone()
    tables[1, 3:] = -1  # columns past the used pages are never read
    out = paged_decode_attention(q, *args, tables, pk.context_lens, 0.3, pk.k_scale, pk.v_scale, "cpu")
    assert torch.isfinite(out).all()


def test_env_var_runs_the_torch_path(torch_path, monkeypatch):
    pk = _decode_pool("fp8tok", [20, 3, 0], 3, 64, 16, seed=4)
    calls = []
    real = pa._decode_vectorized
    monkeypatch.setattr(pa, "_decode_vectorized", lambda *a: calls.append(1) or real(*a))
    q = torch.randn(3, 9, 64)
    args = (q, pk.k_cache, pk.v_cache, pk.block_tables, pk.context_lens, 0.125, pk.k_scale, pk.v_scale)
    out = paged_decode_attention(*args, backend="cpu")
    assert calls == [1]
    assert native.native_paged_decode(*args) is None
    torch.testing.assert_close(out, pa._decode_reference(*args), rtol=1e-5, atol=1e-5)


def test_bf16_pages_keep_the_torch_path():
    pk = make_paged_kv([6, 2], 4, 1, 16, torch.bfloat16)
    q = torch.randn(2, 2, 16)
    args = (q, pk.k_cache, pk.v_cache, pk.block_tables, pk.context_lens, 0.3, None, None)
    assert native.native_paged_decode(*args) is None
    assert not native.native_write_kv(
        pk.k_cache, pk.v_cache, q[:, :1], q[:, :1], torch.tensor([0, 1]), None, None
    )


def _has_avx512f() -> bool:
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.exists() and " avx512f" in cpuinfo.read_text()


BUILDS = {  # other CPUs' builds of the file: no AVX-512 at all; AVX-512F without BW/VL (no fast decode)
    "scalar": [],
    "avx512f": pytest.param(
        ["-mavx512f"], marks=pytest.mark.skipif(not _has_avx512f(), reason="no AVX-512F")
    ),
}


@pytest.fixture(scope="module")
def other_builds(tmp_path_factory) -> dict[tuple[str, ...], ctypes.CDLL]:
    """cpu_attention.c compiled with other flags, once per flag set."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed")
    built: dict[tuple[str, ...], ctypes.CDLL] = {}
    src = pa.__file__.replace("paged_attention.py", "cpu_attention.c")
    base = ["-O2", "-fopenmp", "-fPIC", "-shared", "-ffp-contract=off"]

    def build(extra: list[str]) -> ctypes.CDLL:
        if tuple(extra) not in built:
            so = tmp_path_factory.mktemp("build") / "attention.so"
            cmd = ["gcc", *base, *extra, src, "-o", str(so)]
            subprocess.run(cmd, check=True, capture_output=True, timeout=120)
            built[tuple(extra)] = ctypes.CDLL(str(so))
        return built[tuple(extra)]

    return build


@pytest.mark.parametrize("flags", list(BUILDS.values()), ids=list(BUILDS))
@pytest.mark.parametrize("kind", ["fp8tok", "int8"])
def test_other_builds_match_the_native_one(kind, flags, other_builds, monkeypatch):
    """The file without AVX-512, or with AVX-512F only (the fallbacks other CPUs compile: the scalar
    converters, the row-by-row decode_pair), gives the same bytes and scores."""
    pk = _decode_pool(kind, [33, 1, 0, 18], 3, 24, 16, seed=6)
    q = torch.randn(4, 9, 24)
    args = (q, pk.k_cache, pk.v_cache, pk.block_tables, pk.context_lens, 0.2, pk.k_scale, pk.v_scale)
    x = _e4m3_sweep()[::7] if kind == "fp8tok" else _int8_sweep()[::7]
    k, slots = _hard_values(8, 3, 24, 9), torch.arange(8) * 3
    k[5, 2, 3] = float("nan")
    outs = []
    for lib in (library(), other_builds(flags)):
        monkeypatch.setattr(native, "library", lambda lib=lib: lib)
        kc, vc, ks, vs = _pool(kind, 4, 16, 3, 24, (k, k))
        assert native.native_write_kv(kc, vc, k, k, slots, ks, vs)
        conv = native.f32_to_e4m3_bits(x) if kind == "fp8tok" else native.f32_to_int8(x, 0.37)
        outs.append((conv, _raw(kc), _raw(ks), native.native_paged_decode(*args)))
    (bits, kc, ks, out), (bits_s, kc_s, ks_s, out_s) = outs
    assert torch.equal(bits, bits_s) and torch.equal(kc, kc_s) and torch.equal(ks, ks_s)
    torch.testing.assert_close(out_s, out, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    "decode_kv,dtype", [("fp8_e4m3", FP8_DTYPE), ("int8", INT8_DTYPE)], ids=["fp8", "int8"]
)
def test_engine_greedy_output_is_unchanged(make_engine, monkeypatch, decode_kv, dtype):
    """FP8 (per-token K) or int8 pages in decode: the same tokens with the native path on and off.
    The whole-layer native decode (``PAGODA_NATIVE_DECODE``), where present, would run decode
    attention itself: it is off here so that these kernels serve the decode steps."""
    from pagoda.node_agent.engine.config import PhaseFormats
    from pagoda.node_agent.params import SamplingParams

    monkeypatch.setenv("PAGODA_NATIVE_DECODE", "0")
    served = []
    real = pa.native_paged_decode

    def spy(*args):
        out = real(*args)
        served.append(out is not None and args[1].dtype == dtype)
        return out

    monkeypatch.setattr(pa, "native_paged_decode", spy)
    engine = make_engine(formats=PhaseFormats(decode_kv=decode_kv), enable_prefix_caching=False)
    prompts = ["The quick brown fox", "In 1969, the first humans landed on", "def add(a, b):\n    "]
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=2)
    runs, steps = [], []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: a busy 2-core machine stalls every 2-thread op of the torch path
    try:
        for flag in ("0", "1"):
            monkeypatch.setenv(native.ENV_VAR, flag)
            served.clear()
            rids = [engine.add_request(p, params) for p in prompts]
            entries: dict[str, list[dict]] = {r: [] for r in rids}
            final = engine.run_until_done(lambda o, e=entries: e[o.request_id].extend(o.logprobs or []))
            runs.append([final[r].token_ids for r in rids])
            steps.append([entries[r] for r in rids])
    finally:
        torch.set_num_threads(threads)
    assert served and all(served)  # the native decode ran every decode step over the 1-byte pool
    assert all(len(t) == 16 for t in runs[1])
    assert all(len(e) == 16 for run in steps for e in run)  # a logprob entry for every sampled token
    same = 0
    for ref, nat, ref_steps in zip(*runs, steps[0], strict=True):
        split = next((i for i, (a, b) in enumerate(zip(ref, nat, strict=True)) if a != b), None)
        if split is None:
            same += 1
            continue
        # the paths sum in different orders, so a greedy near-tie may fall the other way; nothing else may
        top = ref_steps[split]["top_logprobs"]
        assert len(top) == 2 and top[0]["logprob"] - top[1]["logprob"] < 0.05, (split, top)
        assert engine.tokenizer.token_text(nat[split]) == top[1]["token"], (split, top, nat[split])
    assert same >= 2, runs
