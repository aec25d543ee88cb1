"""The decoded-GGUF cache returns exactly what decoding the file gives, and a damaged entry is rebuilt."""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels.int4 import Int4Weight
from pagoda.node_agent.models import cache as model_cache
from pagoda.node_agent.models import loader


@pytest.mark.slow
def test_cache_roundtrip_and_damage(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PAGODA_NO_MODEL_CACHE", raising=False)
    _, path = loader.resolve_source("builtin://smollm2-135m")
    first = loader.load_model("builtin://smollm2-135m")  # miss: decodes and writes
    d = model_cache.cache_dir_for(path)
    assert (d / "complete").exists() and (d / "tokenizer.json").exists()
    second = loader.load_model("builtin://smollm2-135m")  # hit
    assert second.config == first.config and second.gguf_file is None
    assert second.weights.keys() == first.weights.keys()
    assert torch.equal(
        second.weights["model.embed_tokens.weight"], first.weights["model.embed_tokens.weight"]
    )
    k = "model.layers.3.self_attn.k_proj.weight"  # a Q4_1 block tensor: kept packed, float zero
    assert isinstance(second.weights[k], Int4Weight) and second.weights[k].float_zero
    for part, t in first.weights[k].state().items():
        assert torch.equal(second.weights[k].state()[part], t)
    (d / "weights.safetensors").write_bytes(b"garbage")
    assert model_cache.read_cache(path) is None  # damaged: ignored, never fatal
