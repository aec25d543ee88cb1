"""Llama-family decoder over a paged KV cache: Llama, Mistral, SmolLM2, Qwen2 (qkv bias), Qwen3
(q/k norm), and the MoE families Qwen3-MoE and GLM-4.5/4.6 (partial RoPE, attention bias, optional
q/k norm, shared experts), whose sparse layers' MLP comes from models/moe.py. The whole model
(``LlamaForCausalLM``: embeddings, layers, head) also serves DeepSeek-V3, whose layers are
models/mla.py's ``MlaDecoderLayer``. Linear layers and expert stacks hold one weight format per
phase."""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.nn.functional as F

from pagoda.kernels.fp8 import Fp8Weight
from pagoda.kernels.fp8_block import Fp8BlockWeight
from pagoda.kernels.int4 import Int4Weight
from pagoda.kernels.int8 import exact_int8_head
from pagoda.kernels.linear import Int8Linear
from pagoda.kernels.paged_attention import paged_decode_attention, paged_prefill_attention, write_kv
from pagoda.kernels.selector import KernelSelection, select_kernels
from pagoda.node_agent.models.batch import StepBatch
from pagoda.node_agent.models.config import ModelConfig
from pagoda.node_agent.models.decoder import LayerBase
from pagoda.node_agent.models.layers import (  # noqa: F401  (PHASES, prequantized_format: re-exported)
    PHASES,
    PhaseLinear,
    RMSNorm,
    fused_linear,
    prequantized_format,
)
from pagoda.node_agent.models.mla import MlaDecoderLayer
from pagoda.node_agent.models.native_decode import NativeDecode
from pagoda.node_agent.models.parallel import ColumnShard, TensorParallel
from pagoda.node_agent.models.rope import apply_rope, rope_tables  # noqa: F401  (re-exported)
from pagoda.node_agent.models.step_ops import OPS
from pagoda.node_agent.models.weight_bytes import weight_breakdown

HEAD_INT4_GROUP = 32

log = logging.getLogger("pagoda.models")


def _to_device(v, device: torch.device):
    """A tensor, or a fresh copy of a prequantized weight (never mutating the loaded one), on device."""
    if isinstance(v, ColumnShard):
        amax = None if v.row_amax is None else v.row_amax.to(device)
        return dataclasses.replace(v, weight=_to_device(v.weight, device), row_amax=amax)
    if isinstance(v, Int4Weight):
        return Int4Weight.from_state({k: t.to(device) for k, t in v.state().items()}, v.meta())
    if isinstance(v, Fp8Weight):
        return Fp8Weight(v.weight.to(device), v.scale.to(device))
    if isinstance(v, Fp8BlockWeight):
        return v.to(device)
    return v.to(device)


