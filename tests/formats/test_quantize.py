"""`pagoda quantize` checkpoints load directly and serve decode exactly like in-engine INT4: both
quantize the built-in model's dense weights the same way, or, where the loader already gives its
GGUF Q4_1 blocks as INT4 weights, both use those as they are (pagoda quantize writes them through).
Requantization options (groups, float zeros, clip search) are in test_quantize_options.py."""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels.int4 import Int4Weight, quantize_int4
from pagoda.node_agent.engine.config import EngineConfig
from pagoda.node_agent.engine.llm_engine import LLMEngine
from pagoda.node_agent.models.llama import PhaseLinear
from pagoda.node_agent.models.loader import load_model
from pagoda.node_agent.models.quantize import MANIFEST, quantize_checkpoint
from pagoda.node_agent.params import SamplingParams

from ..engine.prompts import CHAT_PROMPTS
from .conftest import INT4_FP8

W0 = "model.layers.0.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def int4_checkpoint(tmp_path_factory, builtin_loaded, builtin_tokenizer):
    out = tmp_path_factory.mktemp("int4")
    report = quantize_checkpoint(
        "builtin://smollm2-135m",
        "int4",
        out,
        progress=False,
        loaded=builtin_loaded,
        tokenizer=builtin_tokenizer,
    )
    return out, report


def test_checkpoint_files_and_shrink(int4_checkpoint) -> None:
    out, report = int4_checkpoint
    for name in ("config.json", "model.safetensors", MANIFEST, "tokenizer.json"):
        assert (out / name).exists(), name
    assert report.num_tensors == 30 * 7
    # 0.284x for pagoda's RTN of dense weights (groups 64/128), 0.375x for Q4_1 blocks written
    # through (group 32, float32 scales and mins)
    assert report.linear_bytes_quant <= 0.375 * report.linear_bytes_bf16
    assert report.linear_bytes_quant < report.checkpoint_bytes


def test_loads_prequantized_objects(int4_checkpoint, builtin_loaded) -> None:
    out, _ = int4_checkpoint
    loaded = load_model(str(out))
    assert loaded.manifest["weights"] == "int4"
    w = loaded.weights[W0]
    assert isinstance(w, Int4Weight)
    src = builtin_loaded.weights[W0]
    # the engine's own INT4 of the source: its RTN of a dense weight, or the INT4 weight the loader
    # already gives (written through unchanged)
    same = src if isinstance(src, Int4Weight) else quantize_int4(src)
    assert torch.equal(w.packed, same.packed) and torch.equal(w.scales, same.scales)
    for part in ("zeros", "mins"):
        a, b = getattr(w, part), getattr(same, part)
        assert (a is None and b is None) or torch.equal(a, b), part
    assert torch.equal(loaded.weights["model.norm.weight"], builtin_loaded.weights["model.norm.weight"])


def test_rule_own_format_as_stored_other_formats_dequantized(int4_checkpoint) -> None:
    out, _ = int4_checkpoint
    w = load_model(str(out)).weights[W0]
    expect = w.dequantize()
    lin = PhaseLinear(w, None, {"prefill": "bf16", "decode": "int4"}, torch.float32)
    assert lin.by_phase["decode"].weight is w
    assert torch.equal(lin.by_phase["prefill"].weight, expect)


def _greedy(engine, prompts, n=12):
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params, chat=True) for p in prompts]
    final = engine.run_until_done()
    return [final[i].token_ids for i in ids]


@pytest.mark.slow
def test_checkpoint_engine_matches_in_engine_int4(int4_checkpoint, int4_fp8_engine) -> None:
    out, _ = int4_checkpoint
    cfg = EngineConfig(model=str(out), dtype="float32", kv_memory=64 << 20, formats=INT4_FP8)
    loaded = load_model(str(out))
    quantized = LLMEngine(cfg, loaded=loaded)
    assert loaded.weights[W0].packed is not None  # the engine's CPU repacking left the load intact
    prompts = CHAT_PROMPTS[:2]
    assert _greedy(quantized, prompts) == _greedy(int4_fp8_engine, prompts)
    assert quantized.model.weight_bytes() == int4_fp8_engine.model.weight_bytes()
