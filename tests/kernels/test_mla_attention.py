"""Paged multi-head latent attention (absorbed form) against a plain dense computation that
decompresses the latent into per-head K and V."""

import pytest
import torch
import torch.nn.functional as F

from pagoda.kernels import mla_attention
from pagoda.kernels.mla_attention import paged_mla_attention, paged_mla_decode_attention
from pagoda.kernels.paged_attention import (
    calibrate_head_scales,
    convert_component_pages,
    empty_page_scales,
    write_kv,
)

H, DN, DR, DV, R, PAGE = 3, 8, 4, 6, 16, 4


def _weights(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(H, DN, R, generator=g) / R**0.5, torch.randn(H, DV, R, generator=g) / R**0.5


def _dense(q_nope, q_rope, c, kr, w_uk, w_uv, scale, offset):
    """Decompressed MLA: K = [c W_UK^T, k_rope] and V = c W_UV^T per head, causal softmax."""
    k = torch.cat([torch.einsum("lr,hdr->hld", c, w_uk), kr[None].expand(H, -1, -1)], dim=-1)
    v = torch.einsum("lr,hvr->hlv", c, w_uv)
    q = torch.cat([q_nope, q_rope], dim=-1).transpose(0, 1)  # [H, T, Dn + Dr]
    rows = torch.arange(q.shape[1])[:, None] + offset
    mask = torch.arange(c.shape[0])[None, :] <= rows
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(0, 1)


def _paged(seqs, num_pages, dtype=torch.float32, scales=(None, None)):
    """Latent and rope caches holding each sequence's (c, kr) in shuffled pages; block tables."""
    lat = torch.zeros(num_pages, PAGE, 1, R, dtype=dtype)
    rope = torch.zeros(num_pages, PAGE, 1, DR, dtype=dtype)
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(1)).tolist()
    width = max(-(-c.shape[0] // PAGE) for c, _ in seqs)
    tables = torch.zeros(len(seqs), width, dtype=torch.int32)
    for b, (c, kr) in enumerate(seqs):
        n = -(-c.shape[0] // PAGE)
        pages = [perm.pop() for _ in range(n)]
        tables[b, :n] = torch.tensor(pages)
        slots = torch.tensor([pages[i // PAGE] * PAGE + i % PAGE for i in range(c.shape[0])])
        write_kv(lat, rope, c[:, None], kr[:, None], slots, *scales)
    return lat, rope, tables


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("q_lens", [(5, 9), (2, 1), (1, 1)])  # prompts; chunks after a prefix; decode
def test_absorbed_paged_mla_matches_decompressed_attention(q_lens, backend):
    g = torch.Generator().manual_seed(0)
    w_uk, w_uv = _weights(g)
    lens = (5, 9) if q_lens == (5, 9) else (7, 10)  # (1, 1): a decode step, batched on "cpu"
    seqs = [(torch.randn(n, R, generator=g), torch.randn(n, DR, generator=g)) for n in lens]
    lat, rope, tables = _paged(seqs, 8)
    t = sum(q_lens)
    q_nope, q_rope = torch.randn(t, H, DN, generator=g), torch.randn(t, H, DR, generator=g)
    cu = torch.tensor([0, q_lens[0], t], dtype=torch.int32)
    scale = 0.3
    o_lat = paged_mla_attention(
        torch.einsum("thd,hdr->thr", q_nope, w_uk),
        q_rope,
        lat,
        rope,
        tables,
        cu,
        torch.tensor(lens),
        scale,
        backend=backend,
    )
    got = torch.einsum("thr,hvr->thv", o_lat, w_uv)
    for b, ((c, kr), n) in enumerate(zip(seqs, lens, strict=True)):
        s, e = int(cu[b]), int(cu[b + 1])
        want = _dense(q_nope[s:e], q_rope[s:e], c, kr, w_uk, w_uv, scale, n - (e - s))
        torch.testing.assert_close(got[s:e], want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_decode_and_empty_sequences(backend, monkeypatch):
    monkeypatch.setattr(mla_attention, "_CHUNK_BYTES", 1)  # batched decode: one sequence per chunk
    g = torch.Generator().manual_seed(2)
    w_uk, _ = _weights(g)
    seqs = [(torch.randn(6, R, generator=g), torch.randn(6, DR, generator=g))] * 2
    lat, rope, tables = _paged(seqs, 6)
    q_lat = torch.einsum("thd,hdr->thr", torch.randn(2, H, DN, generator=g), w_uk)
    q_rope = torch.randn(2, H, DR, generator=g)
    out = paged_mla_decode_attention(
        q_lat, q_rope, lat, rope, tables, torch.tensor([6, 0]), 0.5, backend=backend
    )
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    c, kr = seqs[0]
    probs = ((q_lat[0] @ c.T + q_rope[0] @ kr.T) * 0.5).softmax(-1)
    torch.testing.assert_close(out[0], probs @ c)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_fp8_latent_pages_stay_close_and_convert_like_direct_writes(backend):
    g = torch.Generator().manual_seed(3)
    seqs = [(torch.randn(11, R, generator=g), 3 * torch.randn(11, DR, generator=g))]
    lat, rope, tables = _paged(seqs, 4)
    ls = calibrate_head_scales(lat.flatten(0, 1), 1.5)
    rs = calibrate_head_scales(rope.flatten(0, 1), 1.5)
    assert ls.shape == rs.shape == (1,) and rs > ls  # the rope key has its own, larger scale
    f8 = (
        torch.zeros(4, PAGE, 1, R, dtype=torch.float8_e4m3fn),
        torch.zeros(4, PAGE, 1, DR, dtype=torch.float8_e4m3fn),
    )
    pages = torch.arange(4)
    convert_component_pages(lat, f8[0], pages, pages, ls)
    convert_component_pages(rope, f8[1], pages, pages, rs)
    lat8, rope8, _ = _paged(seqs, 4, torch.float8_e4m3fn, (ls, rs))
    assert torch.equal(f8[0].view(torch.uint8), lat8.view(torch.uint8))
    assert torch.equal(f8[1].view(torch.uint8), rope8.view(torch.uint8))
    q_lat, q_rope = torch.randn(1, H, R, generator=g), torch.randn(1, H, DR, generator=g)
    want = paged_mla_decode_attention(
        q_lat, q_rope, lat, rope, tables, torch.tensor([11]), 0.25, backend=backend
    )
    got = paged_mla_decode_attention(q_lat, q_rope, *f8, tables, torch.tensor([11]), 0.25, ls, rs, backend)
    # e4m3 keeps 3 mantissa bits (~2-3% RMS per value), sharpened by the softmax: measured 0.06;
    # a lost or swapped scale is off by ~1
    assert ((got - want).norm() / want.norm()).item() < 0.12


def test_rejects_mismatched_shapes():
    lat, rope = torch.zeros(2, PAGE, 1, R), torch.zeros(2, PAGE, 1, DR)
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([1])
    with pytest.raises(ValueError, match="query shapes"):
        paged_mla_decode_attention(
            torch.zeros(1, H, R + 1), torch.zeros(1, H, DR), lat, rope, tables, lens, 1.0
        )
    with pytest.raises(ValueError, match="one-head pages"):
        paged_mla_decode_attention(
            torch.zeros(1, H, R), torch.zeros(1, H, DR), torch.zeros(2, PAGE, 2, R), rope, tables, lens, 1.0
        )


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("n_seqs", [1, 3])
def test_int8_latent_pages_with_page_scales(backend, n_seqs):
    """int8 latent and rope key with per-token page scales: converted pages equal direct writes, and
    decode (batched and per sequence) reads each page with its own scale rows."""
    g = torch.Generator().manual_seed(4)
    seqs = [
        (torch.randn(n, R, generator=g), 3 * torch.randn(n, DR, generator=g)) for n in (11, 5, 8)[:n_seqs]
    ]
    lat, rope, tables = _paged(seqs, 10)
    pages = torch.arange(10)
    i8 = (torch.zeros(10, PAGE, 1, R, dtype=torch.int8), torch.zeros(10, PAGE, 1, DR, dtype=torch.int8))
    sc = (empty_page_scales(10, PAGE, 1, "cpu"), empty_page_scales(10, PAGE, 1, "cpu"))
    convert_component_pages(lat, i8[0], pages, pages, sc[0])
    convert_component_pages(rope, i8[1], pages, pages, sc[1])
    direct_sc = (empty_page_scales(10, PAGE, 1, "cpu"), empty_page_scales(10, PAGE, 1, "cpu"))
    lat8, rope8, _ = _paged(seqs, 10, torch.int8, direct_sc)
    lens = torch.tensor([c.shape[0] for c, _ in seqs])
    slots = torch.tensor(
        [int(tables[b, i // PAGE]) * PAGE + i % PAGE for b, n in enumerate(lens) for i in range(n)]
    )
    for conv, direct in ((i8[0], lat8), (i8[1], rope8), (sc[0], direct_sc[0]), (sc[1], direct_sc[1])):
        assert torch.equal(conv.flatten(0, 1)[slots], direct.flatten(0, 1)[slots])
    q_lat, q_rope = torch.randn(n_seqs, H, R, generator=g), torch.randn(n_seqs, H, DR, generator=g)
    want = paged_mla_decode_attention(q_lat, q_rope, lat, rope, tables, lens, 0.25, backend=backend)
    got = paged_mla_decode_attention(q_lat, q_rope, *i8, tables, lens, 0.25, *sc, backend)
    # int8 steps are amax / 254 at most per value (~0.3% RMS); a lost or swapped scale is off by ~1
    assert ((got - want).norm() / want.norm()).item() < 0.03