class DecoderLayer(LayerBase):
    """A Llama-family layer: grouped-query attention over K/V pages (fused q/k/v where the weights
    stack exactly, optional q/k norms and qkv bias), then the layer's dense or MoE MLP."""

    def __init__(
        self,
        cfg: ModelConfig,
        idx: int,
        w: dict[str, torch.Tensor],
        formats: dict[str, str],
        dtype: torch.dtype,
        kernels: KernelSelection | None,
        group_size: int | None = None,
        tp: TensorParallel | None = None,
    ) -> None:
        p = f"model.layers.{idx}."

        def lin(name: str) -> PhaseLinear:
            return PhaseLinear(
                w[p + name + ".weight"], w.get(p + name + ".bias"), formats, dtype, kernels, group_size
            )

        names = [p + f"self_attn.{n}_proj" for n in "qkv"]
        self.qkv_proj = fused_linear(w, names, formats, dtype, kernels, group_size)
        self.qkv_sizes = [cfg.num_heads * cfg.head_dim] + [cfg.num_kv_heads * cfg.head_dim] * 2
        self.q_proj = self.k_proj = self.v_proj = None
        if self.qkv_proj is None:  # weights of different kinds: three GEMMs
            self.q_proj, self.k_proj, self.v_proj = (
                lin("self_attn.q_proj"),
                lin("self_attn.k_proj"),
                lin("self_attn.v_proj"),
            )
        self.o_proj = lin("self_attn.o_proj")
        super().__init__(cfg, idx, w, formats, dtype, kernels, group_size, tp)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(w[p + "self_attn.q_norm.weight"].to(dtype), cfg.rms_norm_eps)
            self.k_norm = RMSNorm(w[p + "self_attn.k_norm.weight"].to(dtype), cfg.rms_norm_eps)

    def linears(self) -> list[PhaseLinear]:
        """Attention, dense-MLP and shared-expert linear layers (not the routed experts)."""
        attn = [self.qkv_proj] if self.qkv_proj is not None else [self.q_proj, self.k_proj, self.v_proj]
        return [*attn, self.o_proj, *self.mlp.linears()]

    def qkv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, phase: str):
        cfg = self.cfg
        t = h.shape[0]
        hq, hkv = cfg.num_heads, cfg.num_kv_heads
        if self.qkv_proj is not None and self.q_norm is None:  # one RoPE over q and k heads side by side
            return OPS["rope_qk"](self.qkv_proj(h, phase), cos, sin, hq, hkv, cfg.head_dim)
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(h, phase).split(self.qkv_sizes, dim=-1)
        else:
            q, k, v = self.q_proj(h, phase), self.k_proj(h, phase), self.v_proj(h, phase)
        q = q.reshape(t, cfg.num_heads, cfg.head_dim)
        k = k.reshape(t, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(t, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, b: StepBatch, phase: str
    ) -> torch.Tensor:
        cfg = self.cfg
        q, k, v = self.qkv(self.input_norm(x), cos, sin, phase)
        cache = b.kv.layer_cache(self.idx)
        scales = b.kv.layer_scales(self.idx)
        ks, vs = scales.get("k"), scales.get("v")
        write_kv(cache["k"], cache["v"], k, v, b.slot_mapping, ks, vs, backend=b.kernel_backend)
        scale = cfg.head_dim**-0.5
        if b.phase == "decode":
            o = paged_decode_attention(
                q,
                cache["k"],
                cache["v"],
                b.block_tables,
                b.context_lens,
                scale,
                ks,
                vs,
                backend=b.kernel_backend,
                window=self.window,
            )
        else:
            o = paged_prefill_attention(
                q,
                cache["k"],
                cache["v"],
                b.block_tables,
                b.cu_q_lens,
                b.context_lens,
                scale,
                ks,
                vs,
                backend=b.kernel_backend,
                window=self.window,
            )
        attn = self._reduce(self.o_proj(o.reshape(x.shape[0], -1), phase))
        x, h = OPS["add_rms_norm"](x, attn, *self.post_norm.args())
        return x + self._reduce(self.mlp(h, phase))


class LlamaForCausalLM:
    """The whole decoder: embeddings, layers, final norm and LM head (tied or not)."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict[str, torch.Tensor],
        formats: dict[str, str],
        dtype: torch.dtype,
        device: torch.device,
        kernels: KernelSelection | None = None,
        int4_group_size: int | None = None,
        decode_head_format: str = "dense",
        head_phases_shared: bool = False,
        tp: TensorParallel | None = None,
    ) -> None:
        self.cfg = cfg  # under tensor parallelism: this rank's slice (its heads and MLP width)
        # which backend runs each op (kernels/selector.py); raises where the native kernels should
        # run but do not build
        self.kernels = kernels = kernels or select_kernels(device, dtype)
        backend = kernels.backend
        self.dtype = dtype
        self.device = device
        self.tp = tp
        w = {k: _to_device(v, device) for k, v in weights.items()}
        self.embed = w["model.embed_tokens.weight"].to(dtype)
        layer_type = MlaDecoderLayer if cfg.mla is not None else DecoderLayer
        self.layers = [
            layer_type(cfg, i, w, formats, dtype, kernels, int4_group_size, tp) for i in range(cfg.num_layers)
        ]
        self.norm = RMSNorm(w["model.norm.weight"].to(dtype), cfg.rms_norm_eps)
        head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
        # The LM head per phase: dense in prefill; in decode dense, int8 (per row unless exact) or int4
        # (group 32); auto: int8 where it loses nothing and a native kernel runs it, else dense
        exact = exact_int8_head(head, dtype, device) if decode_head_format == "auto" else None
        if decode_head_format == "auto":
            decode_head_format = "int8" if exact is not None else "dense"
        self.decode_head_format = decode_head_format  # as built: dense, int8 or int4
        decode_head = "bf16" if decode_head_format == "dense" else decode_head_format
        # (a decode-only worker runs its rare prefill-phase steps on the decode head too)
        head_formats = {"prefill": decode_head if head_phases_shared else "bf16", "decode": decode_head}
        built = {"int8": Int8Linear(exact, dtype, backend)} if exact is not None else None  # checked once
        self.lm_head = PhaseLinear(
            head, None, head_formats, dtype, kernels, group_size=HEAD_INT4_GROUP, built=built
        )
        self.cos, self.sin = rope_tables(cfg, cfg.max_position, device)
        # decode steps and small prefill chunks as one native call per layer where every layer
        # allows it (CPU, float32, INT4 or per-channel FP8 weights)
        self.native, reasons = NativeDecode.build(self.layers, dtype, device, self.cos.shape[-1])
        self.native_reason = reasons["decode"]  # why decode steps run the torch path ("" if not)
        self.native_reasons = reasons
        for phase, op in (("decode", "decode_layers"), ("prefill", "prefill_layers")):
            if not reasons[phase]:
                kernels.note(op, "native", "every layer one native call (float32, INT4 or FP8 weights)")
            elif kernels.table[op].backend == "native":
                kernels.note(op, "off", reasons[phase])
        if self.decode_head_format != "int8":
            kernels.note("int8_head_gemm", "unused", f"the decode LM head is {self.decode_head_format}")
        kernels.log_table()

    @torch.inference_mode()
    def hidden(self, b: StepBatch, weights_phase: str | None = None) -> torch.Tensor:
        """Run every layer (writing KV into the pool); returns the last hidden states [T, hidden]."""
        x = (
            F.embedding(b.input_ids, self.embed)
            if self.tp is None
            else self.tp.embed(b.input_ids, self.embed)
        )
        cos, sin = self.cos[b.positions], self.sin[b.positions]
        phase = weights_phase or b.phase
        pages = self.native.serves(b, phase) if self.native is not None else None
        if pages is not None:
            try:
                return self.native.run(x, cos, sin, b, pages, phase)
            except FloatingPointError as exc:  # NaN or inf on the way: the torch path gives float semantics
                log.warning(
                    "native %s step fell back to the per-op path: %s", b.phase, exc
                )  # (x is untouched)
        for layer in self.layers:
            x = layer.forward(x, cos, sin, b, phase)
        return x

    @torch.inference_mode()
    def forward(self, b: StepBatch, weights_phase: str | None = None) -> torch.Tensor:
        """Run one step; returns logits [len(logits_indices), vocab] in float32. ``weights_phase``
        overrides which phase's weights run (the attention path still follows ``b.phase``). Under
        tensor parallelism only rank 0's logits are whole."""
        x = self.norm(self.hidden(b, weights_phase)[b.logits_indices])
        logits = self.lm_head(x, weights_phase or b.phase).float()
        return logits if self.tp is None else self.tp.gather_logits(logits)

    def forward_no_logits(self, b: StepBatch) -> None:
        """A prefill chunk that samples nothing: only its KV matters."""
        self.hidden(b)

    def weight_bytes(self) -> dict:
        """Resident bytes (all held formats) by part (``embeddings``, ``attention``, ``mlp``,
        ``experts``, ``other``), ``linear`` (attention + mlp), ``total`` and ``by_format``
        (models/weight_bytes.py)."""
        return weight_breakdown(self)
