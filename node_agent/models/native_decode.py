"""The decode step's layers as one native call each, where the model and the step allow it.

On a CPU in float32, a Llama-family layer whose decode weights are all INT4 (the exact float32
kernel) over float32 or FP8 pages runs as ``kernels/cpu_decode_layer.c``: the same float32
operations as the torch path, without ~20 torch calls per layer. Everything else (other formats
or families, tensor parallelism, bfloat16 pages, the reference kernels, ``PAGODA_NATIVE_DECODE=0``)
runs the torch path; ``NativeDecode.build`` says why a model is not served.
"""

from __future__ import annotations

from typing import Any

import torch

from pagoda.kernels.cpu_decode_layer_native import (
    DecodeLayerSpec,
    LayerPages,
    int4_servable,
    library,
    page_modes,
    run_decode_layers,
)
from pagoda.kernels.dispatch import record, select_backend
from pagoda.kernels.linear import Int4Linear
from pagoda.kernels.switches import SWITCHES, switch_on
from pagoda.node_agent.models.batch import StepBatch
from pagoda.node_agent.models.layers import DenseMLP

DecoderLayer = Any  # a layer of models/decoder.py's LayerBase kind (llama.py imports this module)

ENV_VAR = SWITCHES["native_decode"]


def _int4(linear, bias_ok: bool = False) -> object | None:
    """The decode phase's INT4 weight of a PhaseLinear, when the native layer can run it."""
    w = None if linear is None else linear.by_phase.get("decode")
    if not isinstance(w, Int4Linear) or w.weight.cpu_compute != "float32":
        return None
    if w.bias is not None and not bias_ok:
        return None
    return w.weight if int4_servable(w.weight) else None


def _layer_spec(layer: DecoderLayer) -> DecodeLayerSpec | str:
    cfg = layer.cfg
    if layer.mla is not None:
        return "latent attention (MLA)"
    if layer.tp is not None:
        return "tensor parallelism"
    if not isinstance(layer.mlp, DenseMLP) or layer.mlp.gate_up_proj is None:
        return "a mixture-of-experts or unfused MLP"
    if layer.qkv_proj is None:
        return "unfused q/k/v projections"
    weights = {
        "qkv": _int4(layer.qkv_proj, bias_ok=True),
        "o": _int4(layer.o_proj),
        "gate_up": _int4(layer.mlp.gate_up_proj),
        "down": _int4(layer.mlp.down_proj),
    }
    missing = [name for name, w in weights.items() if w is None]
    if missing:
        return f"decode weights not float32-computed INT4, or biased beyond q/k/v ({', '.join(missing)})"
    in_w, eps = layer.input_norm.args()
    post_w, post_eps = layer.post_norm.args()
    norms = [post_eps]
    qk_norms = None
    if layer.q_norm is not None:
        (qn, q_eps), (kn, k_eps) = layer.q_norm.args(), layer.k_norm.args()
        norms += [q_eps, k_eps]
        qk_norms = (qn, kn)
    if any(e != eps for e in norms):
        return "different norm epsilons"
    bias = layer.qkv_proj.by_phase["decode"].bias
    return DecodeLayerSpec.build(
        cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, eps, in_w, post_w, **weights,
        qkv_bias=bias, qk_norms=qk_norms, window=layer.window,
    )  # fmt: skip


class NativeDecode:
    """Specs of every layer, and the per-step choice between this path and the torch one."""

    def __init__(self, specs: list[DecodeLayerSpec], head_dim: int) -> None:
        self.specs = specs
        self.scale = head_dim**-0.5

    @classmethod
    def build(cls, layers: list[DecoderLayer], dtype: torch.dtype, device: torch.device, rope_dims: int):
        """(NativeDecode, "") when every layer can run natively, else (None, the reason)."""
        if not switch_on("native_decode"):
            return None, f"{ENV_VAR}=0"
        if device.type != "cpu" or dtype != torch.float32:
            return None, "not float32 on a CPU"
        if not layers or rope_dims != layers[0].cfg.head_dim or layers[0].cfg.head_dim % 2:
            return None, "partial RoPE"
        if library() is None:
            return None, "the native CPU kernels are unavailable"
        specs = []
        for layer in layers:
            spec = _layer_spec(layer)
            if isinstance(spec, str):
                return None, f"layer {layer.idx}: {spec}"
            specs.append(spec)
        return cls(specs, layers[0].cfg.head_dim), ""

    def serves(self, b: StepBatch, weights_phase: str) -> list[LayerPages] | None:
        """This step's (caches, scales, C modes) per layer when the native path runs it, else None."""
        if b.phase != "decode" or weights_phase != "decode" or not switch_on("native_decode"):
            return None
        if select_backend(b.input_ids.device, b.kernel_backend) != "cpu":
            return None
        pages = []
        for i in range(len(self.specs)):
            cache, scales = b.kv.layer_cache(i), b.kv.layer_scales(i)
            modes = page_modes(cache, scales)
            if modes is None:
                return None
            pages.append((cache, scales, modes))
        return pages

    def run(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, b: StepBatch, pages: list[LayerPages]
    ):
        """Every layer of this decode step -> the last hidden states [T, hidden]."""
        record("decode_layers", "native")
        return run_decode_layers(
            self.specs,
            x,
            cos,
            sin,
            b.slot_mapping,
            b.block_tables,
            b.context_lens,
            pages,
            self.scale,
            torch.get_num_threads(),
        )
