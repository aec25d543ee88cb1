"""Continuous batching, chunked prefill and preemption never change greedy output."""

from __future__ import annotations

import pytest

from pagoda.node_agent.engine.kv_setup import kv_components
from pagoda.node_agent.params import SamplingParams

from .prompts import CHAT_PROMPTS, PLAIN_PROMPTS

PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def run_all_at_once(engine, prompts):
    rids = [engine.add_request(p, PARAMS) for p in prompts]
    final = engine.run_until_done()
    return [final[r].token_ids for r in rids]


def run_one_at_a_time(engine, prompts):
    out = []
    for p in prompts:
        rid = engine.add_request(p, PARAMS)
        out.append(engine.run_until_done()[rid].token_ids)
    return out


def run_staggered(engine, prompts):
    """A new prompt arrives every third step while the earlier ones decode."""
    pending = list(prompts)
    rids: list[str] = []
    final = {}
    steps = 0
    while pending or engine.has_unfinished():
        if pending and steps % 3 == 0:
            rids.append(engine.add_request(pending.pop(0), PARAMS))
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o
        steps += 1
    return [final[r].token_ids for r in rids]


@pytest.fixture(scope="module")
def prompts(engine):
    chat = [engine.tokenize(p, chat=True) for p in CHAT_PROMPTS]
    return chat + PLAIN_PROMPTS


@pytest.fixture(scope="module")
def reference(engine, prompts):
    return run_one_at_a_time(engine, prompts)


def test_all_at_once_equals_one_at_a_time(engine, prompts, reference):
    assert run_all_at_once(engine, prompts) == reference
    engine.decode_pool.check_idle()


def test_staggered_arrivals_equal_one_at_a_time(engine, prompts, reference):
    assert run_staggered(engine, prompts) == reference
    engine.decode_pool.check_idle()


def test_small_prefill_chunks_equal(make_engine, prompts, reference):
    eng = make_engine(max_num_batched_tokens=16, enable_prefix_caching=False)
    assert run_all_at_once(eng, prompts) == reference


@pytest.mark.slow
def test_preemption_under_tiny_kv_budget_keeps_output(make_engine, prompts, reference):
    # 8 sequences of ~50-60 tokens need ~30 pages; give the pool 12 pages so decode must preempt.
    from pagoda.node_agent.kv.pool import KVPagePool

    probe = make_engine(kv_memory=1 << 20)
    per_page = KVPagePool.bytes_per_page(
        probe.model_config.num_layers, 16, kv_components(probe.model_config), probe.dtype
    )
    eng = make_engine(kv_memory=12 * per_page, max_num_batched_tokens=64)
    assert eng.decode_pool.num_pages == 12
    got = run_all_at_once(eng, prompts)
    assert eng.scheduler.num_preemptions > 0, "the budget was meant to force preemption"
    assert got == reference
    eng.decode_pool.check_idle()
