"""Shared fixtures: the built-in model is loaded once per test session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

BUILTIN = "builtin://smollm2-135m"


@pytest.fixture(scope="session")
def builtin_loaded():
    """SmolLM2-135M-Instruct weights (float32, HF names) and config, from the shipped GGUF."""
    from pagoda.node_agent.models.loader import load_model

    return load_model(BUILTIN)


@pytest.fixture(scope="session")
def builtin_tokenizer(builtin_loaded):
    from pagoda.node_agent.models.tokenizer import Tokenizer

    return Tokenizer(builtin_loaded.tokenizer_dir, builtin_loaded.gguf_file)


@pytest.fixture(scope="session")
def make_engine(builtin_loaded, builtin_tokenizer):
    """Factory for engines over the shared built-in weights (no reload): make_engine(**EngineConfig)."""
    from pagoda.node_agent.engine.config import EngineConfig, PhaseFormats
    from pagoda.node_agent.engine.llm_engine import LLMEngine

    def factory(**kw):
        kw.setdefault("dtype", "float32")
        kw.setdefault("kv_memory", 256 << 20)
        kw.setdefault("formats", PhaseFormats.reference())
        return LLMEngine(
            EngineConfig(model=BUILTIN, **kw), loaded=builtin_loaded, tokenizer=builtin_tokenizer
        )

    return factory


@pytest.fixture(scope="session")
def engine(make_engine):
    """A float32 engine with default (reference-precision) formats, shared by read-only tests."""
    return make_engine()


@pytest.fixture(scope="session")
def hf_reference():
    """transformers' own model and tokenizer on the same GGUF, float32 (the correctness oracle)."""
    import torch

    from pagoda.node_agent.bench.decode import load_hf_reference

    return load_hf_reference(BUILTIN, torch.float32)
