"""The INT4 group size is configurable and falls back to a size dividing each layer's input dim."""

from __future__ import annotations

import pytest

from pagoda.node_agent.engine.config import ConfigError, EngineConfig, PhaseFormats

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
