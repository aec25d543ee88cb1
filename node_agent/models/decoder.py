"""What every decoder layer family shares: the two RMSNorms around attention, the layer's MLP (dense,
or a mixture of experts on a MoE family's sparse layers) and the tensor-parallel reduction of
partial sums. The attention of each family lives in its own file: models/llama.py (grouped-query
attention over K/V pages), models/mla.py (DeepSeek-V3 latent attention)."""

from __future__ import annotations

import torch

from pagoda.kernels.selector import KernelSelection
from pagoda.node_agent.models.config import ModelConfig
from pagoda.node_agent.models.layers import DenseMLP, PhaseLinear, RMSNorm
from pagoda.node_agent.models.moe import MoeMLP, layer_mlp
from pagoda.node_agent.models.parallel import TensorParallel


class LayerBase:
    """Norms, MLP and the TP reduction of layer ``idx``; subclasses add attention."""

    mla = None  # a latent-attention layer's MlaAttention (models/mla.py), None for the others
    qkv_proj: PhaseLinear | None = None
    q_norm: RMSNorm | None = None
    k_norm: RMSNorm | None = None

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
        self.idx = idx
        self.cfg = cfg
        self.window = cfg.layer_window(idx)  # sliding-window attention: keys per query (None: all)
        self.tp = tp  # tensor parallel: o_proj and the MLP give partial sums, reduced here
        self.mlp: DenseMLP | MoeMLP = layer_mlp(cfg, idx, w, formats, dtype, kernels, group_size, tp)
        self.input_norm = RMSNorm(w[p + "input_layernorm.weight"].to(dtype), cfg.rms_norm_eps)
        self.post_norm = RMSNorm(w[p + "post_attention_layernorm.weight"].to(dtype), cfg.rms_norm_eps)

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The whole output from every rank's partial sum (the identity on one rank)."""
        return partial if self.tp is None else self.tp.all_reduce(partial)
