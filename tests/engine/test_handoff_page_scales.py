"""Per-token FP8 K scales travel with their pages: migration between pools of any scale granularity,
the handoff payload and its checks, and the page checksum (no engine: small pools)."""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels.paged_attention import calibrate_head_scales
from pagoda.node_agent.engine import handoff
from pagoda.node_agent.engine.handoff import KVPayload
from pagoda.node_agent.engine.page_checksum import payload_checksums, pool_page_checksums
from pagoda.node_agent.kv.pool import KVPagePool
from pagoda.node_agent.params import RequestError

COMPS = {"k": (2, 8), "v": (2, 8)}
FP8 = torch.float8_e4m3fn
LAYERS, PAGE = 2, 4


def pool(dtype=FP8, token_scaled=("k",), pages=6) -> KVPagePool:
    fmt = "fp8_e4m3" if dtype == FP8 else "bf16"
    return KVPagePool(LAYERS, pages, PAGE, COMPS, dtype, kv_format=fmt, token_scaled=token_scaled)


def filled_bf16(n_pages: int = 2):
    """A float32 ("bf16" format on the CPU) pool with random K/V on ``n_pages`` pages; K has a
    per-token magnitude spread and an outlier channel, like real K."""
    src = pool(torch.float32, ())
    refs = src.allocate_pages(n_pages)
    g = torch.Generator().manual_seed(0)
    for layer in src.layers:
        for c, t in layer.items():
            x = torch.randn(n_pages, PAGE, 2, 8, generator=g)
            if c == "k":
                x = x * torch.exp(torch.randn(n_pages, PAGE, 2, 1, generator=g))
                x[..., 0] += 6
            t[[r.page for r in refs]] = x
    return src, refs


def calibrate(p: KVPagePool, src: KVPagePool) -> None:
    for layer, scales in zip(src.layers, p.static_scales, strict=True):
        for c, s in scales.items():
            s.copy_(calibrate_head_scales(layer[c].flatten(0, 1), 1.5))


def dequant(p: KVPagePool, refs, layer: int, c: str) -> torch.Tensor:
    idx = [r.page for r in refs]
    x = p.layers[layer][c][idx].float()
    s = p.layer_scales(layer).get(c)
    if s is None:
        return x
    return x * (s[idx].float()[..., None] if s.dim() == 3 else s[:, None])


@pytest.mark.parametrize("dst_tok", [("k",), ()])
def test_migration_between_granularities(dst_tok):
    """bf16 -> per-token-k fp8 -> (per-token-k | per-head) fp8 -> bf16: values stay within e4m3's
    rounding (twice it when the scales change), and page-scale rows move with their pages."""
    src, refs = filled_bf16()
    want = {c: dequant(src, refs, 1, c) for c in ("k", "v")}
    a = pool()
    calibrate(a, src)
    a_refs = handoff.migrate(src, a, refs)
    b = pool(token_scaled=dst_tok)
    calibrate(b, src)
    b_refs = handoff.migrate(a, b, a_refs)
    # e4m3 rounds to within half a step (2**-4 relative); a change of scales rounds again
    for p, r, rel in ((a, a_refs, 0.07), (b, b_refs, 0.07 if dst_tok else 0.13)):
        for c in ("k", "v"):
            got = dequant(p, r, 1, c)
            assert ((got - want[c]).abs() <= want[c].abs() * rel + 0.02).all(), (c, dst_tok)
    if dst_tok:  # fp8 -> fp8 with per-token scales on both sides: bytes and scale rows copied
        for la, lb in zip(a.layers, b.layers, strict=True):
            ia, ib = [r.page for r in a_refs], [r.page for r in b_refs]
            assert torch.equal(la["k"][ia].view(torch.uint8), lb["k"][ib].view(torch.uint8))
            assert torch.equal(la["k.scale"][ia], lb["k.scale"][ib])
    back = pool(torch.float32, ())
    back_refs = handoff.migrate(b, back, b_refs)
    torch.testing.assert_close(dequant(back, back_refs, 0, "k"), dequant(b, b_refs, 0, "k"))


