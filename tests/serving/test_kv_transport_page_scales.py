"""Per-token FP8 scales on the KV wire: they ride inside each PAGE frame (so the page's CRC covers
them), round-trip bit-exact beside the static scales of the other components, and a header or a
frame that misdescribes them is refused before anything is kept."""

from __future__ import annotations

import pytest
import torch

from pagoda.node_agent.engine.handoff import KVPayload
from pagoda.node_agent.serving.worker.kv_limits import HeaderError, check_header
from pagoda.node_agent.serving.worker.kv_transport import (
    PAGE,
    TcpKVSender,
    encode_frame,
    header_of,
    payload_frames,
)

from .test_kv_transport import AUTH, limits, run

pytestmark = pytest.mark.timeout(30)

FP8 = torch.float8_e4m3fn


def page_scaled_payload(pages: int = 3) -> KVPayload:
    """FP8 K and V pages (2 layers, 2 heads, dim 8, page 4) with per-token K scales, static V."""
    g = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(2):
        layer = {c: torch.randn(pages, 4, 2, 8, generator=g).to(FP8) for c in ("k", "v")}
        layer["k.scale"] = (torch.rand(pages, 4, 2, generator=g) + 0.1).bfloat16()
        layers.append(layer)
    scales = [{"v": torch.rand(2, generator=g) + 0.5} for _ in range(2)]
    return KVPayload("req-1", list(range(4 * pages - 2)), 42, 4, "fp8_e4m3", layers, scales, None, 0)


def test_page_scales_round_trip_bit_exact() -> None:
    p = page_scaled_payload()
    h = header_of("t1", p, 0)
    assert h["page_scales"] == ["k"] and h["components"] == ["k", "v"] and set(h["scale_shape"]) == {"v"}
    stats, r = run(lambda r: TcpKVSender(AUTH, timeout=10).send(r.addr, "t1", p))
    q = r.got["t1"]
    assert stats.pages == 3 and not r.errors
    for a, b in zip(p.layers, q.layers, strict=True):
        assert set(b) == {"k", "v", "k.scale"}
        for c in ("k", "v"):
            assert torch.equal(a[c].view(torch.uint8), b[c].view(torch.uint8))
        assert b["k.scale"].dtype == torch.bfloat16 and torch.equal(a["k.scale"], b["k.scale"])
    assert [set(s) for s in q.scales] == [{"v"}, {"v"}]
    assert all(torch.equal(a["v"], b["v"]) for a, b in zip(p.scales, q.scales, strict=True))


def test_a_changed_page_scale_fails_the_page_checksum() -> None:
    frames = payload_frames("t1", page_scaled_payload(), AUTH)
    body = bytearray(frames[1][12:-4])  # page 0's body (after the 12-byte frame prefix, before its CRC)
    good = encode_frame(PAGE, bytes(body))
    assert good == frames[1]
    body[-1] ^= 0x40  # the last byte: page 0's last per-token K scale of the last layer
    bad = good[:12] + bytes(body) + good[-4:]  # the sender's CRC, the changed scale

    async def go(r):
        return await r.raw([frames[0], bad, *frames[2:]])

    ack, r = run(go)
    assert not ack["ok"] and "checksum" in ack["error"] and "t1" not in r.got


def test_non_finite_page_scales_are_refused() -> None:
    p = page_scaled_payload()
    p.layers[1]["k.scale"][2, 3, 1] = float("inf")
    ack, r = run(lambda r: r.raw(payload_frames("t1", p, AUTH)))
    assert not ack["ok"] and "per-token scales" in ack["error"] and "t1" not in r.got


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda h: h.update(page_scales="k"), "page_scales"),
        (lambda h: h.update(page_scales=["k", "k"]), "page_scales"),
        (lambda h: h.update(page_scales=["q"]), "page_scales"),
        (lambda h: h.update(page_scales=[]), "scale_shape"),  # K would need a static scale
        (lambda h: h.update(page_scales=["k", "v"]), "has_scales"),  # V's static scales announced
        (lambda h: h["scale_shape"].update(k=[2]), "scale_shape"),
        (lambda h: h.update(kv_format="bf16", dtype="float32"), "has_scales|page_scales"),
    ],
)
def test_headers_that_misdescribe_page_scales_are_refused(change, match) -> None:
    check_header(header_of("t1", page_scaled_payload(), 0), limits(), 100)  # the well-formed one passes
    h = header_of("t1", page_scaled_payload(), 0)
    change(h)
    with pytest.raises(HeaderError, match=match):
        check_header(h, limits(), 100)


def test_frame_size_bound_covers_page_scales() -> None:
    lim = limits()
    assert lim.page_bytes("float8_e4m3fn", ["k"]) == lim.page_bytes("float8_e4m3fn") + 2 * 4 * 2 * 2
    assert lim.max_frame >= lim.page_bytes("float8_e4m3fn", lim.components) + 4


def int8_payload(pages: int = 3) -> KVPayload:
    """int8 K and V pages (2 layers, 2 heads, dim 8, page 4), each with its per-token scales."""
    g = torch.Generator().manual_seed(1)
    layers = []
    for _ in range(2):
        layer = {c: torch.randint(-127, 128, (pages, 4, 2, 8), generator=g, dtype=torch.int8) for c in "kv"}
        for c in "kv":
            layer[f"{c}.scale"] = (torch.rand(pages, 4, 2, generator=g) + 0.1).bfloat16()
        layers.append(layer)
    return KVPayload("req-1", list(range(4 * pages - 2)), 42, 4, "int8", layers, None, None, 0)


def test_int8_pages_round_trip_bit_exact() -> None:
    p = int8_payload()
    h = header_of("t1", p, 0)
    assert (h["kv_format"], h["dtype"], h["page_scales"], h["has_scales"]) == (
        "int8",
        "int8",
        ["k", "v"],
        False,
    )
    stats, r = run(lambda r: TcpKVSender(AUTH, timeout=10).send(r.addr, "t1", p))
    q = r.got["t1"]
    assert stats.pages == 3 and not r.errors and q.scales is None
    for a, b in zip(p.layers, q.layers, strict=True):
        assert set(b) == set(a)
        for key, t in a.items():
            assert b[key].dtype == t.dtype and torch.equal(t, b[key]), key


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda h: h.update(page_scales=["k"]), "int8 pages need page_scales for every component"),
        (lambda h: h.pop("page_scales"), "int8 pages need page_scales"),
        (lambda h: h.update(dtype="float8_e4m3fn"), "kv_format/dtype"),
        (lambda h: h.update(kv_format="fp8_e4m3"), "kv_format/dtype"),
    ],
)
def test_int8_headers_that_misdescribe_their_pages_are_refused(change, match) -> None:
    check_header(header_of("t1", int8_payload(), 0), limits(), 100)
    h = header_of("t1", int8_payload(), 0)
    change(h)
    with pytest.raises(HeaderError, match=match):
        check_header(h, limits(), 100)
