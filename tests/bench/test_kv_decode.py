"""bench kv --decode-heavy: the budget it sizes makes the scenario KV-bound for bf16 only."""

from __future__ import annotations

from pagoda.node_agent.bench.formats import ONE_BYTE_KV, kv_capacity
from pagoda.node_agent.bench.kv_decode import decode_heavy_budget


def test_budget_holds_every_stream_in_one_byte_formats_and_about_half_in_bf16(builtin_loaded):
    mc, streams, seq_tokens, page = builtin_loaded.config, 16, 16 + 128, 16
    budget = decode_heavy_budget(mc, streams, seq_tokens, page, "per-token-k")
    pages_per_seq = -(-seq_tokens // page)
    held = {f: kv_capacity(mc, budget, page, f)["pages"] // pages_per_seq for f in ("bf16", *ONE_BYTE_KV)}
    for f in ONE_BYTE_KV:
        assert streams <= held[f] <= streams + 1, held
    assert 0.4 * streams <= held["bf16"] <= 0.6 * streams, held
