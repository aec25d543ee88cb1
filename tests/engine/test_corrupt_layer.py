"""The quality drill's corruption (engine/corrupt_layer.py): one layer's output projections scaled
at load, only under fault injection, the shared weights left as they were."""

from __future__ import annotations

import pytest
import torch

from pagoda.node_agent.engine.config import ConfigError, EngineConfig
from pagoda.node_agent.engine.corrupt_layer import CorruptionError, corrupt_layer


def test_corrupting_needs_fault_injection_and_a_sane_scale() -> None:
    with pytest.raises(ConfigError, match="fault injection"):
        EngineConfig(corrupt_layer=3).validate()
    for scale in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="scale"):
            EngineConfig(corrupt_layer=3, corrupt_scale=scale, fault_injection=True).validate()
    EngineConfig(corrupt_layer=3, corrupt_scale=1.5, fault_injection=True).validate()


def test_the_serve_flags_reach_the_engine_config() -> None:
    import argparse

    from pagoda.node_agent.cli.engine_args import add_engine_args, engine_config_from_args

    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    a = ap.parse_args(["--fault-corrupt-layer", "7", "--fault-corrupt-scale", "2"])
    cfg = engine_config_from_args(a)
    assert (cfg.corrupt_layer, cfg.corrupt_scale) == (7, 2.0)
    with pytest.raises(ConfigError):  # refused without --enable-fault-injection
        cfg.validate()
    a = ap.parse_args(["--enable-fault-injection", "--fault-corrupt-layer", "7"])
    cfg = engine_config_from_args(a)
    cfg.validate()
    assert cfg.corrupt_scale == 1.5


def test_only_the_layers_output_projections_scale_and_the_original_stays(builtin_loaded) -> None:
    out = corrupt_layer(builtin_loaded, 10, 1.5)
    changed = {k for k in out.weights if out.weights[k] is not builtin_loaded.weights[k]}
    assert changed == {"model.layers.10.self_attn.o_proj.weight", "model.layers.10.mlp.down_proj.weight"}
    for k in changed:  # the built-in GGUF keeps them as stored INT4 (Q4_1): scales and mins scale
        before, after = builtin_loaded.weights[k], out.weights[k]
        dense = (lambda w: w.dequantize()) if hasattr(before, "dequantize") else (lambda w: w)
        assert torch.allclose(dense(after), dense(before) * 1.5, rtol=1e-6, atol=1e-7)
    with pytest.raises(CorruptionError, match="0..29"):
        corrupt_layer(builtin_loaded, 30, 1.5)
