"""An fp8_e4m3 or int8 KV pool holds about twice the tokens of a bf16 one in the same bytes."""

from __future__ import annotations

import pytest
import torch

from pagoda.node_agent.bench.formats import kv_capacity
from pagoda.node_agent.engine.kv_setup import kv_components, token_scaled_components
from pagoda.node_agent.kv.pool import KVPagePool


@pytest.mark.parametrize("budget", [8 << 20, 64 << 20, 1 << 30])
def test_fp8_capacity_vs_bf16(builtin_loaded, budget: int) -> None:
    cfg = builtin_loaded.config
    bf16 = kv_capacity(cfg, budget, 16, "bf16")
    fp8 = kv_capacity(cfg, budget, 16, "fp8_e4m3")
    int8 = kv_capacity(cfg, budget, 16, "int8")
    assert fp8["tokens"] >= 1.95 * bf16["tokens"]
    # int8 pays a 2-byte scale per token and head for V too: 396 bytes per token and layer, not 390
    assert int8["tokens"] >= 1.93 * bf16["tokens"] and int8["tokens"] <= fp8["tokens"]
    assert int8["bytes_per_token_per_layer"] + int8["token_scale_bytes_per_token_per_layer"] == 396
    assert bf16["bytes_per_token"] == cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2 + 4 / 16


def test_capacity_is_what_real_pools_hold_in_the_budget(builtin_loaded) -> None:
    """The figures are exact: real pools of that many pages fit the budget (tags, scales included)."""
    cfg, budget = builtin_loaded.config, 8 << 20
    comps = kv_components(cfg)
    for fmt, dt, granularity in (
        ("bf16", torch.bfloat16, "per-token-k"),
        ("fp8_e4m3", torch.float8_e4m3fn, "per-token-k"),  # the default: K scales per token
        ("fp8_e4m3", torch.float8_e4m3fn, "per-head"),
        ("int8", torch.int8, "per-head"),  # int8 scales K and V per token whatever the granularity
    ):
        cap = kv_capacity(cfg, budget, 16, fmt, granularity)
        scaled = token_scaled_components(fmt, granularity, comps)
        kw = {"kv_format": fmt, "token_scaled": scaled}
        pool = KVPagePool(cfg.num_layers, cap["pages"], 16, comps, dt, **kw)
        assert pool.capacity_tokens == cap["tokens"]
        assert pool.total_bytes <= budget
        one_more = KVPagePool(cfg.num_layers, cap["pages"] + 1, 16, comps, dt, **kw)
        assert one_more.total_bytes > budget
