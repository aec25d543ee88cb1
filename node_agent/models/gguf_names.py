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

DeepSeek-V3 / Kimi-K2 (``deepseek2``), from ``DeepseekV2Model`` in convert_hf_to_gguf.py and the
``TextModel`` base it extends:

- attention: the file is written as MQA (``head_count_kv`` = 1), ``key_length`` = kv_lora_rank +
  qk_rope_head_dim and ``value_length`` = kv_lora_rank; the MLA head sizes are in
  ``key_length_mla`` (qk_nope + qk_rope) and ``value_length_mla`` (v_head_dim). Files from before
  llama.cpp's MLA change have no ``*_mla`` keys and hold qk_nope + qk_rope / v_head_dim in
  ``key_length`` / ``value_length``; both are accepted. qk_rope_head_dim is
  ``rope.dimension_count``, the ranks ``attention.q_lora_rank`` (absent: a plain ``attn_q``) and
  ``attention.kv_lora_rank``.
- tensors: q_a_proj/q_a_layernorm/q_b_proj -> ``attn_q_a``/``attn_q_a_norm``/``attn_q_b``,
  kv_a_proj_with_mqa -> ``attn_kv_a_mqa``, kv_a_layernorm -> ``attn_kv_a_norm``. The current
  converter splits kv_b_proj [H*(nope+v), kv_lora_rank] per head into ``attn_k_b``
  [H, kv_lora_rank, nope] (the key rows, transposed) and ``attn_v_b`` [H, v, kv_lora_rank]; older
  files keep ``attn_kv_b`` whole. q/k rows are not permuted and llama.cpp runs deepseek2 with
  interleaved (NORM) RoPE, so the weights are the released ones: ``rope_interleave`` stays True.
- YaRN: ``rope.scaling.type`` "yarn", ``.factor``, ``.original_context_length`` (and
  ``.yarn_beta_fast``/``.yarn_beta_slow`` when the config has them) from the base class;
  ``rope.scaling.yarn_log_multiplier`` = 0.1 * mscale_all_dim. llama.cpp's loader divides it by 0.1
  again (llama-model.cpp, TAG_DEEPSEEK2_YARN_LOG_MUL_FIX) and the deepseek2 graph scales scores by
  (1 + 0.1 * mscale_all_dim * ln(factor))^2 / sqrt(key_length_mla), i.e. transformers'
  yarn_mscale(factor, mscale_all_dim)^2 * qk_head_dim^-0.5. ``mscale`` itself is not stored;
  llama-context.cpp takes it equal to mscale_all_dim for deepseek2 (1.0 when mscale_all_dim is 1,
  as in DeepSeek-V3's and Kimi-K2's configs), so the rope tables' magnitude factor
  mscale / mscale_all_dim is 1; so does Pagoda.
