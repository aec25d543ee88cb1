"""KV bytes per token per layer and capacity, generic over the model's kv_components."""

from __future__ import annotations

import dataclasses

import pytest

from pagoda.node_agent.bench import formats as bench_formats
from pagoda.node_agent.bench.formats import kv_capacity


def test_dense_gqa_bytes_per_token_per_layer(builtin_loaded) -> None:
    cfg = builtin_loaded.config
    bf16 = kv_capacity(cfg, 64 << 20, 16, "bf16")
    fp8 = kv_capacity(cfg, 64 << 20, 16, "fp8_e4m3")
    kv = cfg.num_kv_heads * cfg.head_dim
    assert bf16["component_bytes_per_token_per_layer"] == {"k": 2 * kv, "v": 2 * kv}
    assert bf16["bytes_per_token_per_layer"] == 4 * kv == 2 * fp8["bytes_per_token_per_layer"]
    # per page: every layer's per-token bytes plus the page's tag
    assert bf16["bytes_per_page"] == 16 * cfg.num_layers * bf16["bytes_per_token_per_layer"] + 4
    # FP8 with the default per-token K scales: a bf16 scale per token and KV head rides with K
    assert fp8["token_scale_bytes_per_token_per_layer"] == 2 * cfg.num_kv_heads
    assert fp8["bytes_per_page"] == 16 * cfg.num_layers * (2 * kv + 2 * cfg.num_kv_heads) + 4  # 390 a layer
    static = kv_capacity(cfg, 64 << 20, 16, "fp8_e4m3", "per-head")
    assert static["token_scale_bytes_per_token_per_layer"] == 0 and static["tokens"] > fp8["tokens"]


def test_a_latent_component_is_counted_as_it_is_declared(builtin_loaded, monkeypatch) -> None:
    """An MLA-style cache (one compressed latent + rope key per token and layer, no per-head K/V):
    the figures follow whatever kv_components returns."""
    monkeypatch.setattr(bench_formats, "kv_components", lambda cfg: {"latent": (1, 576)})
    cfg = dataclasses.replace(builtin_loaded.config, num_layers=61)
    cap = kv_capacity(cfg, 1 << 30, 64, "bf16")
    assert cap["component_bytes_per_token_per_layer"] == {"latent": 1152}
    assert cap["bytes_per_token_per_layer"] == 1152
    assert cap["tokens"] == (1 << 30) // (64 * 61 * 1152 + 4) * 64
    fp8 = kv_capacity(cfg, 1 << 30, 64, "fp8_e4m3")
    assert fp8["bytes_per_token_per_layer"] == 576 and fp8["tokens"] >= 1.99 * cap["tokens"]


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe"])
def test_moe_configs_count_their_kv_heads(arch: str) -> None:
    from pagoda.node_agent.models.config import config_from_hf
    from tests.engine.test_moe_models import _hf_config

    cfg = config_from_hf(_hf_config(arch).to_dict())
    cap = kv_capacity(cfg, 8 << 20, 16, "fp8_e4m3")
    assert cap["bytes_per_token_per_layer"] == 2 * cfg.num_kv_heads * cfg.head_dim


def test_bench_kv_capacity_only_reads_just_the_config(tmp_path, capsys) -> None:
    """A MoE config.json with no weights beside it: the figures come from the config alone."""
    import json

    from pagoda.node_agent.cli.main import main
    from tests.engine.test_moe_models import _hf_config

    hf = _hf_config("qwen3_moe")
    hf.save_pretrained(tmp_path)
    assert not list(tmp_path.glob("*.safetensors"))
    out = tmp_path / "kv.json"
    argv = ["bench", "kv", "--capacity-only", "--model", str(tmp_path), "--kv-memory", "8MiB"]
    assert main([*argv, "--max-model-len", "64", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    per_layer = 2 * hf.num_key_value_heads * (hf.hidden_size // hf.num_attention_heads)
    assert res["bytes_per_token_per_layer"] == {
        "bf16": 2 * per_layer,
        "fp8_e4m3": per_layer,
        "int8": per_layer,
    }
    assert res["num_layers"] == hf.num_hidden_layers and res["mode"] == "capacity"
    fp8 = res["capacity"]["fp8_e4m3"]
    assert fp8["max_len_sequences"] == fp8["tokens"] // 64 > 0
    assert f"{per_layer} B/token/layer" in capsys.readouterr().out
