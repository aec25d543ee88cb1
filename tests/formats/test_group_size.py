"""The INT4 group size is configurable and falls back to a size dividing each layer's input dim."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from pagoda.node_agent.cli.quantize import group_size_arg
from pagoda.node_agent.engine.config import ConfigError, EngineConfig, PhaseFormats
from pagoda.node_agent.engine.llm_engine import LLMEngine
from pagoda.node_agent.models.int4_quant import layer_group_size

INT4_DECODE = PhaseFormats("bf16", "bf16", "int4", "bf16")


def _groups(engine) -> dict[str, int]:
    layer = engine.model.layers[0]  # o_proj and down_proj: never fused with another projection
    return {
        name: lin.by_phase["decode"].weight.group_size
        for name, lin in (("o_proj", layer.o_proj), ("down_proj", layer.mlp.down_proj))
    }


@pytest.fixture(scope="module")
def dense_engine(builtin_loaded, builtin_tokenizer):
    """``make(**EngineConfig)`` over the built-in weights made dense: the engine quantizes them itself
    (the loader may give the GGUF's Q4_1 blocks as INT4 weights, which keep their group 32)."""
    weights = {
        k: v if isinstance(v, torch.Tensor) else v.dequantize() for k, v in builtin_loaded.weights.items()
    }
    loaded = dataclasses.replace(builtin_loaded, weights=weights)

    def make(**kw) -> LLMEngine:
        cfg = EngineConfig(
            model="builtin://smollm2-135m",
            dtype="float32",
            formats=INT4_DECODE,
            kv_memory=4 << 20,
            kernel_backend="reference",
            **kw,
        )
        return LLMEngine(cfg, loaded=loaded, tokenizer=builtin_tokenizer)

    return make


@pytest.mark.slow
def test_default_and_explicit_group_sizes(dense_engine):
    # SmolLM2: o_proj has K=576 (128 does not divide it: 64), down_proj K=1536 (128)
    assert _groups(dense_engine()) == {"o_proj": 64, "down_proj": 128}
    assert _groups(dense_engine(int4_group_size=32)) == {"o_proj": 32, "down_proj": 32}


def test_unsupported_group_size_is_a_config_error():
    with pytest.raises(ConfigError, match="int4 group size must be"):
        EngineConfig(int4_group_size=48).validate()


@pytest.mark.parametrize(
    ("k", "forced", "want"), [(576, None, 64), (1536, None, 128), (96, None, 32), (576, 32, 32)]
)
def test_pagoda_quantize_picks_each_layers_group(k, forced, want):
    assert layer_group_size(k, forced) == want


def test_pagoda_quantize_group_errors():
    with pytest.raises(ValueError, match="group size 128 does not divide K=576 of q_proj"):
        layer_group_size(576, 128, "q_proj")
    with pytest.raises(ValueError, match="group size must be one of 32, 64, 128, 256, got 48"):
        layer_group_size(576, 48)
    with pytest.raises(ValueError, match="no INT4 group size"):
        layer_group_size(80)
    assert group_size_arg("auto") is None and group_size_arg("64") == 64
    with pytest.raises(argparse.ArgumentTypeError, match="must be auto or one of"):
        group_size_arg("big")
