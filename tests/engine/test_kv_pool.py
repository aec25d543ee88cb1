"""Page accounting: free list, reference counts, tags bumped on every reallocation, prefix index."""

from __future__ import annotations

import random

import pytest
import torch

from pagoda.node_agent.engine.kv_setup import kv_components
from pagoda.node_agent.kv.pool import KVPagePool, OutOfPages
from pagoda.node_agent.params import SamplingParams

COMPS = {"k": (2, 8), "v": (2, 8)}


def make_pool(pages: int = 8, dtype=torch.float32) -> KVPagePool:
    return KVPagePool(num_layers=2, num_pages=pages, page_size=4, components=COMPS, dtype=dtype)


def test_every_allocation_bumps_the_tag():
    pool = make_pool(2)
    seen: dict[int, set[int]] = {0: set(), 1: set()}
    for _ in range(50):
        ref = pool.allocate()
        assert ref.tag not in seen[ref.page], "a reallocated page reused an old tag"
        assert ref.tag != 0 and int(pool.tag_table[ref.page]) == ref.tag
        seen[ref.page].add(ref.tag)
        pool.release(ref.page)
    pool.check_idle()


def test_out_of_pages_and_double_free():
    pool = make_pool(2)
    a, b = pool.allocate(), pool.allocate()
    with pytest.raises(OutOfPages):
        pool.allocate()
    pool.release(a.page)
    with pytest.raises(RuntimeError, match="double free"):
        pool.release(a.page)
    pool.release(b.page)
    pool.check_idle()


def test_shared_prefix_pages_keep_their_tag_and_evict_lru():
    pool = make_pool(3)
    a = pool.allocate()
    pool.seal(a.page, b"h1")
    hit = pool.lookup(b"h1")
    assert hit == a and pool.refcount[a.page] == 2  # shared, same tag
    pool.release(a.page)
    pool.release(a.page)
    assert pool.num_free == 3 and a.page in pool.evictable  # cached, not free
    again = pool.lookup(b"h1")
    assert again.tag == a.tag  # reused from cache: not a reallocation
    pool.release(again.page)
    refs = [pool.allocate() for _ in range(3)]  # forces eviction of the cached page
    assert pool.lookup(b"h1") is None
    assert any(r.page == a.page and r.tag != a.tag for r in refs)
    pool.release_all(refs)
    pool.check_idle()


def test_fp8_capacity_is_twice_bf16_with_scales_and_tags():
    budget = 64 << 20
    n_bf16 = KVPagePool.pages_for_budget(budget, 30, 16, {"k": (3, 64), "v": (3, 64)}, torch.bfloat16)
    n_fp8 = KVPagePool.pages_for_budget(budget, 30, 16, {"k": (3, 64), "v": (3, 64)}, torch.float8_e4m3fn)
    assert n_fp8 / n_bf16 >= 1.95
    pool = KVPagePool(30, n_fp8, 16, {"k": (3, 64), "v": (3, 64)}, torch.float8_e4m3fn)
    assert pool.total_bytes <= budget


def test_engine_returns_every_page_after_mixed_outcomes(make_engine):
    """Finished, aborted, preempted and stop-string requests all give their pages back."""
    from pagoda.node_agent.kv.pool import KVPagePool as Pool

    probe = make_engine(kv_memory=1 << 20)
    per_page = Pool.bytes_per_page(
        probe.model_config.num_layers, 16, kv_components(probe.model_config), probe.dtype
    )
    eng = make_engine(kv_memory=10 * per_page, max_num_batched_tokens=32)
    tags_before = list(eng.decode_pool._tags)
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "ember"]
    rids = []
    for i in range(10):
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(3, 40)))
        params = SamplingParams(
            max_tokens=rng.randint(2, 20),
            temperature=rng.choice([0.0, 0.8]),
            seed=i,
            stop=["gamma"] if i % 4 == 0 else [],
        )
        rids.append(eng.add_request(prompt, params))
    aborted = set(rids[1::3])
    steps = 0
    finals = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                finals[o.request_id] = o
        steps += 1
        if steps == 3:
            for rid in aborted:
                out = eng.abort(rid)
                assert out is None or out.finish_reason == "abort"
    assert set(finals) | aborted == set(rids)
    assert eng.scheduler.num_preemptions > 0
    eng.scheduler.prefill_pool.clear_prefix_cache()
    eng.decode_pool.check_idle()
    changed = [p for p, t in enumerate(eng.decode_pool._tags) if t != tags_before[p]]
    assert len(changed) == eng.decode_pool.num_pages  # every page was (re)allocated at least once
    assert eng.decode_pool.allocations > eng.decode_pool.num_pages


