"""Faults injected into a real engine: only the affected request fails, others are unchanged."""

from __future__ import annotations

import random

import pytest

from pagoda.node_agent.engine.fault_injection import FaultInjectionError

from .engine_helpers import PARAMS, PROMPTS, guard_reads, run_all

KV = 40 << 20  # ~56 float32 pages of 16 tokens: room for every prompt, no preemption


@pytest.fixture(scope="module")
def baseline(make_engine):
    eng = make_engine(kv_memory=KV, enable_prefix_caching=False)
    return {rid: o.token_ids for rid, o in run_all(eng).items()}


@pytest.fixture(scope="module")
def faulty(make_engine):
    return make_engine(kv_memory=KV, enable_prefix_caching=False, fault_injection=True)


def test_faults_are_unreachable_unless_enabled(make_engine):
    eng = make_engine(kv_memory=KV)
    assert not eng.faults.enabled
    with pytest.raises(FaultInjectionError, match="disabled"):
        eng.faults.stale_mapping("x")


@pytest.mark.parametrize("kind,trials", [("stale_mapping", 10), ("flip_tag", 3)])
def test_injected_faults_fail_only_their_request(faulty, baseline, kind, trials):
    rng = random.Random(len(kind))
    reads = guard_reads(faulty)
    for t in range(trials):
        for i, p in enumerate(PROMPTS):
            faulty.add_request(p, PARAMS, request_id=str(i))
        for _ in range(rng.randint(1, 5)):
            faulty.step()
        live = [rid for rid, tr in faulty._requests.items() if tr.seq.block_table]
        victim = rng.choice(live)
        getattr(faulty.faults, kind)(victim)
        final = faulty.run_until_done()
        assert final[victim].finish_reason == "error"
        assert "KV integrity check failed" in final[victim].error
        assert final[victim].text == "" and final[victim].delta == ""
        for rid, out in final.items():
            if rid != victim:
                assert out.finish_reason == "length" and out.token_ids == baseline[rid], (t, rid)
        faulty.decode_pool.check_idle()
    assert faulty.scheduler.num_preemptions == 0 and reads
    c = faulty.integrity.counters
    assert c.requests_aborted >= trials and c.mismatches >= trials
