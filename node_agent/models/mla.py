"""DeepSeek-V3 multi-head latent attention (MLA) over the paged latent cache.

Per token the pool stores two one-head components (engine/kv_setup.kv_components): ``latent``
[1, kv_lora_rank] (kv_a_proj's latent after kv_a_layernorm) and ``rope_k`` [1, qk_rope_head_dim]
(the shared rope key after RoPE). Both phases use the absorbed form: W_UK (kv_b_proj's key rows)
folds into the query, attention runs in latent space (kernels/mla_attention.py) and W_UV (its value
rows) maps the result back per head before o_proj. kv_b_proj stays dense in the compute dtype (it
is only ever used as those two per-head matrices); q_a/q_b (or q_proj), kv_a and o_proj follow the
phase's weight format. ``MlaDecoderLayer`` is the whole layer (this attention, then the MLP)."""

from __future__ import annotations

import torch

from pagoda.kernels.mla_attention import paged_mla_attention
from pagoda.kernels.paged_attention import write_kv
from pagoda.kernels.selector import KernelSelection
from pagoda.node_agent.models.batch import StepBatch
from pagoda.node_agent.models.config import ModelConfig, ModelLoadError
from pagoda.node_agent.models.decoder import LayerBase
from pagoda.node_agent.models.layers import PhaseLinear, RMSNorm
from pagoda.node_agent.models.parallel import TensorParallel
from pagoda.node_agent.models.rope import apply_rope, deinterleave

# transformers' DeepseekV3RMSNorm default: q_a_layernorm and kv_a_layernorm do not take rms_norm_eps
MLA_NORM_EPS = 1e-6
LATENT, ROPE_K = "latent", "rope_k"


class MlaAttention:
    """One layer's MLA (``prefix`` is ``model.layers.N.self_attn.``)."""

    def __init__(
        self,
        cfg: ModelConfig,
        idx: int,
        prefix: str,
        w: dict[str, torch.Tensor],
        formats: dict[str, str],
        dtype: torch.dtype,
        kernels: KernelSelection | None,
        group_size: int | None = None,
    ) -> None:
        self.idx = idx
        self.m = m = cfg.mla
        self.heads = cfg.num_heads

        def lin(name: str, fmts: dict[str, str] = formats) -> PhaseLinear:
            return PhaseLinear(
                w[prefix + name + ".weight"], w.get(prefix + name + ".bias"), fmts, dtype, kernels, group_size
            )

        self.q_proj = self.q_a_proj = self.q_b_proj = self.q_a_norm = None
        if m.q_lora_rank is None:
            self.q_proj = lin("q_proj")
        else:
            self.q_a_proj, self.q_b_proj = lin("q_a_proj"), lin("q_b_proj")
            self.q_a_norm = RMSNorm(w[prefix + "q_a_layernorm.weight"].to(dtype), MLA_NORM_EPS)
        self.kv_a_proj = lin("kv_a_proj_with_mqa")
        self.kv_a_norm = RMSNorm(w[prefix + "kv_a_layernorm.weight"].to(dtype), MLA_NORM_EPS)
        self.o_proj = lin("o_proj")
        kv_b = w[prefix + "kv_b_proj.weight"]
        want = (self.heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)
        if tuple(kv_b.shape) != want:
            raise ModelLoadError(f"{prefix}kv_b_proj.weight: expected {want}, got {tuple(kv_b.shape)}")
        # dense in the compute dtype for both phases; W_UK / W_UV are views of its weight
        self.kv_b_proj = lin("kv_b_proj", dict.fromkeys(formats, "bf16"))
        wb = self.kv_b_proj.by_phase["decode"].weight.view(self.heads, -1, m.kv_lora_rank)
        self.w_uk = wb[:, : m.qk_nope_head_dim]  # [H, Dn, R]
        self.w_uv = wb[:, m.qk_nope_head_dim :]  # [H, Dv, R]

    def linears(self) -> list[PhaseLinear]:
        lins = [self.q_proj] if self.q_proj is not None else [self.q_a_proj, self.q_b_proj]
        return [*lins, self.kv_a_proj, self.kv_b_proj, self.o_proj]

    def norms(self) -> list[RMSNorm]:
        return [n for n in (self.q_a_norm, self.kv_a_norm) if n is not None]

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rope(deinterleave(x) if self.m.rope_interleave else x, cos, sin)

    def __call__(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, b: StepBatch, phase: str
    ) -> torch.Tensor:
        m, t = self.m, h.shape[0]
        if self.q_proj is not None:
            q = self.q_proj(h, phase)
        else:
            q = self.q_b_proj(self.q_a_norm(self.q_a_proj(h, phase)), phase)
        q = q.view(t, self.heads, m.qk_nope_head_dim + m.qk_rope_head_dim)
        q_nope, q_rope = q[..., : m.qk_nope_head_dim], self._rope(q[..., m.qk_nope_head_dim :], cos, sin)
        ckv = self.kv_a_proj(h, phase)
        latent = self.kv_a_norm(ckv[:, : m.kv_lora_rank]).view(t, 1, m.kv_lora_rank)
        k_rope = self._rope(ckv[:, m.kv_lora_rank :].view(t, 1, m.qk_rope_head_dim), cos, sin)
        cache, scales = b.kv.layer_cache(self.idx), b.kv.layer_scales(self.idx)
        ls, rs = scales.get(LATENT), scales.get(ROPE_K)
        write_kv(
            cache[LATENT], cache[ROPE_K], latent, k_rope, b.slot_mapping, ls, rs, backend=b.kernel_backend
        )
        q_lat = torch.einsum("thd,hdr->thr", q_nope, self.w_uk.to(q_nope.dtype))  # absorb W_UK
        o_lat = paged_mla_attention(
            q_lat,
            q_rope,
            cache[LATENT],
            cache[ROPE_K],
            b.block_tables,
            b.cu_q_lens,
            b.context_lens,
            m.softmax_scale,
            ls,
            rs,
            backend=b.kernel_backend,
        )
        o = torch.einsum("thr,hvr->thv", o_lat, self.w_uv.to(o_lat.dtype))  # W_UV after attention
        return self.o_proj(o.reshape(t, -1), phase)


class MlaDecoderLayer(LayerBase):
    """A DeepSeek-V3 decoder layer: latent attention, then the (dense or MoE) MLP."""

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
        p = f"model.layers.{idx}.self_attn."
        self.mla = MlaAttention(cfg, idx, p, w, formats, dtype, kernels, group_size)
        self.q_proj = self.k_proj = self.v_proj = None
        self.o_proj = self.mla.o_proj
        super().__init__(cfg, idx, w, formats, dtype, kernels, group_size, tp)

    def linears(self) -> list[PhaseLinear]:
        """Attention, dense-MLP and shared-expert linear layers (not the routed experts)."""
        return [*self.mla.linears(), *self.mlp.linears()]

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, b: StepBatch, phase: str
    ) -> torch.Tensor:
        x = x + self._reduce(self.mla(self.input_norm(x), cos, sin, b, phase))
        return x + self._reduce(self.mlp(self.post_norm(x), phase))
