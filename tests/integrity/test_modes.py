"""Integrity modes on a real engine: off runs nothing, audit catches corrupted sealed pages."""

from __future__ import annotations

import pytest

from pagoda.node_agent.engine.integrity import IntegrityCounters, IntegrityError
from pagoda.node_agent.params import SamplingParams

from .engine_helpers import PARAMS, guard_reads, run_all

KV = 40 << 20
# long enough for two sealed 16-token pages
SHARED = "You are a careful assistant. Answer briefly and precisely, in plain words, without lists. " * 2


def test_off_runs_no_check_and_matches_enforce(make_engine):
    outs = {}
    for mode in ("enforce", "off"):
        eng = make_engine(kv_memory=KV, integrity=mode)
        outs[mode] = {rid: o.token_ids for rid, o in run_all(eng).items()}
        c = eng.integrity.counters
        if mode == "off":
            assert c == IntegrityCounters()
        else:
            assert c.checks > 0 and c.pages_checked > 0 and c.mismatches == 0
    assert outs["off"] == outs["enforce"]


def test_audit_fails_a_request_reusing_a_corrupted_page_and_recovers(make_engine):
    eng = make_engine(kv_memory=KV, integrity="audit", fault_injection=True)
    guard_reads(eng)
    prompt = SHARED + "What is the capital of France?"
    first = run_all(eng, [prompt], prefix="a")["a0"]
    assert first.finish_reason == "length" and eng.integrity.counters.pages_audited >= 2
    reused = run_all(eng, [prompt], prefix="b")["b0"]
    assert reused.num_cached_tokens >= 32 and reused.token_ids == first.token_ids
    fault = eng.faults.corrupt_sealed_page()
    bad = run_all(eng, [prompt], prefix="c")["c0"]
    assert bad.finish_reason == "error" and "audit failed" in bad.error and f"page {fault.page}" in bad.error
    c = eng.integrity.counters
    assert c.checksum_mismatches == 1 and c.mismatches == 0 and c.requests_aborted == 1
    assert fault.page not in eng.prefill_pool.page_hash  # never handed out again
    again = run_all(eng, [prompt], prefix="d")["d0"]
    assert again.finish_reason == "length" and again.token_ids == first.token_ids
    eng.decode_pool.check_idle()


def test_audit_verifies_handoff_payloads(make_engine):
    eng = make_engine(kv_memory=KV, integrity="audit")
    eng.add_request(SHARED + "Name a colour.", PARAMS, request_id="p", prefill_only=True)
    payload = eng.run_until_done()["p"].kv_payload
    assert len(payload.meta["page_checksums"]) == payload.num_pages
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    eng.add_prefilled(payload, params, request_id="ok")
    assert eng.run_until_done()["ok"].finish_reason == "length"
    raw = payload.layers[3]["v"][0].view(-1)
    raw[5] += 1.0
    with pytest.raises(IntegrityError, match="handoff pages \\[0\\]"):
        eng.add_prefilled(payload, params, request_id="bad")
    assert eng.integrity.counters.checksum_mismatches == 1
    eng.decode_pool.check_idle()