- MoE: ``expert_count``, ``expert_used_count``, ``expert_feed_forward_length``,
  ``expert_shared_count``, ``leading_dense_block_count`` (first_k_dense_replace),
  ``expert_weights_scale`` (routed_scaling_factor, written only when set), ``expert_weights_norm``
  (written only when norm_topk_prob is true; llama.cpp's default false), ``expert_gating_func``
  (2 = sigmoid from scoring_func; llama.cpp reads an absent key as softmax, DeepSeek-V2 and V2.5,
  which is refused here),
  ``expert_group_count`` / ``expert_group_used_count`` (n_group / topk_group);
  e_score_correction_bias -> ``exp_probs_b.bias``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagoda.node_agent.models.config import MlaConfig, ModelLoadError, MoeConfig, yarn_mscale

# GGUF `general.architecture` -> family, for the MoE families the GGUF loader reads.
GGUF_MOE_FAMILIES = {"qwen3moe": "qwen3_moe", "glm4moe": "glm4_moe", "deepseek2": "deepseek_v3"}
# llama.cpp's `{arch}.expert_gating_func` values (gguf.ExpertGatingFuncType) and each family's router
_GATING = {1: "softmax", 2: "sigmoid"}
_FAMILY_GATING = {"qwen3moe": "softmax", "glm4moe": "sigmoid", "deepseek2": "sigmoid"}

# Per-layer MoE tensors (GGUF base name -> HF name under ``model.layers.N.``)
GGUF_MOE_LAYER_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
    # GLM-4.5's post-attention RMSNorm: llama.cpp's tensor map names it ATTN_POST_NORM for glm4moe
    "post_attention_norm": "post_attention_layernorm",
    # DeepSeek-V3's multi-head latent attention
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
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
    if arch == "deepseek2" and gating is None:  # llama.cpp reads an absent key as DeepSeek-V2's softmax
        raise ModelLoadError(
            f"{where}: deepseek2 without expert_gating_func is DeepSeek-V2 (softmax router), which is not "
            "supported; DeepSeek-V3 files carry expert_gating_func 2 (sigmoid)"
        )
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
    return (
        MoeConfig(  # glm4moe / deepseek2: sigmoid scores + correction bias, grouped selection, shared experts
            num_experts=int(experts),
            top_k=int(used),
            expert_intermediate_size=int(ffn),
            sparse_layers=sparse,
            router="sigmoid_grouped",
            # deepseek2's converter writes the key only when true (llama.cpp's default: false)
            norm_topk_prob=bool(meta("expert_weights_norm", arch != "deepseek2")),
            n_group=int(meta("expert_group_count", 1) or 1),
            topk_group=int(meta("expert_group_used_count", 1) or 1),
            routed_scaling_factor=float(meta("expert_weights_scale", 1.0)),
            n_shared_experts=int(meta("expert_shared_count", 0)),
        )
    )


def mla_from_gguf(meta: Callable[[str, object], object], where: str) -> tuple[MlaConfig, dict | None]:
    """deepseek2's MLA dimensions and softmax scale, and its YaRN rope scaling as transformers
    names it (None without YaRN)."""
    rope = meta("rope.dimension_count", None)
    kv_rank = meta("attention.kv_lora_rank", None)
    k_len = meta("attention.key_length_mla", None)
    v_len = meta("attention.value_length_mla", None)
    if k_len is None and v_len is None:  # files from before llama.cpp's MLA change
        k_len, v_len = meta("attention.key_length", None), meta("attention.value_length", None)
    if None in (rope, kv_rank, k_len, v_len):
        raise ModelLoadError(
            f"{where}: deepseek2 GGUF metadata misses rope.dimension_count, attention.kv_lora_rank or "
            "attention.key_length_mla / value_length_mla"
        )
    rope, k_len = int(rope), int(k_len)
    if k_len <= rope:
        raise ModelLoadError(f"{where}: MLA key length {k_len} must exceed rope.dimension_count {rope}")
    scale = k_len**-0.5
    scaling = None
    kind = meta("rope.scaling.type", None)
    if kind not in (None, "none"):
        if kind != "yarn":
            raise ModelLoadError(
                f"{where}: deepseek2 rope.scaling.type {kind!r} is not supported (only yarn)"
            )
        factor, orig = meta("rope.scaling.factor", None), meta("rope.scaling.original_context_length", None)
        if factor is None or orig is None or float(factor) <= 0:
            raise ModelLoadError(
                f"{where}: YaRN needs rope.scaling.factor > 0 and rope.scaling.original_context_length"
            )
        scaling = {
            "rope_type": "yarn",
            "factor": float(factor),
            "original_max_position_embeddings": int(orig),
        }
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if (value := meta(f"rope.scaling.{key}", None)) is not None:
                scaling[name] = float(value)
        log_mul = meta("rope.scaling.yarn_log_multiplier", None)
        if log_mul:  # 0.1 * mscale_all_dim; mscale is taken equal (rope magnitude factor 1)
            scaling["mscale"] = scaling["mscale_all_dim"] = float(log_mul) / 0.1
            scale *= yarn_mscale(float(factor), scaling["mscale_all_dim"]) ** 2
    q_rank = meta("attention.q_lora_rank", None)
    mla = MlaConfig(
        q_lora_rank=int(q_rank) if q_rank else None,
        kv_lora_rank=int(kv_rank),
        qk_nope_head_dim=k_len - rope,
        qk_rope_head_dim=rope,
        v_head_dim=int(v_len),
        softmax_scale=scale,
        rope_interleave=True,
    )
    return mla, scaling


def join_kv_b(k_b: torch.Tensor, v_b: torch.Tensor, mla: MlaConfig, where: str) -> torch.Tensor:
    """kv_b_proj [H*(nope+v), kv_lora_rank] from the converter's split ``attn_k_b``
    [H, kv_lora_rank, nope] (transposed key rows) and ``attn_v_b`` [H, v, kv_lora_rank]."""
    r, nope, v = mla.kv_lora_rank, mla.qk_nope_head_dim, mla.v_head_dim
    if k_b.dim() != 3 or tuple(k_b.shape[1:]) != (r, nope) or tuple(v_b.shape) != (k_b.shape[0], v, r):
        raise ModelLoadError(
            f"{where}: attn_k_b {tuple(k_b.shape)} / attn_v_b {tuple(v_b.shape)} do not match "
            f"[heads, {r}, {nope}] / [heads, {v}, {r}]"
        )
    return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, r).contiguous()


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


GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def gguf_to_hf_name(name: str) -> str | None:
    """The Hugging Face name of a dense model's GGUF tensor (None: an MoE, MLA or unknown one)."""
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    if not name.startswith("blk."):
        return None
    _, idx, rest = name.split(".", 2)
    base, _, suffix = rest.partition(".")
    hf = GGUF_LAYER_NAMES.get(base)
    return None if hf is None else f"model.layers.{idx}.{hf}.{suffix}"
