"""The INT4 group size is configurable and falls back to a size dividing each layer's input dim."""

from __future__ import annotations

import argparse

import pytest

from pagoda.node_agent.cli.quantize import group_size_arg
from pagoda.node_agent.engine.config import ConfigError, EngineConfig, PhaseFormats
from pagoda.node_agent.models.int4_quant import layer_group_size

INT4_DECODE = PhaseFormats("bf16", "bf16", "int4", "bf16")


def _groups(engine) -> dict[str, int]:
    layer = engine.model.layers[0]
    return {
        name: getattr(layer, name).by_phase["decode"].weight.group_size for name in ("q_proj", "down_proj")
    }


def test_default_and_explicit_group_sizes(make_engine):
    # SmolLM2: q_proj has K=576 (128 does not divide it: 64), down_proj K=1536 (128)
    assert _groups(make_engine(formats=INT4_DECODE, kv_memory=4 << 20)) == {"q_proj": 64, "down_proj": 128}
    assert _groups(make_engine(formats=INT4_DECODE, kv_memory=4 << 20, int4_group_size=32)) == {
        "q_proj": 32,
        "down_proj": 32,
    }


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
