"""Shared fixtures: the built-in model is loaded once per test session."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _import_hub_kernels() -> None:
    """pytest puts the repository root on sys.path (tests/ is a package, for ``tests.tiny_models``),
    and the root holds this project's ``kernels/`` (imported as ``pagoda.kernels``), which would
    shadow Hugging Face's ``kernels`` package that transformers (5.25 and later) imports. Import
    that one first, with the root off the path, so that transformers finds it in sys.modules."""
    root = Path(__file__).resolve().parents[1]
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != root]
    try:
        if "kernels" not in sys.modules and importlib.util.find_spec("kernels") is not None:
            import kernels  # noqa: F401 - Hugging Face's, from site-packages
    finally:
        sys.path[:] = saved


_import_hub_kernels()

BUILTIN = "builtin://smollm2-135m"


@pytest.fixture(autouse=True, scope="module")
def _release_app_caches():
    """After each module, let its servers' engines go: FastAPI keeps each route's endpoint in module
    level LRU caches (4,096 entries) and our endpoints close over their worker, so without this
    every app a test built, with its engine and KV pools, lived to the end of the session (the suite
    outgrew a 24 GiB machine). One server per process, as in production, is unaffected."""
    yield
    import gc
    import sys

    models = sys.modules.get("fastapi.dependencies.models")
    for name in dir(models) if models else ():
        clear = getattr(getattr(models, name), "cache_clear", None)
        if callable(clear):
            clear()
    gc.collect()


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


_RSS_LOG = os.environ.get("PAGODA_TEST_RSS_LOG")

if _RSS_LOG:

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_logfinish(nodeid, location):
        """Append each test's process memory (and its children's) to PAGODA_TEST_RSS_LOG."""
        import time

        import psutil

        me = psutil.Process()
        kids = me.children(recursive=True)
        child_rss = 0
        for k in kids:
            try:
                child_rss += k.memory_info().rss
            except psutil.Error:
                pass
        with open(_RSS_LOG, "a") as f:
            f.write(
                f"{time.time():.1f}\t{me.memory_info().rss >> 20}\t{child_rss >> 20}\t{len(kids)}\t{nodeid}\n"
            )
