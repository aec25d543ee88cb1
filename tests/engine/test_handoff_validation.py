"""A decode worker validates every handoff before it allocates, and leaves no trace when one fails."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from pagoda.node_agent.engine import handoff
from pagoda.node_agent.engine.config import PhaseFormats
from pagoda.node_agent.engine.handoff import GENERATOR_STATE_BYTES, KVPayload
from pagoda.node_agent.engine.output import RequestState
from pagoda.node_agent.params import CapacityError, RequestError, SamplingParams

FORMATS = PhaseFormats("bf16", "bf16", "bf16", "fp8_e4m3")  # bf16 prefill pages -> fp8 decode pool
PROMPT = "Write one sentence about the sea."
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=8, temperature=0.8, seed=2**64 - 1, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(make_engine):
    """(one engine for both phases, which also prefills bf16 handoffs; an fp8 prefill worker; an fp8
    decode worker)."""
    return (
        make_engine(formats=FORMATS),
        make_engine(formats=PhaseFormats("bf16", "fp8_e4m3", "bf16", "fp8_e4m3"), role="prefill"),
        make_engine(formats=FORMATS, role="decode", max_num_seqs=2, kv_memory=16 << 20),
    )


def uncached(engine):
    """The engine with an empty prefix cache (every run computes the same way)."""
    for pool in engine.pools().values():
        pool.clear_prefix_cache()
    return engine


def prefilled(engine, params: SamplingParams = GREEDY, prompt: str = PROMPT) -> KVPayload:
    rid = uncached(engine).add_request(prompt, params, prefill_only=True)
    payload = engine.run_until_done()[rid].kv_payload
    assert payload is not None
    return payload


def assert_no_trace(engine) -> None:
    assert engine.decode_pool.num_used == 0
    engine.decode_pool.check_idle()
    assert not engine._requests and not engine._ready and not engine.scheduler.has_work()


def clone(p: KVPayload, **changes) -> KVPayload:
    """A payload whose containers are fresh (mutating them leaves ``p`` intact); tensors are shared."""
    fresh = dataclasses.replace(
        p,
        prompt_token_ids=list(p.prompt_token_ids),
        layers=[dict(layer) for layer in p.layers],
        scales=[dict(layer) for layer in p.scales] if p.scales is not None else None,
        meta=dict(p.meta),
    )
    return dataclasses.replace(fresh, **changes)


def with_tensor(p: KVPayload, layer: int, comp: str, t: object, field: str = "layers") -> KVPayload:
    q = clone(p)
    getattr(q, field)[layer][comp] = t
    return q


def malformed(p: KVPayload, vocab: int, max_len: int) -> list[tuple[str, object, str]]:
    """(label, malformed payload, field its error names) for one well-formed payload."""
    ids, ps, n = p.prompt_token_ids, p.page_size, p.num_pages
    k = p.layers[0]["k"]
    heads, dim = k.shape[2], k.shape[3]
    out: list[tuple[str, object, str]] = [("not a payload", {"request_id": "r"}, "KVPayload")]

    def add(label: str, field: str, q: KVPayload) -> None:
        out.append((label, q, field))

    for rid in (5, "", "x" * 257, "a\nb", None, b"rid"):
        add(f"request_id={rid!r:.20}", "request_id", clone(p, request_id=rid))
    for bad in ([], tuple(ids), "hello", None, [float(t) for t in ids], [True, *ids[1:]], [-1, *ids[1:]]):
        add(f"prompt {type(bad).__name__}", "prompt_token_ids", clone(p, prompt_token_ids=bad))
    for bad in (vocab, 10**30, "7"):
        add(f"prompt id {bad!r}", "prompt_token_ids", clone(p, prompt_token_ids=[*ids[:-1], bad]))
    add("prompt past max_model_len", "prompt_token_ids", clone(p, prompt_token_ids=[1] * max_len))
    for bad in (10**6, -1, vocab, True, 1.0, "5", None):
        add(f"first_token={bad!r}", "first_token", clone(p, first_token=bad))
    for bad in (-1, len(ids) + 1, True, 0.5, None):
        add(f"num_cached_tokens={bad!r}", "num_cached_tokens", clone(p, num_cached_tokens=bad))
    for bad in (ps * 2, ps // 2, str(ps), float(ps), None):
        add(f"page_size={bad!r}", "page_size", clone(p, page_size=bad))
    wrong_fmt = "bf16" if p.kv_format == "fp8_e4m3" else "fp8_e4m3"
    for bad in ("int4", "fp32", None, 5, "BF16", wrong_fmt):
        add(f"kv_format={bad!r}", "kv_format", clone(p, kv_format=bad))
    # page counts that do not match the tokens
    add("one more page of tokens", "layers", clone(p, prompt_token_ids=ids + [1] * ps))
    if n > 1:
        add("one page of tokens less", "layers", clone(p, prompt_token_ids=ids[:-ps], num_cached_tokens=0))
    add("a page short", "layers", clone(p, layers=[{c: t[:-1] for c, t in la.items()} for la in p.layers]))
    longer = [
        {c: torch.zeros((n + 1, *t.shape[1:]), dtype=t.dtype) for c, t in la.items()} for la in p.layers
    ]
    add("a page extra", "layers", clone(p, layers=longer))
    # layers and components
    add("a layer short", "layers", clone(p, layers=p.layers[:-1]))
    add("a layer extra", "layers", clone(p, layers=[*p.layers, p.layers[0]]))
    add("layers a tuple", "layers", clone(p, layers=tuple(p.layers)))
    add("no layers", "layers", clone(p, layers=[]))
    add("layers None", "layers", clone(p, layers=None))
    q = clone(p)
    del q.layers[3]["v"]
    add("a component missing", "layers[3]", q)
    add("an extra component", "layers[0]", with_tensor(p, 0, "x", k))
    q = clone(p)
    q.layers[2] = list(q.layers[2].values())
    add("a layer as a list", "layers[2]", q)
    q = clone(p)
    q.layers[1] = {c.upper(): t for c, t in q.layers[1].items()}
    add("components renamed", "layers[1]", q)
    # tensors: dtype, shape, kind, device
    for dt in (torch.float16, torch.float64, torch.int8, torch.uint8, torch.bfloat16, torch.float32):
        if dt != k.dtype:
            add(f"one tensor {dt}", "dtype", with_tensor(p, 4, "k", k.float().to(dt)))
    half = [{c: t.float().half() for c, t in la.items()} for la in p.layers]
    add("all tensors float16", "dtype", clone(p, layers=half))
    add("fewer heads", "shape", with_tensor(p, 0, "k", k[:, :, : heads - 1]))
    add("shorter head_dim", "shape", with_tensor(p, 0, "v", k[..., : dim // 2]))
    add("half pages", "shape", with_tensor(p, 5, "k", k[:, : ps // 2]))
    add("3-D pages", "shape", with_tensor(p, 0, "k", k.flatten(2)))
    add("transposed pages", "shape", with_tensor(p, 0, "k", k.transpose(2, 3)))
    add("a scalar", "shape", with_tensor(p, 0, "k", torch.zeros((), dtype=k.dtype)))
    add("a list", "dense tensor", with_tensor(p, 0, "k", [[1.0]]))
    add("a numpy array", "dense tensor", with_tensor(p, 0, "k", k.float().numpy()))
    add("None", "dense tensor", with_tensor(p, 1, "v", None))
    add("a sparse tensor", "dense tensor", with_tensor(p, 0, "k", k.float().to_sparse()))
    meta_k = torch.empty(k.shape, dtype=k.dtype, device="meta")
    add("a meta tensor", "tensor on meta", with_tensor(p, 0, "k", meta_k))
    # FP8 scales
    if p.scales is None:
        fake = [{c: torch.ones(heads) for c in la} for la in p.layers]
        add("scales on non-FP8 pages", "scales", clone(p, scales=fake))
        add("empty scales on non-FP8 pages", "scales", clone(p, scales=[]))
    else:
        c0 = next(iter(p.scales[0]))  # a component with static scales ("v" beside per-token K scales)
        s = p.scales[0][c0]
        add("FP8 without scales", "scales", clone(p, scales=None))
        add("scales a layer short", "scales", clone(p, scales=p.scales[:-1]))
        add("scales a dict", "scales", clone(p, scales={c0: s}))
        q = clone(p)
        del q.scales[2][c0]
        add("a scale component missing", "scales[2]", q)
        for label, t in (
            ("one head more", torch.ones(heads + 1)),
            ("2-D", s[None]),
            ("float64", s.double()),
            ("bfloat16", s.bfloat16()),
            ("NaN", torch.full_like(s, float("nan"))),
            ("inf", torch.full_like(s, float("inf"))),
            ("zero", torch.zeros_like(s)),
            ("negative", -s),
            ("a list", s.tolist()),
            ("meta", torch.empty_like(s, device="meta")),
        ):
            add(f"scale {label}", "scales[1]", with_tensor(p, 1, c0, t, "scales"))
    if "k.scale" in p.layers[0]:  # per-token K scales beside the pages
        ks = p.layers[0]["k.scale"]
        q = clone(p)
        del q.layers[4]["k.scale"]
        add("per-token scales missing in one layer", "layers[4]", q)
        q = clone(p, layers=[{c: t for c, t in la.items() if c != "k.scale"} for la in p.layers])
        add("per-token K scales missing, no static K scale", "scales[0]", q)
        add("static K scale beside per-token ones", "scales[0]", clone(p, scales=[
            {**la, "k": torch.ones(heads)} for la in p.scales
        ]))  # fmt: skip
        add("per-token scales for an unknown component", "layers[0]", with_tensor(p, 0, "x.scale", ks))
        for label, t in (
            ("float32", ks.float()),
            ("a page short", ks[:-1]),
            ("one head more", torch.ones(n, ps, heads + 1, dtype=ks.dtype)),
            ("2-D", ks.flatten(1)),
            ("NaN", torch.full_like(ks, float("nan"))),
            ("inf", torch.full_like(ks, float("inf"))),
            ("negative", -ks - 1),
            ("a list", ks.tolist()),
            ("meta", torch.empty_like(ks, device="meta")),
        ):
            add(f"per-token scale {label}", "layers[2]['k.scale']", with_tensor(p, 2, "k.scale", t))
    else:
        fake = torch.ones(n, ps, heads, dtype=torch.bfloat16)
        add("per-token scales on non-FP8 pages", "not FP8", with_tensor(p, 0, "k.scale", fake))
    # generator state
    good = torch.Generator().manual_seed(3).get_state()
    rng = torch.Generator().manual_seed(1)
    for size in (0, 16, 5055, 5057, 2 * GENERATOR_STATE_BYTES):  # the wrong sizes of the probe and more
        add(f"generator {size} bytes", "generator_state", clone(p, generator_state=zeros_u8(size)))
    for label, st in (
        ("int64", good.long()),
        ("2-D", good.view(2, -1)),
        ("float", good.float()),
        ("zeros", torch.zeros_like(good)),
        ("random bytes", torch.randint(0, 256, good.shape, dtype=torch.uint8, generator=rng)),
        ("a list", good.tolist()),
        ("bytes", bytes(good.tolist())),
        ("meta", torch.empty_like(good, device="meta")),
    ):
        add(f"generator {label}", "generator_state", clone(p, generator_state=st))
    # metadata the integrity audit reads
    for bad in (None, [], {"page_checksums": "abc"}, {"page_checksums": [1.5] * n}):
        add(f"meta {bad!r:.30}", "meta", clone(p, meta=bad))
    return out


def test_malformed_handoffs_are_refused_before_allocating(engines):
    """Hundreds of malformed payloads: each a RequestError naming its field, no page kept, no trace."""
    pre, pre8, dec = engines
    vocab, max_len = dec.model_config.vocab_size, dec.max_model_len
    bf16, fp8 = prefilled(pre), prefilled(pre8)
    assert bf16.kv_format == "bf16" and fp8.kv_format == "fp8_e4m3" and fp8.scales is not None
    cases = malformed(bf16, vocab, max_len) + malformed(fp8, vocab, max_len)
    rng = random.Random(0)
    for _ in range(150):  # random generator-state sizes around the real one
        size = rng.choice(
            [rng.randrange(GENERATOR_STATE_BYTES), GENERATOR_STATE_BYTES + 1 + rng.randrange(999)]
        )
        cases.append((f"generator {size}", clone(bf16, generator_state=zeros_u8(size)), "generator_state"))
    assert len(cases) > 300
    for label, payload, field in cases:
        with pytest.raises(RequestError) as err:
            dec.add_prefilled(payload, SEEDED)
        assert field in str(err.value), (label, str(err.value))
        assert_no_trace(dec)
    # the well-formed payloads were never touched and still decode
    for payload in (bf16, fp8):
        rid = dec.add_prefilled(payload, GREEDY)
        assert dec.run_until_done()[rid].finish_reason == "length"
    assert_no_trace(dec)


def test_valid_handoff_decodes_token_for_token_like_one_engine(engines):
    """Greedy and seeded (with the largest seed) handoffs match the in-process prefill -> decode path."""
    single, dec = engines[0], engines[2]
    for params in (GREEDY, SEEDED):
        rid = uncached(single).add_request(PROMPT, params)
        want = single.run_until_done()[rid]
        payload = prefilled(single, params)
        assert (payload.generator_state is not None) == (params.seed is not None)
        did = dec.add_prefilled(payload, params)
        got = dec.run_until_done()[did]
        assert got.token_ids == want.token_ids and got.text == want.text
    assert_no_trace(dec)


def test_capacity_is_checked_before_allocating(engines):
    pre, dec = engines[0], engines[2]
    payload = prefilled(pre)
    hold = dec.decode_pool.allocate_pages(dec.decode_pool.num_free - payload.num_pages + 1)
    try:
        with pytest.raises(CapacityError, match="free pages"):
            dec.add_prefilled(payload, GREEDY)
        assert dec.decode_pool.num_used == len(hold) and not dec._requests
    finally:
        dec.decode_pool.release_all(hold)
    rids = [dec.add_prefilled(clone(payload, request_id="seat0"), GREEDY)]
    with pytest.raises(RequestError, match="already in flight"):
        dec.add_prefilled(clone(payload, request_id="seat0"), GREEDY)
    rids.append(dec.add_prefilled(clone(payload, request_id="seat1"), GREEDY))
    used = dec.decode_pool.num_used
    with pytest.raises(CapacityError, match="max_num_seqs"):
        dec.add_prefilled(clone(payload, request_id="third"), GREEDY)
    assert dec.decode_pool.num_used == used
    assert set(dec.run_until_done()) == set(rids)
    with pytest.raises(RequestError, match="decode KV cache capacity"):
        dec.add_prefilled(
            payload, SamplingParams(max_tokens=dec.decode_pool.capacity_tokens, temperature=0.0)
        )
    assert_no_trace(dec)


def zeros_u8(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.uint8)


def _raise(*args, **kwargs):
    raise RuntimeError("injected failure")


def test_failure_after_allocation_releases_every_page(engines, monkeypatch):
    """Conversion, generator state, stop check, scheduling and the early-finish output each fail once."""
    pre, dec = engines[0], engines[2]
    payload = prefilled(pre, SEEDED)
    with monkeypatch.context() as m:
        m.setattr(handoff, "convert_into", _raise)
        with pytest.raises(RuntimeError, match="injected"):
            dec.add_prefilled(payload, SEEDED)
    assert_no_trace(dec)
    with monkeypatch.context() as m:  # a state that passes the checks but not the generator
        m.setattr(handoff, "_check_generator_state", lambda state: None)
        bad = clone(payload, generator_state=zeros_u8(GENERATOR_STATE_BYTES))
        with pytest.raises(RuntimeError, match="mt19937"):
            dec.add_prefilled(bad, SEEDED)
    assert_no_trace(dec)
    with monkeypatch.context() as m:
        m.setattr(RequestState, "check_stop", _raise)
        with pytest.raises(RuntimeError, match="injected"):
            dec.add_prefilled(payload, SEEDED)
    assert_no_trace(dec)
    with monkeypatch.context() as m:
        m.setattr(dec.scheduler, "add_running", _raise)
        with pytest.raises(RuntimeError, match="injected"):
            dec.add_prefilled(payload, SEEDED)
    assert_no_trace(dec)
    with monkeypatch.context() as m:  # max_tokens=1: the first token ends it, its output fails
        m.setattr(RequestState, "output", _raise)
        with pytest.raises(RuntimeError, match="injected"):
            dec.add_prefilled(payload, dataclasses.replace(SEEDED, max_tokens=1))
    assert_no_trace(dec)
    rid = dec.add_prefilled(payload, SEEDED)  # and the same payload still goes through
    assert dec.run_until_done()[rid].finish_reason == "length"
    assert_no_trace(dec)


def test_check_payload_accepts_what_payload_of_builds(engines):
    pre, pre8, dec = engines
    for engine in (pre, pre8):
        p = prefilled(engine, SEEDED)
        n = handoff.check_payload(p, dec.decode_pool, dec.model_config.vocab_size, dec.max_model_len)
        assert n == p.num_pages == -(-len(p.prompt_token_ids) // dec.decode_pool.page_size)
        assert p.generator_state.numel() == GENERATOR_STATE_BYTES
