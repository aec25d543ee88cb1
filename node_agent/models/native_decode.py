"""A step's layers as one native call each, where the model and the step allow it.

On a CPU in float32, a Llama-family layer whose phase weights are all INT4 (the exact float32
kernel) or per-channel FP8 (the fused kernel), over float32, FP8 or int8 pages, runs as
``kernels/cpu_decode_layer.c``: the same float32 operations as the torch path, without ~20 torch
calls per layer. Decode steps run it with the decode weights (INT4 by default). Prefill chunks of
fewer than ``PREFILL_BELOW_TOKENS`` tokens run it with the prefill weights (FP8 by default), each
token attending through its sequence's pages up to its own position: a small chunk's step then costs
its GEMMs, not per-op overhead, which is what a time-budgeted prefill floor between two decode
steps pays for. Larger chunks keep the torch path, whose attention is one batched product per
sequence and whose FP8 GEMM decodes the codes once for all rows; so do chunks over 1-byte pages (a
prompt scored through the decode pool): the two paths' float32 results differ in the last bits,
and a page's int8 or FP8 rounding can turn that into a visible difference, so a prompt and its
prefix, one above the size bound and one below, would score apart. Everything else (other formats or
families, tensor parallelism, bfloat16 pages, the reference kernels, ``PAGODA_NATIVE_DECODE=0``)
runs the torch path; ``NativeDecode.build`` says why a phase is not served.
"""

from __future__ import annotations

from typing import Any

import torch

from pagoda.kernels.cpu_attention_native import MODE_F32
from pagoda.kernels.cpu_decode_layer_native import (
    DecodeLayerSpec,
    LayerPages,
    fp8_servable,
    int4_servable,
    library,
    page_modes,
    run_decode_layers,
    token_tables,
)
from pagoda.kernels.cpu_fp8_native import available as fp8_native_available
from pagoda.kernels.dispatch import record, select_backend
from pagoda.kernels.fp8 import FUSED_BELOW_ROWS
from pagoda.kernels.linear import Fp8Linear, Int4Linear
from pagoda.kernels.switches import SWITCHES, switch_on
from pagoda.node_agent.models.batch import StepBatch
from pagoda.node_agent.models.layers import PHASES, DenseMLP

DecoderLayer = Any  # a layer of models/decoder.py's LayerBase kind (llama.py imports this module)

ENV_VAR = SWITCHES["native_decode"]
# Prefill chunks below this many tokens run natively: the fused FP8 GEMM's own range (kernels/fp8.py)
PREFILL_BELOW_TOKENS = FUSED_BELOW_ROWS


def _weight(linear, phase: str, bias_ok: bool = False) -> object | None:
    """The phase's INT4 or FP8 weight of a PhaseLinear, when the native layer can run it."""
    w = None if linear is None else linear.by_phase.get(phase)
    if w is None or (w.bias is not None and not bias_ok):
        return None
    if isinstance(w, Int4Linear):
        ok = w.weight.cpu_compute == "float32" and int4_servable(w.weight)
    else:
        ok = type(w) is Fp8Linear and fp8_servable(w.weight)
    return w.weight if ok else None


def _layer_spec(layer: DecoderLayer, phase: str) -> DecodeLayerSpec | str:
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
        "qkv": _weight(layer.qkv_proj, phase, bias_ok=True),
        "o": _weight(layer.o_proj, phase),
        "gate_up": _weight(layer.mlp.gate_up_proj, phase),
        "down": _weight(layer.mlp.down_proj, phase),
    }
    missing = [name for name, w in weights.items() if w is None]
    if missing:
        return (
            f"{phase} weights not float32-computed INT4 or per-channel FP8 (fused kernel), "
            f"or biased beyond q/k/v ({', '.join(missing)})"
        )
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
    bias = layer.qkv_proj.by_phase[phase].bias
    return DecodeLayerSpec.build(
        cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, eps, in_w, post_w, **weights,
        qkv_bias=bias, qk_norms=qk_norms, window=layer.window,
    )  # fmt: skip


