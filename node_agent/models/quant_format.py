"""The on-disk form of a ``pagoda quantize`` checkpoint: packed tensor names and the manifest.

``pagoda_quant.json`` maps every stored tensor key to its weight name and every quantized weight
to its format metadata; ``assemble_quantized`` turns the stored tensors back into weight objects.
"""

from __future__ import annotations

import torch

from pagoda.kernels.fp8 import Fp8Weight
from pagoda.kernels.int4 import Int4Weight

MANIFEST = "pagoda_quant.json"


def state_of(q: Int4Weight | Fp8Weight) -> dict[str, torch.Tensor]:
    if isinstance(q, Int4Weight):
        return dict(q.state())
    s = q.state()
    return {"fp8": s["weight"], "scale": s["scale"]}


def meta_of(q: Int4Weight | Fp8Weight) -> dict:
    if isinstance(q, Int4Weight):
        return q.meta()
    return {"format": "fp8", "out_features": str(q.out_features), "in_features": str(q.in_features)}


def assemble_quantized(weights: dict[str, torch.Tensor], manifest: dict) -> dict[str, object]:
    """Loader hook: replace stored packed tensors by Int4Weight / Fp8Weight objects by weight name."""
    out: dict[str, object] = {k: v for k, v in weights.items() if k not in manifest.get("tensors", {})}
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, name in manifest.get("tensors", {}).items():
        if key not in weights:
            raise ValueError(f"quantized checkpoint misses tensor {key}")
        parts.setdefault(name, {})[key[len(name) + 1 :]] = weights[key]
    for name, meta in manifest.get("quantized", {}).items():
        d = parts.get(name, {})
        if meta.get("format") == "int4":
            out[name] = Int4Weight.from_state(d, meta)
        elif meta.get("format") == "fp8":
            out[name] = Fp8Weight.from_state({"weight": d["fp8"], "scale": d["scale"]})
        else:
            raise ValueError(f"{name}: unknown quantized format {meta.get('format')!r} in {MANIFEST}")
    return out