def test_payload_carries_page_scales_and_checksums_cover_them():
    src, refs = filled_bf16()
    a = pool()
    calibrate(a, src)
    a_refs = handoff.migrate(src, a, refs)
    layers, scales = handoff.extract_pages(a, a_refs)
    assert set(layers[0]) == {"k", "v", "k.scale"} and [set(s) for s in scales] == [{"v"}] * LAYERS
    assert payload_checksums(layers) == pool_page_checksums(a, [r.page for r in a_refs])
    before = pool_page_checksums(a, [r.page for r in a_refs])
    a.layers[1]["k.scale"][a_refs[1].page, 2, 0] *= 2  # only a scale changes
    after = pool_page_checksums(a, [r.page for r in a_refs])
    assert after[0] == before[0] and after[1] != before[1]
    # a payload with per-token scales goes into a per-head pool (and the reverse) through the checks
    ids = list(range(2 * PAGE - 1))
    p = KVPayload("r", ids, 1, PAGE, "fp8_e4m3", layers, scales)
    for dst in (pool(token_scaled=()), pool()):
        calibrate(dst, src)
        assert handoff.check_payload(p, dst, 100, 64) == 2
        handoff.convert_into(dst, dst.allocate_pages(2), p.layers, p.scales)


def test_page_scale_checks_name_the_field():
    src, refs = filled_bf16()
    a = pool()
    calibrate(a, src)
    layers, scales = handoff.extract_pages(a, handoff.migrate(src, a, refs))
    ids = list(range(2 * PAGE - 1))

    def check(layers=layers, scales=scales, fmt="fp8_e4m3"):
        handoff.check_payload(KVPayload("r", ids, 1, PAGE, fmt, layers, scales), pool(), 100, 64)

    check()
    bad = [dict(la) for la in layers]
    bad[1]["k.scale"] = bad[1]["k.scale"].float()
    with pytest.raises(RequestError, match=r"layers\[1\]\['k.scale'\]: torch.float32"):
        check(bad)
    bad = [dict(la) for la in layers]
    bad[0]["k.scale"] = -bad[0]["k.scale"] - 1
    with pytest.raises(RequestError, match="non-negative"):
        check(bad)
    with pytest.raises(RequestError, match=r"scales\[0\]: components"):
        check(scales=[{**s, "k": torch.ones(2)} for s in scales])


def int8_pool(pages=6) -> KVPagePool:
    return KVPagePool(LAYERS, pages, PAGE, COMPS, torch.int8, kv_format="int8", token_scaled=("k", "v"))


def test_int8_pages_migrate_hand_off_and_are_checked():
    """bf16 -> int8 -> int8 (bytes and scale rows copied) -> bf16; the payload of int8 pages passes
    the checks, and one without a component's page scales, or into an fp8 pool, is refused."""
    src, refs = filled_bf16()
    want = {c: dequant(src, refs, 1, c) for c in ("k", "v")}
    a = int8_pool()
    a_refs = handoff.migrate(src, a, refs)
    for c in ("k", "v"):  # within half an int8 step of each token's amax / 127
        got, step = dequant(a, a_refs, 1, c), want[c].abs().amax(-1, keepdim=True) / 127
        assert ((got - want[c]).abs() <= 0.51 * step + 1e-6).all(), c
    b = int8_pool()
    b_refs = handoff.migrate(a, b, a_refs)
    ia, ib = [r.page for r in a_refs], [r.page for r in b_refs]
    for la, lb in zip(a.layers, b.layers, strict=True):
        for key in ("k", "v", "k.scale", "v.scale"):
            assert torch.equal(la[key][ia], lb[key][ib]), key
    back = pool(torch.float32, ())
    back_refs = handoff.migrate(b, back, b_refs)
    for c in ("k", "v"):
        torch.testing.assert_close(dequant(back, back_refs, 0, c), dequant(b, b_refs, 0, c))
    layers, scales = handoff.extract_pages(a, a_refs)
    assert set(layers[0]) == {"k", "v", "k.scale", "v.scale"} and scales is None
    assert payload_checksums(layers) == pool_page_checksums(a, ia)
    ids = list(range(2 * PAGE - 1))
    p = KVPayload("r", ids, 1, PAGE, "int8", layers, None)
    assert handoff.check_payload(p, int8_pool(), 100, 64) == 2
    bad = [{k: t for k, t in la.items() if k != "v.scale"} for la in layers]
    with pytest.raises(RequestError, match="int8 pages need per-token scales for every component"):
        handoff.check_payload(KVPayload("r", ids, 1, PAGE, "int8", bad, None), int8_pool(), 100, 64)
    with pytest.raises(RequestError, match="cannot hand off"):
        handoff.check_payload(p, pool(), 100, 64)
    as_fp8 = [{k: (t.view(FP8) if t.dtype == torch.int8 else t) for k, t in la.items()} for la in layers]
    with pytest.raises(RequestError, match="does not match kv_format 'int8'"):
        handoff.check_payload(KVPayload("r", ids, 1, PAGE, "int8", as_fp8, None), int8_pool(), 100, 64)
