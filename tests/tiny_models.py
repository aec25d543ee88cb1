"""Tiny random-weight models built and saved by transformers itself, shared by the tests.

Each test keeps its own config (its sizes are what its bounds were measured on); this module holds
the steps every one of them repeated: seed, build, draw the parameters transformers zero-initialises,
save with the built-in tokenizer.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

TOKENIZER_VOCAB = 49152  # the built-in tokenizer's vocabulary: every tiny config uses it


def random_causal_lm(config, seed: int = 0, prepare: Callable[[torch.nn.Module], None] | None = None):
    """transformers' randomly initialised causal LM for ``config``, float32, in eval mode.

    The global torch seed is set to ``seed`` first; ``prepare(model)``, when given, runs right after
    under ``torch.no_grad()`` (routers or biases that must be random for the test to mean anything).
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    if prepare is not None:
        with torch.no_grad():
            prepare(model)
    return model


def save_tiny_model(model, path: str | Path, tokenizer) -> Path:
    """Save ``model`` (safetensors) and the built-in ``tokenizer`` into ``path``; return the path."""
    model.save_pretrained(path, safe_serialization=True)
    tokenizer._tok.save_pretrained(path)
    return Path(path)


def save_random_model(
    config,
    path: str | Path,
    tokenizer,
    seed: int = 0,
    prepare: Callable[[torch.nn.Module], None] | None = None,
):
    """Build a random model (``random_causal_lm``) and save it into ``path``: ``(model, path)``."""
    model = random_causal_lm(config, seed, prepare)
    return model, save_tiny_model(model, path, tokenizer)