def _model_reason(
    layers: list[DecoderLayer], dtype: torch.dtype, device: torch.device, rope_dims: int
) -> str:
    """Why no phase of the model can run natively ("" when the model itself allows it)."""
    if not switch_on("native_decode"):
        return f"{ENV_VAR}=0"
    if device.type != "cpu" or dtype != torch.float32:
        return "not float32 on a CPU"
    if not layers or rope_dims != layers[0].cfg.head_dim or layers[0].cfg.head_dim % 2:
        return "partial RoPE"
    if library() is None:
        return "the native CPU kernels are unavailable"
    return ""


class NativeDecode:
    """Specs of every layer per served phase, and the per-step choice between this path and the
    torch one."""

    def __init__(self, specs: dict[str, list[DecodeLayerSpec]], fp8: set[str], head_dim: int) -> None:
        self.specs = specs  # weights phase -> every layer's spec
        self.fp8_phases = fp8  # phases with an FP8 projection: the fused kernel's rows and switch apply
        self.scale = head_dim**-0.5

    @classmethod
    def build(
        cls, layers: list[DecoderLayer], dtype: torch.dtype, device: torch.device, rope_dims: int
    ) -> tuple[NativeDecode | None, dict[str, str]]:
        """(NativeDecode or None when no phase is served, why each phase is not: "" when it is)."""
        reason = _model_reason(layers, dtype, device, rope_dims)
        if reason:
            return None, dict.fromkeys(PHASES, reason)
        specs: dict[str, list[DecodeLayerSpec]] = {}
        fp8: set[str] = set()
        reasons = dict.fromkeys(PHASES, "")
        for phase in PHASES:
            built = []
            for layer in layers:
                spec = _layer_spec(layer, phase)
                if isinstance(spec, str):
                    reasons[phase] = f"layer {layer.idx}: {spec}"
                    break
                built.append(spec)
            else:
                specs[phase] = built
                if any(type(w.by_phase[phase]) is Fp8Linear for layer in layers for w in layer.linears()):
                    fp8.add(phase)
        return (cls(specs, fp8, layers[0].cfg.head_dim) if specs else None), reasons

    def serves(self, b: StepBatch, weights_phase: str) -> list[LayerPages] | None:
        """This step's (caches, scales, C modes) per layer when the native path runs it, else None."""
        specs = self.specs.get(weights_phase)
        if specs is None or not switch_on("native_decode"):
            return None
        t = b.input_ids.numel()
        if b.phase != "decode" and t >= PREFILL_BELOW_TOKENS:
            return None
        if weights_phase in self.fp8_phases and (t >= FUSED_BELOW_ROWS or not fp8_native_available()):
            return None  # the torch path's own choice for these rows
        if select_backend(b.input_ids.device, b.kernel_backend) != "cpu":
            return None
        pages = []
        for i in range(len(specs)):
            cache, scales = b.kv.layer_cache(i), b.kv.layer_scales(i)
            modes = page_modes(cache, scales)
            if modes is None or (b.phase != "decode" and modes != (MODE_F32, MODE_F32)):
                return None
            pages.append((cache, scales, modes))
        return pages

    def run(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        b: StepBatch,
        pages: list[LayerPages],
        weights_phase: str,
    ):
        """Every layer of this step with ``weights_phase``'s weights -> the last hidden states [T, hidden]."""
        if b.phase == "decode":
            record("decode_layers", "native")
            tables, lens = b.block_tables, b.context_lens
        else:
            record("prefill_layers", "native")
            tables, lens = token_tables(b.block_tables, b.cu_q_lens, b.positions)
        return run_decode_layers(
            self.specs[weights_phase],
            x,
            cos,
            sin,
            b.slot_mapping,
            tables,
            lens,
            pages,
            self.scale,
            torch.get_num_threads(),
        )
