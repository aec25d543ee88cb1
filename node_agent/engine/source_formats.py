"""The weight format of each phase the user left at ``auto``: what the source is stored in decides.

A checkpoint a producer released quantized (config.json ``quantization_config``: compressed-tensors,
GPTQ, AWQ or FP8 blocks) runs ``stored``: each layer it holds quantized keeps that format (Kimi-K2's
INT4 experts stay INT4) and the layers it holds dense run in the compute dtype. Every other source
keeps PHASE_DEFAULTS (fp8 prefill, int4 decode): dense checkpoints, ``pagoda quantize`` output, and
GGUF files, whose Q4 blocks would otherwise put INT4 weights into the compute-bound prefill. A
format the user names always wins.
"""

from __future__ import annotations

import dataclasses
import json
import logging

from pagoda.node_agent.engine.config import EngineConfig
from pagoda.node_agent.models.config import ModelLoadError
from pagoda.node_agent.models.loader import resolve_source
from pagoda.vocabulary import PHASE_DEFAULTS, PHASES, SOURCE_DEFAULT, STORED

log = logging.getLogger("pagoda.engine")


def released_quantization(source: str) -> str | None:
    """The ``quant_method`` of a Hugging Face directory's config.json (None for a GGUF file, a dense
    checkpoint, or a source the loader will refuse with its own error)."""
    try:
        kind, path = resolve_source(source)
    except ModelLoadError:
        return None
    if kind != "hf-dir":
        return None
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    qc = raw.get("quantization_config") if isinstance(raw, dict) else None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    return method if isinstance(method, str) and method else None


def resolve_weight_formats(config: EngineConfig) -> EngineConfig:
    """``config`` with every ``auto`` phase weight format replaced by the source's default."""
    f = config.formats
    auto = [p for p in PHASES if getattr(f, f"{p}_weights") == SOURCE_DEFAULT]
    if not auto:
        return config
    method = released_quantization(config.model)
    chosen = {f"{p}_weights": STORED if method else PHASE_DEFAULTS[p]["weights"] for p in auto}
    why = f"released {method} checkpoint" if method else "the phase defaults"
    log.info("weight formats from the source (%s): %s", why, ", ".join(f"{k} {v}" for k, v in chosen.items()))
    return dataclasses.replace(config, formats=dataclasses.replace(f, **chosen))
