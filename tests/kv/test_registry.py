"""The KV format registry is the one place a format is declared: the built-in entries follow the
shared vocabulary, and a throwaway format added through ``register`` alone runs a pool, a handoff
payload and a KV wire header (it reuses the int8 kernels under a new name)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from pagoda.kernels.int8_format import int8_token_scales, quantize_int8
from pagoda.kernels.paged_attention import write_kv
from pagoda.node_agent.engine import handoff
from pagoda.node_agent.engine.sequence import Sequence
from pagoda.node_agent.kv import formats
from pagoda.node_agent.kv.layout import PageLayout
from pagoda.node_agent.kv.pool import KVPagePool
from pagoda.node_agent.params import RequestError, SamplingParams
from pagoda.node_agent.serving.worker.kv_limits import KVLimits, check_header
from pagoda.node_agent.serving.worker.kv_transport import _Assembler, header_of, payload_frames
from pagoda.vocabulary import HANDOFFS, KV_CACHE_FORMATS

from ..serving.test_kv_transport import AUTH, GEN_LEN

COMPS = {"k": (2, 8), "v": (2, 8)}
LAYERS, PAGE = 2, 4


def test_the_builtin_formats_are_the_vocabularys() -> None:
    assert formats.names(wire=True) == KV_CACHE_FORMATS and "fp32" in formats.names()
    pairs = {(s, d) for s in formats.names() for d in formats.names() if formats.handoff_allowed(s, d)}
    assert pairs == set(HANDOFFS)
    assert formats.get("int8").token_scaled(COMPS, "per-head") == ("k", "v")
    assert formats.get("fp8_e4m3").token_scaled(COMPS, "per-token-k") == ("k",)
    assert formats.by_dtype(torch.int8) is formats.get("int8") and formats.by_dtype(torch.float16) is None
    assert formats.wire_dtype("float8_e4m3fn") == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="unknown KV cache format 'nope'; accepted: bf16, fp8_e4m3, int8"):
        formats.get("nope")
    with pytest.raises(ValueError, match="already registered"):
        formats.register(formats.get("int8"))


@pytest.fixture
def int8x() -> Iterator[formats.KVFormat]:
    """A test-only format: int8 elements with a scale per token and head, handed off to itself."""
    fmt = formats.register(
        formats.KVFormat(
            "int8x",
            torch.int8,
            (torch.int8,),
            formats.EVERY_COMPONENT,
            handoffs=frozenset({"int8x"}),
            scale_of=int8_token_scales,
            quantize=quantize_int8,
        )
    )
    yield fmt
    formats.unregister("int8x")
    assert "int8x" not in formats.names()


def pool_of(fmt: formats.KVFormat, pages: int = 6) -> KVPagePool:
    return KVPagePool(
        LAYERS, pages, PAGE, COMPS, fmt.dtype, kv_format=fmt.name, token_scaled=fmt.token_scaled(COMPS, "")
    )


def written(fmt: formats.KVFormat, n_tokens: int) -> tuple[KVPagePool, Sequence, list[torch.Tensor]]:
    """A pool of ``fmt`` with one sequence of ``n_tokens`` written through the kernels."""
    pool = pool_of(fmt)
    seq = Sequence("r1", list(range(n_tokens)), SamplingParams(seed=3))
    seq.block_table = pool.allocate_pages(-(-n_tokens // PAGE))
    seq.output_token_ids = [7]
    slots = torch.tensor([seq.block_table[t // PAGE].page * PAGE + t % PAGE for t in range(n_tokens)])
    g = torch.Generator().manual_seed(1)
    values = []
    for li in range(LAYERS):
        k, v = torch.randn(2, n_tokens, 2, 8, generator=g)
        cache, scales = pool.layer_cache(li), pool.layer_scales(li)
        write_kv(cache["k"], cache["v"], k, v, slots, scales["k"], scales["v"])
        values.append((k, v, slots))
    return pool, seq, values


def test_a_registered_format_runs_a_pool(int8x) -> None:
    pool, _, values = written(int8x, 6)
    assert pool.format is int8x and pool.dtype == torch.int8 and pool.token_scaled == ("k", "v")
    assert PageLayout.of_pool(pool) == PageLayout(("k", "v"), ("k", "v"), ())
    for li, (k, v, slots) in enumerate(values):
        cache = pool.layer_cache(li)
        for c, x in (("k", k), ("v", v)):
            flat = cache[c].flatten(0, 1)[slots].float()
            scale = cache[f"{c}.scale"].flatten(0, 1)[slots].float()[..., None]
            step = x.abs().amax(-1, keepdim=True) / 127
            assert ((flat * scale - x).abs() <= 0.51 * step + 1e-6).all()
    with pytest.raises(ValueError, match="int8x pages scale every component per token"):
        KVPagePool(LAYERS, 2, PAGE, COMPS, torch.int8, kv_format="int8x", token_scaled=("k",))


def test_a_registered_format_hands_off(int8x) -> None:
    src, seq, _ = written(int8x, 6)
    payload = handoff.payload_of(seq, src, lambda layers: {})
    assert payload.kv_format == "int8x" and set(payload.layers[0]) == {"k", "v", "k.scale", "v.scale"}
    dst = pool_of(int8x)
    assert handoff.check_payload(payload, dst, 100, 64) == 2
    got = handoff.receive(payload, dst, SamplingParams(seed=3), "r1")
    for a, b in zip(src.layers, dst.layers, strict=True):
        for key in ("k", "v", "k.scale", "v.scale"):
            src_rows = a[key][[r.page for r in seq.block_table]]
            assert torch.equal(src_rows, b[key][[r.page for r in got.block_table]]), key
    with pytest.raises(RequestError, match="cannot hand off"):
        handoff.check_payload(payload, pool_of(formats.get("int8")), 100, 64)


def test_a_registered_format_passes_the_kv_wire_header(int8x) -> None:
    src, seq, _ = written(int8x, 6)
    payload = handoff.payload_of(seq, src, lambda layers: {})
    dst = pool_of(int8x)
    lim = KVLimits(
        num_layers=LAYERS,
        page_size=PAGE,
        component_shapes=dict(COMPS),
        vocab_size=100,
        max_model_len=64,
        generator_state_len=GEN_LEN,
        free_pages=lambda: dst.num_free,
        formats=frozenset(f for f in formats.wire_pairs() if formats.handoff_allowed(f[0], "int8x")),
    )
    assert lim.formats == {("int8x", "int8")}
    frames = payload_frames("t1", payload, AUTH)
    header = header_of("t1", payload, GEN_LEN)
    assert header["page_scales"] == ["k", "v"] and not header["has_scales"]
    check_header(header, lim, dst.num_free)
    asm = _Assembler(header, lim)
    done = [asm.add(f[5], f[12:-4]) for f in frames[1:]]
    assert done[-1] and not any(done[:-1])
    back = asm.build()
    for a, b in zip(payload.layers, back.layers, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_public_names_are_the_vocabularys():
    """Config and the CLI check names against the torch-free vocabulary (a router never loads torch):
    the registry's wire formats and handoffs must be exactly the vocabulary's."""
    from pagoda.node_agent.kv import formats
    from pagoda.vocabulary import KV_CACHE_FORMATS, handoff_allowed

    assert formats.names(wire=True) == KV_CACHE_FORMATS
    for src in KV_CACHE_FORMATS:
        for dst in KV_CACHE_FORMATS:
            assert formats.handoff_allowed(src, dst) == handoff_allowed(src, dst), (src, dst)
