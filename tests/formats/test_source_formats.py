"""Weight formats left at ``auto`` follow the source (engine/source_formats.py): ``stored`` per phase
for a checkpoint released quantized (compressed-tensors, GPTQ, AWQ, FP8 blocks), fp8 prefill and
int4 decode for everything else (GGUF files such as the built-in model's Q4_1, dense and ``pagoda
quantize`` directories); a format the user names always wins. An engine on a released INT4
checkpoint is checked end to end in test_kimi_k2.py."""

from __future__ import annotations

import argparse
import json

import pytest

from pagoda.node_agent.cli.engine_args import add_engine_args, engine_config_from_args
from pagoda.node_agent.engine.config import ConfigError, EngineConfig, PhaseFormats
from pagoda.node_agent.engine.source_formats import released_quantization, resolve_weight_formats

BUILTIN = "builtin://smollm2-135m"
QUANT = {
    "compressed-tensors": {"quant_method": "compressed-tensors", "format": "pack-quantized"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128},
    "fp8": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
}


def _dir(tmp_path, quant: dict | None):
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    if quant is not None:
        cfg["quantization_config"] = quant
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def _weights(config: EngineConfig) -> tuple[str, str]:
    f = resolve_weight_formats(config).formats
    return f.prefill_weights, f.decode_weights


@pytest.mark.parametrize("method", list(QUANT))
def test_a_released_quantized_checkpoint_defaults_to_stored(tmp_path, method):
    path = _dir(tmp_path, QUANT[method])
    assert released_quantization(path) == method
    assert _weights(EngineConfig(model=path)) == ("stored", "stored")


def test_gguf_dense_and_pagoda_quantize_sources_keep_fp8_prefill_int4_decode(tmp_path):
    assert released_quantization(BUILTIN) is None  # the built-in Q4_1 GGUF: never an INT4 prefill
    assert _weights(EngineConfig(model=BUILTIN)) == ("fp8", "int4")
    dense = _dir(tmp_path, None)  # also what `pagoda quantize` writes: its config.json drops the field
    assert _weights(EngineConfig(model=dense)) == ("fp8", "int4")


def test_named_formats_win_per_phase(tmp_path):
    path = _dir(tmp_path, QUANT["compressed-tensors"])
    assert _weights(EngineConfig(model=path, formats=PhaseFormats(decode_weights="int4"))) == (
        "stored",
        "int4",
    )
    assert _weights(EngineConfig(model=path, formats=PhaseFormats(prefill_weights="fp8"))) == (
        "fp8",
        "stored",
    )
    assert _weights(EngineConfig(model=path, formats=PhaseFormats.reference())) == ("bf16", "bf16")
    assert _weights(EngineConfig(model=BUILTIN, formats=PhaseFormats(prefill_weights="stored"))) == (
        "stored",
        "int4",
    )


def test_cli_leaves_unnamed_weights_to_the_source():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    f = engine_config_from_args(p.parse_args([])).formats
    assert (f.prefill_weights, f.decode_weights) == ("auto", "auto")
    f = engine_config_from_args(p.parse_args(["--decode-weights", "int4"])).formats
    assert (f.prefill_weights, f.decode_weights) == ("auto", "int4")
    f = engine_config_from_args(p.parse_args(["--dtype", "float32"])).formats  # the reference formats
    assert (f.prefill_weights, f.decode_weights) == ("bf16", "bf16")
    # auto named (as the operator passes it) is the flag left out, the float32 reference included
    for argv in ([], ["--decode-kv", "bf16"], ["--dtype", "float32"], ["--decode-weights", "int4"]):
        unset = [f"--{ph}-weights" for ph in ("prefill", "decode") if f"--{ph}-weights" not in argv]
        for flags in [[u] for u in unset] + [unset]:
            named = [*argv, *(x for flag in flags for x in (flag, "auto"))]
            assert engine_config_from_args(p.parse_args(named)) == engine_config_from_args(p.parse_args(argv))
    with pytest.raises(SystemExit):
        p.parse_args(["--decode-weights", "int3"])
    with pytest.raises(ConfigError, match="auto"):
        PhaseFormats(decode_weights="int3").validate()


def test_the_builtin_engine_runs_fp8_prefill_and_int4_decode(make_engine):
    engine = make_engine(formats=PhaseFormats(), kv_memory=32 << 20)
    f = engine.config.formats
    assert (f.prefill_weights, f.decode_weights) == ("fp8", "int4")
    lin = engine.model.layers[0].linears()[0]
    assert (lin.by_phase["prefill"].fmt, lin.by_phase["decode"].fmt) == ("fp8", "int4")
    assert engine.state().formats["decode_weights"] == "int4"
