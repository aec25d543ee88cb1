"""The quality drill's corruption: one decoder layer's output projections scaled at load.

``pagoda serve --enable-fault-injection --fault-corrupt-layer N --fault-corrupt-scale S`` multiplies
the two weights through which layer N writes into the residual stream (``self_attn.o_proj`` and
``mlp.down_proj``) by S before the phase formats quantize them, so everything layer N adds to the
residual is S times too large (or small). A dense weight is scaled itself; a layer stored quantized
(FP8 blocks, INT4 groups) has its quantization scales scaled instead, which is the same thing, and an
INT4 or FP8 phase format quantizes the scaled dense weight, so its group or channel scales come out
S times too large as well. The gate (docs/quality-gates.md) must catch it; an honest pod never runs
it (``EngineConfig.validate`` refuses it without fault injection).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from pagoda.node_agent.models.lazy_tensor import LazyTensor, materialize
from pagoda.node_agent.models.loader import LoadedModel

log = logging.getLogger("pagoda.engine")

TARGETS = ("self_attn.o_proj.weight", "mlp.down_proj.weight")
SCALE_FIELDS = ("scale", "scales", "mins")  # what multiplies (or offsets) a stored weight's codes


class CorruptionError(ValueError):
    """The corruption asked for cannot be applied to this model."""


def _scaled(value: object, factor: float, name: str) -> object:
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.element_size() > 1:
        return value * factor
    state = getattr(value, "state", None)  # a weight kept as stored (Int4Weight, Fp8Weight, ...)
    if callable(state) and hasattr(type(value), "from_state"):
        tensors = state()
        if any(k in SCALE_FIELDS for k in tensors):  # dequantized = q * scale (+ min): scale both
            scaled = {
                k: t * factor if k in SCALE_FIELDS and t.is_floating_point() else t
                for k, t in tensors.items()
            }
            meta = getattr(value, "meta", None)
            return (
                type(value).from_state(scaled, meta()) if callable(meta) else type(value).from_state(scaled)
            )
    raise CorruptionError(f"{name}: a {type(value).__name__} has neither dense values nor scales to scale")


def corrupt_layer(loaded: LoadedModel, layer: int, factor: float) -> LoadedModel:
    """A copy of ``loaded`` whose layer ``layer`` writes ``factor`` times its output into the
    residual stream; the other tensors are shared, ``loaded`` itself is left as it was."""
    n = loaded.config.num_layers
    if not 0 <= layer < n:
        raise CorruptionError(f"--fault-corrupt-layer {layer}: the model has layers 0..{n - 1}")
    weights = dict(loaded.weights)
    hit = []
    for suffix in TARGETS:
        name = f"model.layers.{layer}.{suffix}"
        if name in weights:
            value = weights[name]
            if isinstance(value, LazyTensor):  # a sharded load defers reads: read this one now
                value = materialize({name: value})[name]
            weights[name] = _scaled(value, factor, name)
            hit.append(name)
    if not hit:
        raise CorruptionError(f"layer {layer} has none of {', '.join(TARGETS)} (architecture not covered)")
    log.warning("fault injection: %s scaled by %g (quality drill)", ", ".join(hit), factor)
    return dataclasses.replace(loaded, weights=weights)