def test_preempting_a_sequence_whose_expected_tag_was_flipped_leaks_no_page(make_engine):
    """Preemption releases like the fail-closed path: a page whose reference's tag was corrupted is
    still this sequence's (no other table accounts for it), so it goes back to the pool."""
    from pagoda.node_agent.kv.allocator import PageRef

    eng = make_engine(kv_memory=16 << 20)
    eng.add_request("one two three four five six seven eight nine ten", SamplingParams(max_tokens=4))
    eng.step()
    (seq,) = eng.scheduler.running
    ref = seq.block_table[0]
    seq.block_table[0] = PageRef(ref.page, ref.tag ^ 1)
    eng.scheduler._preempt(seq)
    eng.scheduler.waiting.remove(seq)
    for pool in {eng.scheduler.prefill_pool, eng.decode_pool}:
        pool.clear_prefix_cache()
        pool.check_idle()


def test_per_token_k_scales_live_beside_the_pages_and_keep_195x():
    """Per-token K scales (bfloat16, per token and KV head) are a page tensor of every layer, what
    the model reads as K's scales; V keeps a static per-head scale. SmolLM2's shape still holds
    >= 1.95x the bf16 tokens (390 vs 768 bytes per token and layer)."""
    comps = {"k": (3, 64), "v": (3, 64)}
    per_layer = KVPagePool.bytes_per_page(1, 16, comps, torch.float8_e4m3fn, ("k",)) - 4
    assert per_layer == 16 * (2 * 3 * 64 + 3 * 2)
    budget = 64 << 20
    n_bf16 = KVPagePool.pages_for_budget(budget, 30, 16, comps, torch.bfloat16)
    n_tok = KVPagePool.pages_for_budget(budget, 30, 16, comps, torch.float8_e4m3fn, ("k",))
    assert 1.95 <= n_tok / n_bf16 < 2.0
    pool = KVPagePool(30, n_tok, 16, comps, torch.float8_e4m3fn, token_scaled=("k",))
    assert pool.total_bytes <= budget
    for layer in range(30):
        ks = pool.layer_cache(layer)["k.scale"]
        assert ks.shape == (n_tok, 16, 3) and ks.dtype == torch.bfloat16
        scales = pool.layer_scales(layer)
        assert scales["k"] is ks and scales["v"].shape == (3,) and set(pool.static_scales[layer]) == {"v"}
        assert pool.scales[layer] is scales


def test_token_scaled_needs_fp8_and_a_known_component():
    pool = KVPagePool(2, 4, 4, COMPS, torch.float32, token_scaled=("k",))
    assert pool.token_scaled == () and set(pool.layer_cache(0)) == {"k", "v"} and pool.layer_scales(0) == {}
    with pytest.raises(ValueError, match="token_scaled"):
        KVPagePool(2, 4, 4, COMPS, torch.float8_e4m3fn, token_scaled=("latent",))


def test_granularity_picks_the_per_token_components():
    from pagoda.node_agent.engine.kv_setup import token_scaled_components

    gqa = {"k": (3, 64), "v": (3, 64)}
    mla = {"latent": (1, 512), "rope_k": (1, 64)}
    assert token_scaled_components("fp8_e4m3", "per-token-k", gqa) == ("k",)
    assert token_scaled_components("fp8_e4m3", "per-head", gqa) == ()
    assert token_scaled_components("fp8_e4m3", "per-tensor", gqa) == ()
    assert token_scaled_components("fp8_e4m3", "per-token-k", mla) == ()  # MLA: static per-layer scales
    for g in ("per-token-k", "per-head", "per-tensor"):  # int8 scales everything per token; bf16 nothing
        assert token_scaled_components("int8", g, gqa) == ("k", "v")
        assert token_scaled_components("int8", g, mla) == ("latent", "rope_k")
        assert token_scaled_components("bf16", g, gqa) == ()
