"""Refusing at load what does not fit: KV budgets below one page or one max-length sequence (real
engines on the CPU), and the weight estimate against a device's free memory (CUDA decision with a
stubbed free-memory figure: the decision is the same code a GPU runs, only the number is faked)."""

from __future__ import annotations

import logging

import pytest
import torch

from pagoda.node_agent.engine.config import ConfigError, EngineConfig, PhaseFormats
from pagoda.node_agent.engine.memory import (
    WeightEstimate,
    check_weights_fit,
    estimate_weight_bytes,
    phase_weight_formats,
)
from pagoda.node_agent.models.config import ModelLoadError


def _kv_per_token_per_layer(cfg) -> int:
    return 2 * cfg.num_kv_heads * cfg.head_dim * 4  # K and V, float32 pages on a float32 CPU engine


def test_a_budget_below_one_page_is_refused_naming_the_bytes(make_engine, builtin_loaded) -> None:
    cfg = builtin_loaded.config
    with pytest.raises(ConfigError) as err:
        make_engine(kv_memory=10_000)
    msg = str(err.value)
    per_layer = _kv_per_token_per_layer(cfg)
    per_page = 16 * cfg.num_layers * per_layer + 4
    assert "below one page" in msg and f"{per_layer} bytes per token per layer" in msg
    assert "(10000 bytes)" in msg and f"({per_page} bytes)" in msg


def test_an_automatic_budget_must_hold_one_max_length_sequence(make_engine, builtin_loaded) -> None:
    """The CPU default budget (the engine's choice) under an explicit max_model_len it cannot hold."""
    cfg = builtin_loaded.config
    budget = 4 << 20
    per_page = 16 * cfg.num_layers * _kv_per_token_per_layer(cfg) + 4
    fits = budget // per_page * 16
    with pytest.raises(ConfigError) as err:
        make_engine(kv_memory=None, cpu_kv_default=budget, max_model_len=2048)
    msg = str(err.value)
    assert f"holds {fits} tokens, less than one 2048-token sequence" in msg
    assert f"({budget} bytes)" in msg and f"--max-model-len to at most {fits}" in msg
    assert f"({128 * per_page} bytes)" in msg  # what one 2048-token sequence needs: 128 pages


def test_a_configured_budget_shorter_than_a_sequence_serves_with_a_warning(make_engine, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="pagoda.engine"):
        engine = make_engine(kv_memory=2 << 20, max_model_len=256)
    assert engine.decode_pool.capacity_tokens < 256
    assert (
        f"a request needing more than {engine.decode_pool.capacity_tokens} tokens is refused" in caplog.text
    )


def test_weight_estimate_matches_what_the_built_model_holds(builtin_loaded, engine, int4_fp8_engine) -> None:
    for eng in (engine, int4_fp8_engine):
        est = estimate_weight_bytes(
            builtin_loaded.weights,
            phase_weight_formats(eng.config),
            eng.dtype,
            eng.config.int4_group_size,
            decode_head_format=eng.model.decode_head_format,
        )
        held = eng.model.weight_bytes()
        assert est.total == sum(est.by_format.values())
        assert abs(est.total - held["total"]) <= 0.02 * held["total"], (est, held)
        for fmt in ("int4", "bf16"):
            if fmt in held["by_format"]:
                assert abs(est.by_format[fmt] - held["by_format"][fmt]) <= 0.05 * held["by_format"][fmt]


def test_weight_estimate_counts_each_phase_format_once(builtin_loaded) -> None:
    w = builtin_loaded.weights
    one = estimate_weight_bytes(w, {"prefill": "fp8", "decode": "fp8"}, torch.bfloat16)
    two = estimate_weight_bytes(w, {"prefill": "bf16", "decode": "fp8"}, torch.bfloat16)
    assert two.by_format["bf16"] > one.by_format["bf16"]  # the prefill phase adds a dense copy
    assert two.by_format["fp8"] == one.by_format["fp8"]
    assert two.total > one.total
    odd = type("Packed", (), {"nbytes": 7})()  # a weight object of unknown layout counts as stored
    assert (
        estimate_weight_bytes({"x.weight": odd}, {"prefill": "int4", "decode": "int4"}, torch.float32).total
        == 7
    )
    role = EngineConfig(formats=PhaseFormats("bf16", "bf16", "int4", "fp8_e4m3"), role="decode")
    assert phase_weight_formats(role) == {"prefill": "int4", "decode": "int4"}


def test_cuda_refuses_weights_larger_than_free_memory() -> None:
    """Stubbed free memory: the same decision a GPU would take, on any machine."""
    est = WeightEstimate(10 << 30, {"bf16": 2 << 30, "int4": 8 << 30})
    cuda = torch.device("cuda", 0)
    with pytest.raises(ModelLoadError) as err:
        check_weights_fit(est, cuda, free_bytes=lambda d: (6 << 30) + 5)
    msg = str(err.value)
    assert "need 10.00 GiB (10737418240 bytes) on cuda:0" in msg
    assert "only 6.00 GiB (6442450949 bytes) is free" in msg and "int4 8.00 GiB" in msg
    check_weights_fit(est, cuda, free_bytes=lambda d: 10 << 30)  # exactly enough
    check_weights_fit(est, torch.device("cpu"), free_bytes=lambda d: 0)  # no check on the CPU
