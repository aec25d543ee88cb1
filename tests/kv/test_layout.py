"""One PageLayout for every mover: the handoff payload, the tensor-parallel page transfer and the
KV wire's PAGE and SCALES frames hold the same tensors in the same order, for bf16, fp8_e4m3
with per-token K scales and int8 pools; and the one page-set rule of each format."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagoda.node_agent.engine import handoff
from pagoda.node_agent.engine.handoff import KVPayload
from pagoda.node_agent.engine.parallel import steps as parallel_steps
from pagoda.node_agent.kv.layout import LayoutError, PageLayout, check_page_set
from pagoda.node_agent.kv.pool import KVPagePool
from pagoda.node_agent.serving.worker.kv_transport import PAGE, SCALES, payload_frames

from ..serving.test_kv_transport import AUTH

COMPS = {"k": (2, 8), "v": (2, 8)}
LAYERS, PAGE_SIZE = 2, 4
POOLS = {  # kv_format: (dtype, token_scaled, per-layer keys, static-scale keys)
    "bf16": (torch.float32, (), ("k", "v"), ()),
    "fp8_e4m3": (torch.float8_e4m3fn, ("k",), ("k", "v", "k.scale"), ("v",)),
    "int8": (torch.int8, ("k", "v"), ("k", "v", "k.scale", "v.scale"), ()),
}


def filled(kv_format: str):
    dtype, tok, _, _ = POOLS[kv_format]
    pool = KVPagePool(LAYERS, 5, PAGE_SIZE, COMPS, dtype, kv_format=kv_format, token_scaled=tok)
    refs = pool.allocate_pages(3)
    g = torch.Generator().manual_seed(0)
    for layer in pool.layers:
        for t in layer.values():
            t.copy_(torch.randn(t.shape, generator=g).abs().to(t.dtype))
    for layer in pool.static_scales or []:
        for s in layer.values():
            s.copy_(torch.rand(s.shape, generator=g) + 0.5)
    return pool, refs


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("kv_format", sorted(POOLS))
def test_the_three_movers_share_one_order(kv_format: str, monkeypatch) -> None:
    _, _, keys, static = POOLS[kv_format]
    pool, refs = filled(kv_format)
    layout = PageLayout.of_pool(pool)
    assert layout.page_keys == keys and layout.static_scaled == static
    # handoff payload
    layers, scales = handoff.extract_pages(pool, refs)
    assert all(tuple(layer) == keys for layer in layers)
    assert (scales is None) == (not static) and all(tuple(s) == static for s in scales or [])
    assert PageLayout.of_pages(layers, scales) == layout
    order = layout.tensors(layers, scales)
    assert len(order) == LAYERS * (len(keys) + len(static))
    # tensor-parallel transfer: the layout it announces and the tensors it sends
    sent: list[torch.Tensor] = []
    monkeypatch.setattr(parallel_steps.dist, "send", lambda t, dst, group: sent.append(t.clone()))
    parallel_steps._send_pages(pool, (layers, scales), 1, SimpleNamespace(cpu=None))
    got_keys, got_static = parallel_steps._read_layout(pool, sent[0])
    assert tuple(k for k, _ in got_keys) == keys and tuple(k for k, _ in got_static) == static
    assert [raw(t) for t in sent[1:]] == [raw(t) for t in order]
    # KV wire: PAGE frame i holds page i of every tensor of each layer in order, SCALES the rest
    payload = KVPayload("r", list(range(3 * PAGE_SIZE)), 1, PAGE_SIZE, kv_format, layers, scales)
    frames = payload_frames("t", payload, AUTH)
    pages = [f[12:-4] for f in frames if f[5] == PAGE]
    per_layer = len(keys)
    for i, body in enumerate(pages):
        want = b"".join(
            raw(t[i]) for li in range(LAYERS) for t in order[li * per_layer : (li + 1) * per_layer]
        )
        assert body[4:] == want
    scale_frames = [f[12:-4] for f in frames if f[5] == SCALES]
    assert scale_frames == ([b"".join(raw(t) for t in order[LAYERS * per_layer :])] if static else [])


def test_check_page_set_is_each_formats_rule() -> None:
    comps = ["k", "v"]
    assert check_page_set("fp8_e4m3", "float8_e4m3fn", comps, ["k"]) == PageLayout(("k", "v"), ("k",), ("v",))
    assert check_page_set("fp8_e4m3", torch.float8_e4m3fn, comps, []).static_scaled == ("k", "v")
    assert check_page_set("int8", torch.int8, comps, ["v", "k"]) == PageLayout(("k", "v"), ("k", "v"), ())
    assert check_page_set("bf16", "float32", comps, []) == PageLayout(("k", "v"))
    for args, rule in (
        (("int8", torch.int8, comps, ["k"]), LayoutError.EVERY),
        (("bf16", torch.bfloat16, comps, ["k"]), LayoutError.UNSCALED),
        (("int8", "float8_e4m3fn", comps, comps), LayoutError.DTYPE),
        (("fp32", torch.float32, comps, []), LayoutError.DTYPE),  # scratch pools never travel
    ):
        with pytest.raises(LayoutError) as exc:
            check_page_set(*args)
        assert exc.value.rule == rule
