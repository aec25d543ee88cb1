"""Fixtures for the benchmark tests: benches run over the session's already loaded weights."""

from __future__ import annotations

import pytest


@pytest.fixture
def no_reload(monkeypatch, builtin_loaded, builtin_tokenizer):
    """``load_model`` and ``Tokenizer`` hand out the session's built-in model (no second load)."""
    import pagoda.node_agent.models.loader as loader
    import pagoda.node_agent.models.tokenizer as tokenizer

    monkeypatch.setattr(loader, "load_model", lambda source: builtin_loaded)
    monkeypatch.setattr(tokenizer, "Tokenizer", lambda *a, **k: builtin_tokenizer)


@pytest.fixture
def hf_shared(monkeypatch, hf_reference):
    """bench decode's transformers baseline reuses the session's transformers model."""
    import pagoda.node_agent.bench.decode as decode

    monkeypatch.setattr(decode, "load_hf_reference", lambda source, dtype: hf_reference)
