"""GGUF names of the mixture-of-experts families: llama.cpp's metadata keys and tensor names mapped
onto the config and Hugging Face weight names the HF-directory path produces.

Sources: the ``gguf`` package (``gguf/constants.py``: ``Keys.LLM`` for the ``{arch}.expert_*`` and
``nextn_predict_layers`` keys, ``ExpertGatingFuncType``, ``MODEL_TENSORS[MODEL_ARCH.QWEN3MOE /
GLM4_MOE]`` and ``TENSOR_NAMES`` for ``blk.N.ffn_gate_inp``, ``ffn_{gate,up,down}_exps``,
``ffn_*_shexp``, ``exp_probs_b``; ``gguf/tensor_mapping.py`` for the HF name each comes from, e.g.
GLM's ``post_attention_layernorm`` -> ``post_attention_norm``) and llama.cpp's ``convert_hf_to_gguf.py``
(``Qwen2MoeModel`` / ``Qwen3MoeModel`` / ``Glm4MoeModel``: experts stacked into one [E, out, in]
tensor per projection, ``e_score_correction_bias`` written as ``exp_probs_b.bias``, GLM's MTP
block counted in ``block_count``, q/k rows unpermuted because these families use NeoX-style
RoPE). The round trip is checked in tests/engine/test_gguf_moe.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagoda.node_agent.models.config import ModelLoadError, MoeConfig

# GGUF `general.architecture` -> family, for the MoE families the GGUF loader reads.
GGUF_MOE_FAMILIES = {"qwen3moe": "qwen3_moe", "glm4moe": "glm4_moe"}
# llama.cpp's `{arch}.expert_gating_func` values (gguf.ExpertGatingFuncType) and each family's router
_GATING = {1: "softmax", 2: "sigmoid"}
_FAMILY_GATING = {"qwen3moe": "softmax", "glm4moe": "sigmoid"}

# Per-layer MoE tensors (GGUF base name -> HF name under ``model.layers.N.``)
GGUF_MOE_LAYER_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
    # GLM-4.5's post-attention RMSNorm: llama.cpp's tensor map names it ATTN_POST_NORM for glm4moe
    "post_attention_norm": "post_attention_layernorm",
}
# Stacked experts [E, out, in] -> per-expert HF projections
GGUF_EXPERT_STACKS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
GGUF_MOE_BASES = frozenset(GGUF_MOE_LAYER_NAMES) | frozenset(GGUF_EXPERT_STACKS) | {"exp_probs_b"}


def moe_config_from_gguf(
    arch: str, meta: Callable[[str, object], object], tensors: dict, num_layers: int, where: str
) -> MoeConfig:
    """The MoE hyper-parameters from ``{arch}.expert_*`` keys; a layer is sparse when it has a router."""
    experts, used = meta("expert_count", None), meta("expert_used_count", None)
    ffn = meta("expert_feed_forward_length", None)
    if experts is None or used is None or ffn is None:
        raise ModelLoadError(
            f"{where}: GGUF metadata misses {arch}.expert_count, {arch}.expert_used_count or "
            f"{arch}.expert_feed_forward_length"
        )
    gating = meta("expert_gating_func", None)
    want = _FAMILY_GATING[arch]
    if gating is not None and _GATING.get(int(gating)) != want:
        raise ModelLoadError(f"{where}: {arch}.expert_gating_func {gating} is not {want} ({arch}'s router)")
    sparse = tuple(i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" in tensors)
    if arch == "qwen3moe":  # llama.cpp's qwen3moe graph always renormalizes (no key is written for it)
        return MoeConfig(
            num_experts=int(experts),
            top_k=int(used),
            expert_intermediate_size=int(ffn),
            sparse_layers=sparse,
            router="softmax",
            norm_topk_prob=bool(meta("expert_weights_norm", True)),
        )
    return MoeConfig(  # glm4moe: sigmoid scores + correction bias, grouped selection, shared experts
        num_experts=int(experts),
        top_k=int(used),
        expert_intermediate_size=int(ffn),
        sparse_layers=sparse,
        router="sigmoid_grouped",
        norm_topk_prob=bool(meta("expert_weights_norm", True)),
        n_group=int(meta("expert_group_count", 1) or 1),
        topk_group=int(meta("expert_group_used_count", 1) or 1),
        routed_scaling_factor=float(meta("expert_weights_scale", 1.0)),
        n_shared_experts=int(meta("expert_shared_count", 0)),
    )


def moe_tensor_to_hf(idx: str, base: str, suffix: str, arr: torch.Tensor) -> dict[str, torch.Tensor]:
    """HF weights for one per-layer MoE tensor (``base`` in GGUF_MOE_BASES)."""
    p = f"model.layers.{idx}."
    if base in GGUF_MOE_LAYER_NAMES:
        return {f"{p}{GGUF_MOE_LAYER_NAMES[base]}.{suffix}": arr}
    if base == "exp_probs_b":  # the router's score-correction bias (``exp_probs_b.bias``)
        return {f"{p}mlp.gate.e_score_correction_bias": arr}
    proj = GGUF_EXPERT_STACKS[base]
    if arr.dim() != 3:
        raise ModelLoadError(
            f"blk.{idx}.{base} must be a stacked [experts, out, in] tensor, got {tuple(arr.shape)}"
        )
    return {f"{p}mlp.experts.{e}.{proj}.{suffix}": arr[e] for e in range(arr.shape[0])}


def gguf_tokenizer(model_dir: str, gguf_file: str):
    """The transformers tokenizer of a GGUF file. transformers' AutoTokenizer reads the file's model
    config first and refuses architectures it has no model for (glm4moe); the tokenizer.* metadata
    it converts does not depend on them, so those go straight to the fast-tokenizer class."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        return AutoTokenizer.from_pretrained(model_dir, gguf_file=gguf_file)
    except ValueError as exc:
        if "is not supported yet" not in str(exc):
            raise
        return PreTrainedTokenizerFast.from_pretrained(model_dir, gguf_file=gguf_file)
