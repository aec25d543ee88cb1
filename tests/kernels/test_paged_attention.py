import math

import pytest
import torch
from kernel_testing import ALL_BACKENDS, DEVICE, KV_DTYPES, make_paged_kv, needs_triton

from pagoda.kernels.fp8_format import FP8_DTYPE, FP8_MAX, TOKEN_SCALE_DTYPE, token_scales
from pagoda.kernels.paged_attention import (
    calibrate_kv_scales,
    calibrate_tensor_scales,
    convert_component_pages,
    convert_pages,
    empty_page_scales,
    paged_decode_attention,
    paged_prefill_attention,
    write_kv,
)

# Tolerances against the reference (both dequantize identically; only op order differs):
# fp32 queries -> 2e-5; bf16 queries -> outputs rounded to bf16 (8 bits): 2e-2 absolute.
TOL = {torch.float32: dict(rtol=1e-4, atol=2e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


def paged_kv(lens, page_size, hkv, d, kv: str, seed: int = 0):
    """``make_paged_kv`` for every KV kind: "fp8tok" has per-token K page scales (V static per
    head, the engine's default), "fp8tok2" per-token scales for both (converted from fp32 pages by
    the reference path, so the pages hold the same tokens as the other kinds), "int8" int8 K and V
    with per-token page scales (converted likewise)."""
    if kv not in ("fp8tok", "fp8tok2", "int8"):
        return make_paged_kv(lens, page_size, hkv, d, KV_DTYPES[kv], seed=seed)
    pk = make_paged_kv(lens, page_size, hkv, d, torch.float32, seed=seed)
    pages = torch.arange(pk.k_cache.shape[0])
    ks = empty_page_scales(len(pages), page_size, hkv, "cpu")
    vs = empty_page_scales(len(pages), page_size, hkv, "cpu") if kv != "fp8tok" else None
    if vs is None:
        vs = calibrate_kv_scales(torch.cat(pk.keys), torch.cat(pk.values))[1]
    dt = torch.int8 if kv == "int8" else FP8_DTYPE
    k8, v8 = (torch.zeros(pk.k_cache.shape, dtype=dt) for _ in range(2))
    for src, dst, sc in ((pk.k_cache, k8, ks), (pk.v_cache, v8, vs)):
        convert_component_pages(src.cpu(), dst, pages, pages, sc, backend="reference")
    pk.k_cache, pk.v_cache, pk.k_scale, pk.v_scale = (
        k8.to(DEVICE),
        v8.to(DEVICE),
        ks.to(DEVICE),
        vs.to(DEVICE),
    )
    return pk


KV_KINDS = ["fp32", "bf16", "fp8", "fp8tok", "int8", "fp8tok2"]


def full_softmax_attention(q, keys, values, scale):
    """Dense attention of one query [Hq, D] over float K/V [L, Hkv, D] (independent of the pool)."""
    g = q.shape[0] // keys.shape[1]
    k = keys.repeat_interleave(g, 1)
    v = values.repeat_interleave(g, 1)
    p = torch.einsum("hd,lhd->hl", q.float(), k).mul(scale).softmax(-1)
    return torch.einsum("hl,lhd->hd", p, v)


DECODE_CASES = [
    # context lens (page size 4)        Hq, Hkv
    ([1], 2, 2),  # batch 1, one token, MHA
    ([4, 5, 1], 6, 2),  # page boundary, partial last page, 1 token; GQA 3
    ([9, 3, 16, 1, 7, 12, 2], 8, 2),  # batch 7; GQA 4
]


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("kv", KV_KINDS)
@pytest.mark.parametrize("lens,hq,hkv", DECODE_CASES)
def test_decode_matches_reference(backend, kv, lens, hq, hkv):
    d, ps = 16, 4
    pk = paged_kv(lens, ps, hkv, d, kv, seed=len(lens) + hq)
    q = torch.randn(len(lens), hq, d, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    scale = 1 / math.sqrt(d)
    args = (pk.k_cache, pk.v_cache, pk.block_tables, pk.context_lens, scale, pk.k_scale, pk.v_scale)
    ref = paged_decode_attention(q, *args, backend="reference")
    out = paged_decode_attention(q, *args, backend=backend)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.cpu(), ref.cpu(), **TOL[torch.float32])


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_decode_bf16_queries(backend):
    pk = make_paged_kv([5, 8, 1], 4, 2, 16, torch.bfloat16, seed=3)
    q = torch.randn(3, 4, 16).bfloat16().to(DEVICE)
    args = (pk.k_cache, pk.v_cache, pk.block_tables, pk.context_lens, 0.25)
    ref = paged_decode_attention(q, *args, backend="reference")
    out = paged_decode_attention(q, *args, backend=backend)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float().cpu(), ref.float().cpu(), **TOL[torch.bfloat16])


def test_reference_decode_matches_dense_attention():
    lens = [6, 1, 9]
    pk = make_paged_kv(lens, 4, 2, 8, torch.float32, seed=7)
    q = torch.randn(3, 4, 8)
    out = paged_decode_attention(
        q, pk.k_cache, pk.v_cache, pk.block_tables, pk.context_lens, 0.3, backend="reference"
    )
    for b in range(3):
        want = full_softmax_attention(q[b], pk.keys[b], pk.values[b], 0.3)
        torch.testing.assert_close(out[b], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_decode_empty_sequence_gives_zeros(backend):
    pk = make_paged_kv([3, 1], 4, 1, 8, torch.float32)
    lens = pk.context_lens.clone()
    lens[1] = 0
    q = torch.randn(2, 2, 8).to(DEVICE)
    out = paged_decode_attention(q, pk.k_cache, pk.v_cache, pk.block_tables, lens, 0.3, backend=backend)
    assert torch.equal(out[1].cpu(), torch.zeros(2, 8))
    assert torch.isfinite(out).all()


def test_fp8_cache_close_to_fp32_cache():
    lens = [40, 17, 64]
    p32 = make_paged_kv(lens, 16, 2, 32, torch.float32, seed=11)
    p8 = make_paged_kv(lens, 16, 2, 32, FP8_DTYPE, seed=11)
    q = torch.randn(3, 4, 32)
    o32 = paged_decode_attention(q, p32.k_cache, p32.v_cache, p32.block_tables, p32.context_lens, 0.2)
    o8 = paged_decode_attention(
        q, p8.k_cache, p8.v_cache, p8.block_tables, p8.context_lens, 0.2, p8.k_scale, p8.v_scale
    )
    # e4m3 per-head static scales: K and V each carry ~2-3% relative rounding error.
    assert ((o8 - o32).norm() / o32.norm()).item() < 0.06


PREFILL_CASES = [
    # (context len incl. chunk, query len) per sequence
    [(1, 1)],  # one token, no prefix
    [(9, 9), (5, 2), (8, 1)],  # plain prefill; cached prefix; chunk ending on a page boundary
    [(12, 3), (4, 4), (13, 13), (7, 5), (1, 1), (16, 6), (3, 1)],  # batch 7
]


# Per-token V scales (not an engine granularity: V stays static) run on one GQA shape only.
PREFILL_KV_SHAPES = [
    *((kv, hq, hkv) for kv in KV_KINDS[:-1] for hq, hkv in [(2, 2), (6, 2), (8, 2)]),
    ("fp8tok2", 6, 2),
]


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("cases", PREFILL_CASES)
@pytest.mark.parametrize("kv,hq,hkv", PREFILL_KV_SHAPES)
def test_prefill_matches_reference(backend, kv, cases, hq, hkv):
    d, ps = 16, 4
    lens = [c for c, _ in cases]
    pk = paged_kv(lens, ps, hkv, d, kv, seed=hq)
    q_lens = [n for _, n in cases]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), hq, d, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    args = (pk.k_cache, pk.v_cache, pk.block_tables, cu.to(DEVICE), pk.context_lens, 0.25)
    ref = paged_prefill_attention(q, *args, pk.k_scale, pk.v_scale, backend="reference")
    out = paged_prefill_attention(q, *args, pk.k_scale, pk.v_scale, backend=backend)
    torch.testing.assert_close(out.cpu(), ref.cpu(), **TOL[torch.float32])
    # The last query of each sequence sees everything: it must equal decode at that position.
    last = cu[1:] - 1
    dec = paged_decode_attention(
        q[last.long()], pk.k_cache, pk.v_cache, pk.block_tables, pk.context_lens, 0.25, pk.k_scale, pk.v_scale
    )
    torch.testing.assert_close(out[last.long()].cpu(), dec.cpu(), **TOL[torch.float32])


def test_prefill_query_positions_are_causal():
    """Query i of a chunk equals decode over the first (prefix + i + 1) tokens."""
    pk = make_paged_kv([11], 4, 1, 8, torch.float32, seed=5)
    q = torch.randn(4, 3, 8)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    out = paged_prefill_attention(q, pk.k_cache, pk.v_cache, pk.block_tables, cu, pk.context_lens, 0.4)
    for i in range(4):
        want = full_softmax_attention(q[i], pk.keys[0][: 7 + i + 1], pk.values[0][: 7 + i + 1], 0.4)
        torch.testing.assert_close(out[i], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("kv", ["fp32", "bf16", "fp8"])
def test_write_kv_matches_reference(backend, kv):
    dtype = KV_DTYPES[kv]
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(7, 2, 8, generator=gen)
    v = torch.randn(7, 2, 8, generator=gen)
    ks, vs = calibrate_kv_scales(k, v) if dtype == FP8_DTYPE else (None, None)
    slots = torch.tensor([0, 5, 6, 7, 8, 15, -1])  # page boundary 7|8, a padding slot (-1)
    caches = []
    for be in ("reference", backend):
        kc, vc = torch.zeros(4, 4, 2, 8, dtype=dtype), torch.zeros(4, 4, 2, 8, dtype=dtype)
        write_kv(kc, vc, k, v, slots, ks, vs, backend=be)
        caches.append((raw(kc), raw(vc)))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    kc = caches[1][0].view(dtype) if dtype == FP8_DTYPE else caches[1][0]
    got = kc.reshape(16, 2, 8)[slots[:6]].float()
    want = k[:6].float() if dtype != FP8_DTYPE else k[:6] / ks[:, None]
    torch.testing.assert_close(got, want.to(dtype).float())


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_convert_bf16_to_fp8_equals_direct_fp8_write(backend):
    gen = torch.Generator().manual_seed(4)
    k = torch.randn(10, 3, 8, generator=gen).bfloat16()
    v = (torch.randn(10, 3, 8, generator=gen) * 3).bfloat16()
    ks, vs = calibrate_kv_scales(k.float(), v.float(), headroom=1.1)
    slots = torch.arange(10) + 4  # pages 1..3 of 4 slots, last page partial
    bk, bv = torch.zeros(5, 4, 3, 8, dtype=torch.bfloat16), torch.zeros(5, 4, 3, 8, dtype=torch.bfloat16)
    write_kv(bk, bv, k, v, slots)
    direct_k, direct_v = (torch.zeros(6, 4, 3, 8, dtype=FP8_DTYPE) for _ in range(2))
    write_kv(direct_k, direct_v, k, v, slots + 4 * 2, ks, vs)  # the same tokens on pages 3..5
    conv_k, conv_v = (torch.zeros(6, 4, 3, 8, dtype=FP8_DTYPE) for _ in range(2))
    src, dst = torch.tensor([1, 2, 3]), torch.tensor([3, 4, 5])
    convert_pages(bk, bv, conv_k, conv_v, src, dst, ks, vs, backend=backend)
    assert torch.equal(raw(conv_k), raw(direct_k)) and torch.equal(raw(conv_v), raw(direct_v))
    # And back: fp8 -> bf16 dequantizes with the source scales.
    back_k, back_v = torch.zeros_like(bk), torch.zeros_like(bv)
    convert_pages(conv_k, conv_v, back_k, back_v, dst, src, src_k_scale=ks, src_v_scale=vs, backend=backend)
    torch.testing.assert_close(back_k[1:4].float(), (conv_k[3:6].float() * ks[:, None]).bfloat16().float())
    # Same-dtype copies are exact.
    copy_k, copy_v = torch.zeros_like(bk), torch.zeros_like(bv)
    convert_pages(bk, bv, copy_k, copy_v, src, src, backend=backend)
    assert torch.equal(copy_k, bk) and torch.equal(copy_v, bv)


def test_convert_rejects_mismatched_pools():
    a = torch.zeros(2, 4, 2, 8)
    b = torch.zeros(2, 8, 2, 8)
    with pytest.raises(ValueError, match="page_size"):
        convert_pages(a, a, b, b, torch.tensor([0]), torch.tensor([0]))
    with pytest.raises(ValueError, match="scale"):
        convert_pages(a, a, a.to(FP8_DTYPE), a.to(FP8_DTYPE), torch.tensor([0]), torch.tensor([0]))


def test_calibrate_kv_scales():
    k = torch.zeros(5, 3, 4)
    k[2, 1, 3] = -896.0
    v = torch.ones(5, 3, 4)
    ks, vs = calibrate_kv_scales(k, v, headroom=1.5)
    assert ks.shape == (3,) and vs.shape == (3,)
    assert ks[1] == pytest.approx(896 * 1.5 / FP8_MAX)
    assert ks[0] > 0 and torch.isfinite(ks).all()  # all-zero head keeps a finite floor
    torch.testing.assert_close(vs, torch.full((3,), 1.5 / FP8_MAX))
    with pytest.raises(ValueError):
        calibrate_kv_scales(k, v, headroom=0)


@needs_triton
@pytest.mark.parametrize("kv", ["fp8", "fp8tok", "int8"])
@pytest.mark.parametrize("splits", [1, 2, 3, 5])
def test_triton_decode_context_splits(splits, kv):
    """Every split count merges to the same result (including splits with no pages)."""
    from pagoda.kernels.triton_attention import paged_decode_attention_triton

    pk = paged_kv([17, 1, 9], 4, 2, 16, kv, seed=9)
    q = torch.randn(3, 6, 16).to(DEVICE)
    args = (pk.k_cache, pk.v_cache, pk.block_tables, pk.context_lens, 0.25, pk.k_scale, pk.v_scale)
    ref = paged_decode_attention(q, *args, backend="reference")
    out = paged_decode_attention_triton(q, *args, num_splits=splits)
    torch.testing.assert_close(out.cpu(), ref.cpu(), **TOL[torch.float32])


@needs_triton
def test_triton_attention_rejects_unsupported_kv_kinds():
    """int8 pages pair only with int8 pages and always need per-token page scales (checked
    before any launch, also for an empty batch)."""
    from pagoda.kernels.triton_attention import paged_decode_attention_triton, paged_prefill_attention_triton

    i8 = torch.zeros(2, 4, 2, 16, dtype=torch.int8, device=DEVICE)
    f8 = torch.zeros(2, 4, 2, 16, dtype=FP8_DTYPE, device=DEVICE)
    tok = empty_page_scales(2, 4, 2, DEVICE)
    static = torch.ones(2, device=DEVICE)
    tables = torch.zeros(1, 2, dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([3], dtype=torch.int32, device=DEVICE)
    cu = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    q = torch.randn(1, 4, 16, device=DEVICE)
    bad = [
        ((i8, f8, tok, tok), "one kind"),
        ((i8, torch.zeros_like(i8, dtype=torch.float32), tok, None), "one kind"),
        ((i8, i8, static, tok), "per-token page scales for k_scale"),
        ((i8, i8, tok, static), "per-token page scales for v_scale"),
        ((i8, i8, tok, None), "int8 pages need v_scale"),
        ((f8, f8, None, static), "fp8 pages need k_scale"),
    ]
    for (kc, vc, ks, vs), msg in bad:
        for qq in (q, q[:0]):
            with pytest.raises(ValueError, match=msg):
                paged_decode_attention_triton(qq, kc, vc, tables, lens, 0.25, ks, vs)
        with pytest.raises(ValueError, match=msg):
            paged_prefill_attention_triton(q, kc, vc, tables, cu, lens, 0.25, ks, vs)


@pytest.mark.parametrize("backend", ["cpu", pytest.param("triton", marks=needs_triton)])
def test_prefill_long_chunk_spans_query_blocks(backend):
    """37 queries after an 8-token prefix: several 16-query blocks in the Triton kernel."""
    cases = [(45, 37), (20, 3), (1, 1)]
    pk = make_paged_kv([c for c, _ in cases], 4, 2, 16, FP8_DTYPE, seed=13)
    cu = torch.tensor([0, 37, 40, 41], dtype=torch.int32)
    q = torch.randn(41, 6, 16, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    args = (
        pk.k_cache,
        pk.v_cache,
        pk.block_tables,
        cu.to(DEVICE),
        pk.context_lens,
        0.25,
        pk.k_scale,
        pk.v_scale,
    )
    ref = paged_prefill_attention(q, *args, backend="reference")
    out = paged_prefill_attention(q, *args, backend=backend)
    torch.testing.assert_close(out.cpu(), ref.cpu(), **TOL[torch.float32])


# ------------------------------------------------------------------ per-token (page) scales


def test_token_scales_keep_each_tokens_largest_value():
    x = torch.randn(5, 3, 16) * torch.tensor([1e-3, 1.0, 300.0])[None, :, None]
    x[2, 1] = 0.0  # an all-zero token head keeps a finite positive floor
    s = token_scales(x)
    assert s.shape == (5, 3) and s.dtype == TOKEN_SCALE_DTYPE
    assert bool((s.float() > 0).all()) and bool(torch.isfinite(s.float()).all())
    amax = x.abs().amax(-1)
    ratio = amax / s.float()
    assert bool((((ratio - FP8_MAX).abs() <= FP8_MAX * 2**-8) | (amax == 0)).all())  # at 448 (bf16 scale)
    q = (x / s.float()[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() * s.float()[..., None]
    top = x.abs().argmax(-1, keepdim=True)
    err = (q.gather(-1, top) - x.gather(-1, top)).abs() / x.gather(-1, top).abs().clamp(min=1e-30)
    assert bool((err[amax > 0] <= 2**-8).all())  # the largest value survives almost exactly


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_write_kv_page_scales(backend):
    """Per-token scales are written beside the pages; both backends write the same bytes."""
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(7, 2, 8, generator=gen) * torch.arange(1, 8)[:, None, None]
    v = torch.randn(7, 2, 8, generator=gen)
    slots = torch.tensor([0, 5, 6, 7, 8, 15, -1])  # page boundary 7|8, a padding slot (-1)
    out = []
    for be in ("reference", backend):
        kc, vc = (torch.zeros(4, 4, 2, 8, dtype=FP8_DTYPE) for _ in range(2))
        ks, vs = empty_page_scales(4, 4, 2, "cpu"), empty_page_scales(4, 4, 2, "cpu")
        write_kv(kc, vc, k, v, slots, ks, vs, backend=be)
        out.append((raw(kc), raw(vc), ks, vs))
    for a, b in zip(out[0], out[1], strict=True):
        assert torch.equal(a, b)
    _, _, ks, _ = out[1]
    flat_s = ks.view(16, 2)
    torch.testing.assert_close(flat_s[slots[:6]], token_scales(k[:6]))
    assert int((flat_s != 0).any(-1).sum()) == 6  # untouched slots keep their (zero) scales
    back = (
        out[1][0].view(FP8_DTYPE).reshape(16, 2, 8)[slots[:6]].float() * flat_s[slots[:6]].float()[..., None]
    )
    assert ((back - k[:6]).abs() <= k[:6].abs() * 2**-4 + 1e-6).all()  # e4m3: 3 mantissa bits


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_convert_to_page_scales_equals_direct_write(backend):
    """bf16 -> fp8 with page scales writes the same bytes and scales as write_kv; fp8 page-scale
    copies move bytes and scale rows; fp8 -> static fp8 or bf16 dequantizes with the rows."""
    gen = torch.Generator().manual_seed(4)
    k = (torch.randn(10, 3, 8, generator=gen) * 5).bfloat16()
    slots = torch.arange(10) + 4  # pages 1..3 of 4 slots, last page partial
    bk = torch.zeros(5, 4, 3, 8, dtype=torch.bfloat16)
    write_kv(bk, bk.clone(), k, k, slots)
    direct, ds = torch.zeros(6, 4, 3, 8, dtype=FP8_DTYPE), empty_page_scales(6, 4, 3, "cpu")
    write_kv(direct, direct.clone(), k, k, slots + 4 * 2, ds, ds.clone())  # the same tokens on pages 3..5
    conv, cs = torch.zeros_like(direct), empty_page_scales(6, 4, 3, "cpu")
    src, dst = torch.tensor([1, 2, 3]), torch.tensor([3, 4, 5])
    convert_component_pages(bk, conv, src, dst, cs, backend=backend)
    # the partial last page's unused slots hold zeros either way (their scales: the floor vs unset)
    used = slots + 4 * 2
    assert torch.equal(raw(conv), raw(direct)) and torch.equal(cs.view(-1, 3)[used], ds.view(-1, 3)[used])
    copy, cps = torch.zeros_like(direct), empty_page_scales(6, 4, 3, "cpu")
    convert_component_pages(conv, copy, dst, src, cps, cs, backend=backend)
    assert torch.equal(raw(copy[1:4]), raw(conv[3:6])) and torch.equal(cps[1:4], cs[3:6])
    deq = conv[3:6].float() * cs[3:6].float()[..., None]
    back = torch.zeros_like(bk)
    convert_component_pages(conv, back, dst, src, None, cs, backend=backend)
    torch.testing.assert_close(back[1:4].float(), deq.bfloat16().float())
    static = calibrate_tensor_scales(k.float(), 1.5)
    st = torch.zeros_like(direct)
    convert_component_pages(conv, st, dst, dst, static, cs, backend=backend)
    torch.testing.assert_close(st[3:6].float() * static[:, None], deq, rtol=0.07, atol=1e-6)


def test_page_scales_are_checked():
    kc = torch.zeros(3, 4, 2, 8, dtype=FP8_DTYPE)
    k = torch.randn(1, 2, 8)
    slot = torch.tensor([0])
    for bad in (torch.zeros(3, 4, 2), torch.zeros(3, 4, 3, dtype=TOKEN_SCALE_DTYPE), torch.ones(3)):
        with pytest.raises(ValueError, match="scales must be"):
            write_kv(kc, kc.clone(), k, k, slot, bad, torch.ones(2))


def test_per_token_k_scales_quantize_the_outlier_channel_exactly():
    """Real K has outlier channels with an offset that dominate q.k. A per-token scale maps each
    token's largest value (the outlier) to 448 exactly, so the attention output is much closer to
    fp32 than with a static per-head scale (plain Gaussian K shows no such gain: e4m3 is a float)."""
    lens = [40, 17, 64]
    p32 = make_paged_kv(lens, 16, 2, 32, torch.float32, seed=11)
    gen = torch.Generator().manual_seed(3)
    k = p32.k_cache * 0.5
    k[..., 0] = 6 + torch.randn(k.shape[:3], generator=gen) * 2
    q = torch.randn(3, 4, 32, generator=gen) * 0.3
    q[..., 0] = 1.0
    args = (p32.block_tables, p32.context_lens, 0.2)
    o32 = paged_decode_attention(q, k, p32.v_cache, *args)
    pages = torch.arange(k.shape[0])
    v8 = torch.zeros_like(p32.v_cache, dtype=FP8_DTYPE)
    vs = calibrate_kv_scales(k, p32.v_cache.flatten(0, 1), 1.5)[1]
    convert_component_pages(p32.v_cache, v8, pages, pages, vs)
    errs = {}
    for kind in ("static", "token"):
        k8 = torch.zeros_like(k, dtype=FP8_DTYPE)
        if kind == "token":
            ks = empty_page_scales(len(pages), 16, 2, "cpu")
        else:
            ks = calibrate_kv_scales(k.flatten(0, 1), k.flatten(0, 1), 1.5)[0]
        convert_component_pages(k, k8, pages, pages, ks)
        o8 = paged_decode_attention(q, k8, v8, *args, ks, vs)
        errs[kind] = ((o8 - o32).norm() / o32.norm()).item()
    assert errs["token"] < errs["static"] * 0.7, errs


def test_calibrate_tensor_scales():
    x = torch.ones(4, 3, 8)
    x[1, 2, 5] = -448.0
    s = calibrate_tensor_scales(x, 2.0)
    assert s.shape == (3,) and torch.equal(s, torch.full((3,), 2.0))
    with pytest.raises(ValueError):
        calibrate_tensor_scales(x, 0)


# ------------------------------------------------------------------------------ sliding window

# (context len incl. chunk, query len) per sequence, page size 4: windows shorter than a page, equal
# to one, across boundaries and longer than every sequence; chunks with and without a cached prefix
WINDOW_PREFILL_CASES = [(13, 13), (17, 5), (8, 1), (21, 21), (3, 3), (16, 4)]
WINDOWS = [1, 3, 4, 5, 8, 11, 40]


def dense_window_attention(q, keys, values, scale, pos, window):
    """One query [Hq, D] at position ``pos`` over float K/V [L, Hkv, D]: keys pos - window < j <= pos."""
    lo = max(0, pos - window + 1)
    return full_softmax_attention(q, keys[lo : pos + 1], values[lo : pos + 1], scale)


@pytest.mark.parametrize("window", WINDOWS)
def test_reference_window_matches_dense_attention(window):
    pk = make_paged_kv([c for c, _ in WINDOW_PREFILL_CASES], 4, 2, 8, torch.float32, seed=window)
    q_lens = [n for _, n in WINDOW_PREFILL_CASES]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), 4, 8, generator=torch.Generator().manual_seed(3))
    args = (pk.k_cache, pk.v_cache, pk.block_tables, cu, pk.context_lens, 0.3)
    out = paged_prefill_attention(q, *args, backend="reference", window=window)
    last = (cu[1:] - 1).long()
    dec = paged_decode_attention(
        q[last],
        pk.k_cache,
        pk.v_cache,
        pk.block_tables,
        pk.context_lens,
        0.3,
        backend="reference",
        window=window,
    )
    for b, (length, n) in enumerate(WINDOW_PREFILL_CASES):
        for i in range(n):
            pos = length - n + i
            want = dense_window_attention(q[int(cu[b]) + i], pk.keys[b], pk.values[b], 0.3, pos, window)
            torch.testing.assert_close(out[int(cu[b]) + i], want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(dec[b], out[last[b]], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("kv", ["fp32", "bf16", "fp8tok", "int8"])
@pytest.mark.parametrize("window", WINDOWS)
def test_window_decode_and_prefill_match_reference(backend, kv, window):
    d, ps, hq, hkv = 16, 4, 6, 2
    lens = [c for c, _ in WINDOW_PREFILL_CASES]
    pk = paged_kv(lens, ps, hkv, d, kv, seed=window)
    q_lens = [n for _, n in WINDOW_PREFILL_CASES]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), hq, d, generator=torch.Generator().manual_seed(window)).to(DEVICE)
    scales = (pk.k_scale, pk.v_scale)
    args = (pk.k_cache, pk.v_cache, pk.block_tables, cu.to(DEVICE), pk.context_lens, 0.25, *scales)
    ref = paged_prefill_attention(q, *args, backend="reference", window=window)
    out = paged_prefill_attention(q, *args, backend=backend, window=window)
    torch.testing.assert_close(out.cpu(), ref.cpu(), **TOL[torch.float32])
    dargs = (pk.k_cache, pk.v_cache, pk.block_tables, pk.context_lens, 0.25, *scales)
    last = (cu[1:] - 1).long()
    ref = paged_decode_attention(q[last], *dargs, backend="reference", window=window)
    out = paged_decode_attention(q[last], *dargs, backend=backend, window=window)
    torch.testing.assert_close(out.cpu(), ref.cpu(), **TOL[torch.float32])
    if window < min(lens):  # the window changes the answer (the test would pass without one otherwise)
        full = paged_decode_attention(q[last], *dargs, backend="reference")
        assert not torch.allclose(full.cpu(), ref.cpu(), atol=1e-3)


@pytest.mark.parametrize(
    "backend,native", [("cpu", "1"), ("cpu", "0"), pytest.param("triton", "1", marks=needs_triton)]
)
def test_window_decode_never_reads_pages_before_the_window(backend, native, monkeypatch):
    """Block-table entries before every query's window may hold anything (a released page): the
    fast paths (the native kernel, the vectorized torch one, Triton) neither read nor check them."""
    monkeypatch.setenv("PAGODA_NATIVE_ATTENTION", native)
    pk = make_paged_kv([37, 9, 64], 4, 2, 16, torch.float32, seed=4)
    q = torch.randn(3, 4, 16, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    args = (pk.k_cache, pk.v_cache, pk.block_tables, pk.context_lens, 0.25)
    want = paged_decode_attention(q, *args, backend="reference", window=6)
    tables = pk.block_tables.clone()
    for b, n in enumerate(pk.context_lens.tolist()):
        tables[b, : max(0, n - 6) // 4] = -7
    args = (pk.k_cache, pk.v_cache, tables, pk.context_lens, 0.25)
    got = paged_decode_attention(q, *args, backend=backend, window=6)
    torch.testing.assert_close(got.cpu(), want.cpu(), **TOL[torch.float32])


@pytest.mark.parametrize("window", [0, -3, 2.5, True])
def test_window_must_be_a_positive_int(window):
    pk = make_paged_kv([5], 4, 1, 8, torch.float32)
    with pytest.raises(ValueError, match="window"):
        paged_decode_attention(
            torch.randn(1, 1, 8), pk.k_cache, pk.v_cache, pk.block_tables, pk.context_lens, 0.3, window=window
        )
