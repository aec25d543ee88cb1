"""A tiny random-weight decoder over a real model's tokenizer and config, for benches that need
thousands of requests on a CPU (``pagoda bench integrity --soak``).

Its output is meaningless text, but every page the engine allocates, shares, migrates and hands off
is real, which is all a bookkeeping soak needs. The weights are drawn at a scale that makes greedy
choices clear-cut (logits spread by several units), so rounding differences between batch shapes
rarely decide a token.
"""

from __future__ import annotations

import dataclasses

import torch

from pagoda.node_agent.models.config import ATTENTION_NAMES, MLP_NAMES, NORM_NAMES
from pagoda.node_agent.models.loader import LoadedModel

TINY = dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)


def _shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Weight name -> shape for a dense Llama-family model with ``cfg``'s sizes (tied embeddings)."""
    h, i, q, kv = (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
    )
    per_layer = dict(zip(ATTENTION_NAMES, [(q, h), (kv, h), (kv, h), (h, q)], strict=True))
    per_layer |= dict(zip(MLP_NAMES, [(i, h), (i, h), (h, i)], strict=True))
    out: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, h),
        "model.norm.weight": (h,),
    }
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        out |= {f"{p}{name}.weight": shape for name, shape in per_layer.items()}
        out |= {f"{p}{name}.weight": (h,) for name in NORM_NAMES}
    return out


def tiny_random_model(base: LoadedModel, seed: int = 0, **sizes) -> LoadedModel:
    """``base``'s tokenizer and architecture with tiny sizes (``TINY``, overridable) and random weights."""
    arch = base.config
    if arch.moe is not None or arch.mla is not None or arch.attention_bias or arch.qk_norm:
        raise ValueError(f"the tiny soak model needs a plain Llama-family base, got {arch.arch}")
    cfg = dataclasses.replace(
        arch,
        **(TINY | sizes),
        tie_word_embeddings=True,
        sliding_window=None,
        sliding_layers=None,
        rotary_dim=None,
    )
    gen = torch.Generator().manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for name, shape in _shapes(cfg).items():
        if len(shape) == 1:  # norms: ones
            weights[name] = torch.ones(shape)
        elif name == "model.embed_tokens.weight":  # unit rows: tied logits spread by several units
            weights[name] = torch.randn(shape, generator=gen)
        else:
            weights[name] = torch.randn(shape, generator=gen) / shape[1] ** 0.5
    return LoadedModel(
        source=f"{base.source} (tiny random weights, seed {seed})",
        config=cfg,
        weights=weights,
        tokenizer_dir=base.tokenizer_dir,
        gguf_file=base.gguf_file,
    )
