"""A local cache of decoded GGUF models: safetensors (float32, and INT4 blocks packed as loaded) +
config + tokenizer files.

Parsing a GGUF file and converting its tokenizer takes ~25 s for the built-in model; a cache hit
loads in a few seconds. Keyed by the file's absolute path, size and mtime; written atomically
(temporary folder + rename) so concurrent workers never see half a cache. ``PAGODA_CACHE_DIR``
(default ``~/.cache/pagoda``) places it; ``PAGODA_NO_MODEL_CACHE=1`` disables it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from pagoda.kernels.int4 import Int4Weight
from pagoda.node_agent.models.config import ModelConfig
from pagoda.node_agent.models.quant_format import assemble_quantized, meta_of, state_of

log = logging.getLogger("pagoda.cache")
CACHE_VERSION = 2  # 2: Q4_0/Q4_1 linear weights kept packed (INT4)


def cache_root() -> Path | None:
    if os.environ.get("PAGODA_NO_MODEL_CACHE"):
        return None
    return Path(os.environ.get("PAGODA_CACHE_DIR", Path.home() / ".cache" / "pagoda"))


def cache_dir_for(path: Path) -> Path | None:
    root = cache_root()
    if root is None:
        return None
    st = path.stat()
    key = f"{CACHE_VERSION}|{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    return root / "models" / hashlib.sha256(key.encode()).hexdigest()[:24]


def cached_tokenizer(path: Path) -> str | None:
    """The converted tokenizer's folder of a complete cache entry, without reading its weights."""
    d = cache_dir_for(path)
    return str(d) if d is not None and (d / "complete").exists() else None


def read_cache(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor | Int4Weight], str] | None:
    """(config, weights, tokenizer dir) from the cache, or None on a miss or a damaged entry."""
    d = cache_dir_for(path)
    if d is None or not (d / "complete").exists():
        return None
    from safetensors.torch import load_file

    try:
        cfg = json.loads((d / "pagoda_model.json").read_text())
        cfg["eos_token_ids"] = tuple(cfg["eos_token_ids"])
        packed = json.loads((d / "pagoda_packed.json").read_text())
        weights = assemble_quantized(load_file(str(d / "weights.safetensors")), packed)
        return ModelConfig(**cfg), weights, str(d)
    except Exception as exc:  # a damaged entry is rebuilt, never fatal
        log.warning("ignoring damaged model cache %s: %s", d, exc)
        return None


def write_cache(path: Path, cfg: ModelConfig, weights: dict[str, torch.Tensor | Int4Weight]) -> str | None:
    """Store the decoded model and its converted tokenizer; returns the tokenizer dir (None if off)."""
    d = cache_dir_for(path)
    if d is None:
        return None
    from safetensors.torch import save_file
    from transformers.utils import logging as hf_logging

    from pagoda.node_agent.models.gguf_names import gguf_tokenizer

    hf_logging.set_verbosity_error()
    try:
        d.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=d.parent))
        gguf_tokenizer(str(path.parent), path.name).save_pretrained(tmp)
        tensors: dict[str, torch.Tensor] = {}
        packed: dict[str, dict] = {"quantized": {}, "tensors": {}}
        for name, v in weights.items():
            if isinstance(v, Int4Weight):
                packed["quantized"][name] = meta_of(v)
                for part, t in state_of(v).items():
                    tensors[f"{name}.{part}"] = t.contiguous()
                    packed["tensors"][f"{name}.{part}"] = name
            else:
                tensors[name] = v.contiguous()
        save_file(tensors, str(tmp / "weights.safetensors"))
        (tmp / "pagoda_packed.json").write_text(json.dumps(packed))
        (tmp / "pagoda_model.json").write_text(json.dumps(dataclasses.asdict(cfg)))
        (tmp / "complete").write_text("ok\n")
        try:
            tmp.rename(d)
        except OSError:  # another process won the race: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
        log.info("cached decoded model in %s", d)
        return str(d)
    except OSError as exc:
        log.warning("could not write the model cache (%s); continuing without it", exc)
        return None
