"""Architecture hyper-parameters of a Llama-family model (dense, or with mixture-of-experts MLPs),
read from GGUF or HF config.json."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

SUPPORTED_ARCHITECTURES = {
    # HF `architectures[0]` / `model_type` and GGUF `general.architecture` -> family name
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Glm4MoeForCausalLM": "glm4_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "glm4_moe": "glm4_moe",
    "deepseek_v3": "deepseek_v3",
    "kimi_k2": "deepseek_v3",
}
# Families whose MLPs are (partly) mixtures of experts; loaded from Hugging Face directories only.
MOE_FAMILIES = ("qwen3_moe", "glm4_moe", "deepseek_v3")
# GGUF `general.architecture` names of MoE families the GGUF loader still refuses, with a readable
# name (none now: qwen3moe, glm4moe and deepseek2 load, node_agent/models/gguf_names.py; other
# architectures are refused as unsupported).
GGUF_MOE_ARCHITECTURES: dict[str, str] = {}


# Per-layer weights of a dense Llama-family block (HF names, without "model.layers.N." and ".weight")
ATTENTION_NAMES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
MLP_NAMES = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # a dense MLP (not the MoE layers)
LINEAR_NAMES = ATTENTION_NAMES + MLP_NAMES
NORM_NAMES = ("input_layernorm", "post_attention_layernorm")
# Multi-head latent attention (DeepSeek-V3): q_a/q_b with a norm (or a plain q_proj), the joint
# latent + rope-key projection, its norm, the latent's up-projection to K_nope and V, and o_proj.
MLA_Q_LORA_NAMES = ("self_attn.q_a_proj", "self_attn.q_a_layernorm", "self_attn.q_b_proj")
MLA_NAMES = (
    "self_attn.kv_a_proj_with_mqa",
    "self_attn.kv_a_layernorm",
    "self_attn.kv_b_proj",
    "self_attn.o_proj",
)


class ModelLoadError(ValueError):
    """A model source is missing, malformed or of an unsupported architecture."""


@dataclass
class MoeConfig:
    """The mixture-of-experts MLP of the sparse layers (the other layers keep a dense MLP).

    router "softmax" (Qwen3-MoE): softmax over all experts, top-k, optionally renormalized.
    router "sigmoid_grouped" (GLM-4.5): sigmoid scores; experts chosen on score + correction bias
    within the ``topk_group`` best of ``n_group`` groups (a group's score: its best two experts);
    the weights are the chosen experts' plain scores, optionally renormalized, times
    ``routed_scaling_factor``; ``n_shared_experts`` always-on experts are added."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    sparse_layers: tuple[int, ...]
    router: str = "softmax"
    norm_topk_prob: bool = True
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0

    def __post_init__(self) -> None:
        self.sparse_layers = tuple(int(i) for i in self.sparse_layers)
        e, k = self.num_experts, self.top_k
        if e < 1 or not 1 <= k <= e:
            raise ModelLoadError(f"num_experts_per_tok ({k}) must be in [1, num_experts ({e})]")
        if self.expert_intermediate_size < 1:
            raise ModelLoadError(
                f"moe_intermediate_size must be positive, got {self.expert_intermediate_size}"
            )
        if self.router not in ("softmax", "sigmoid_grouped"):
            raise ModelLoadError(f"unknown MoE router {self.router!r}")
        if self.router == "sigmoid_grouped":
            g, tg = self.n_group, self.topk_group
            if g < 1 or e % g or not 1 <= tg <= g:
                raise ModelLoadError(
                    f"n_group ({g}) must divide the experts ({e}) and topk_group ({tg}) be in [1, n_group]"
                )
            if e // g < 2 or k > tg * (e // g):
                raise ModelLoadError(
                    f"groups of {e // g} experts cannot give top-{k} from {tg} group(s) (each group needs >= 2)"
                )


@dataclass
class MlaConfig:
    """Multi-head latent attention: per token the cache holds the ``kv_lora_rank`` latent (after
    kv_a_layernorm) and the ``qk_rope_head_dim`` rope key shared by all heads (after RoPE).

    ``softmax_scale`` is qk_head_dim ** -0.5 times YaRN's mscale(factor, mscale_all_dim) ** 2;
    ``rope_interleave``: the rope dims come in (even, odd) pairs (DeepSeek's released weights)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    softmax_scale: float
    rope_interleave: bool = True

    def __post_init__(self) -> None:
        dims = (self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim)
        if (
            min(dims) < 1
            or self.qk_rope_head_dim % 2
            or (self.q_lora_rank is not None and self.q_lora_rank < 1)
        ):
            raise ModelLoadError(
                f"MLA dimensions must be positive (qk_rope_head_dim even): q_lora_rank={self.q_lora_rank}, "
                f"kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim = {dims}"
            )


@dataclass
class ModelConfig:
    """What the engine needs to know about a dense Llama-family decoder."""

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # qwen2: bias on q/k/v projections
    qk_norm: bool = False  # qwen3: RMSNorm on each head of q and k
    sliding_window: int | None = None  # keys a query sees, itself included (None: all before it)
    sliding_layers: tuple[int, ...] | None = None  # the layers that use the window (None: every one)
    rope_scaling: dict | None = field(default=None)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    rotary_dim: int | None = None  # leading dims of each head that RoPE rotates (None: all; GLM: half)
    moe: MoeConfig | None = None  # the MoE layers' hyper-parameters (None: a dense model)
    mla: MlaConfig | None = None  # multi-head latent attention (None: GQA attention)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.rotary_dim is None:
            self.rotary_dim = self.head_dim
        if not (0 < self.rotary_dim <= self.head_dim) or self.rotary_dim % 2:
            raise ModelLoadError(
                f"rotary dimension {self.rotary_dim} must be even and within head_dim ({self.head_dim})"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ModelLoadError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.sliding_layers is not None:
            self.sliding_layers = tuple(int(i) for i in self.sliding_layers)
        if isinstance(self.moe, dict):  # read back from a JSON cache entry
            self.moe = MoeConfig(**self.moe)
        if isinstance(self.mla, dict):
            self.mla = MlaConfig(**self.mla)
        if self.moe is not None and any(not 0 <= i < self.num_layers for i in self.moe.sparse_layers):
            raise ModelLoadError(f"MoE layers {self.moe.sparse_layers} outside the {self.num_layers} layers")

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (a query at position p sees keys p - window < j <= p),
        or None when the layer attends to every earlier token."""
        if self.sliding_window is None:
            return None
        if self.sliding_layers is not None and layer not in self.sliding_layers:
            return None
        return self.sliding_window

    def is_sparse(self, layer: int) -> bool:
        """Whether ``layer``'s MLP is a mixture of experts."""
        return self.moe is not None and layer in self.moe.sparse_layers


def attention_weight_names(cfg: ModelConfig) -> tuple[str, ...]:
    """Per-layer attention weight names (without ``model.layers.N.`` and ``.weight``)."""
    if cfg.mla is None:
        return ATTENTION_NAMES
    q = MLA_Q_LORA_NAMES if cfg.mla.q_lora_rank is not None else ("self_attn.q_proj",)
    return q + MLA_NAMES


def family_of(name: str) -> str:
    """Map an architecture name to a supported family or raise a clear error."""
    fam = SUPPORTED_ARCHITECTURES.get(name)
    if fam is None:
        supported = sorted({v for v in SUPPORTED_ARCHITECTURES.values()})
        raise ModelLoadError(f"unsupported architecture {name!r}; supported: {', '.join(supported)}")
    return fam


def _moe_from_hf(fam: str, cfg: dict, num_layers: int) -> MoeConfig | None:
    """The MoE hyper-parameters of a qwen3_moe / glm4_moe config.json (None for dense families)."""
    if fam == "qwen3_moe":
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        if experts == 0:  # transformers builds every layer dense then
            return None
        dense = {int(i) for i in cfg.get("mlp_only_layers") or ()}
        step = int(cfg.get("decoder_sparse_step", 1))
        if step < 1:
            raise ModelLoadError(f"decoder_sparse_step must be >= 1, got {step}")
        return MoeConfig(
            num_experts=experts,
            top_k=int(cfg["num_experts_per_tok"]),
            expert_intermediate_size=int(cfg["moe_intermediate_size"]),
            sparse_layers=tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0),
            router="softmax",
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        )
    if fam in ("glm4_moe", "deepseek_v3"):
        first_dense = int(cfg.get("first_k_dense_replace", 1))
        return MoeConfig(
            num_experts=int(cfg.get("n_routed_experts") or cfg["num_local_experts"]),
            top_k=int(cfg["num_experts_per_tok"]),
            expert_intermediate_size=int(cfg["moe_intermediate_size"]),
            sparse_layers=tuple(range(max(first_dense, 0), num_layers)),
            router="sigmoid_grouped",
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            n_group=int(cfg.get("n_group") or 1),
            topk_group=int(cfg.get("topk_group") or 1),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            n_shared_experts=int(cfg.get("n_shared_experts") or 0),
        )
    return None


def _sliding_from_hf(fam: str, cfg: dict, num_layers: int) -> dict:
    """``sliding_window`` and ``sliding_layers`` as transformers reads them: Mistral windows every
    layer whenever ``sliding_window`` is set; Qwen2 / Qwen3 only with ``use_sliding_window``, on the
    layers ``layer_types`` marks "sliding_attention" (without it: layers >= ``max_window_layers``);
    Qwen3-MoE every layer with ``use_sliding_window``; the other families never."""
    window = cfg.get("sliding_window")
    if fam == "mistral":
        layers = None
    elif fam in ("qwen2", "qwen3", "qwen3_moe") and cfg.get("use_sliding_window", False):
        layers = None
        if fam != "qwen3_moe":
            kinds = cfg.get("layer_types")
            if kinds:
                layers = tuple(i for i, k in enumerate(kinds) if k == "sliding_attention")
            else:
                layers = tuple(range(int(cfg.get("max_window_layers", 28)), num_layers))
    else:
        window = None
    if window is None or layers == ():
        return {"sliding_window": None, "sliding_layers": None}
    return {"sliding_window": int(window), "sliding_layers": layers}


def rope_params(cfg: dict) -> dict | None:
    """The RoPE scaling parameters of a config.json: ``rope_scaling`` (older files) overlaid by
    transformers 5's ``rope_parameters``; None when the type is default (plain RoPE)."""
    params = dict(cfg.get("rope_scaling") or {})
    params.update(cfg.get("rope_parameters") or {})
    kind = params.get("rope_type", params.get("type"))
    if kind in (None, "default"):
        return None
    params["rope_type"] = kind
    return params


# RoPE scalings every family takes: "linear" divides every frequency by ``factor``; "llama3" (Llama
# 3.1+) divides only the low frequencies, with a smooth ramp between ``low_freq_factor`` and
# ``high_freq_factor`` wavelengths of the original context
LLAMA_ROPE_TYPES = ("linear", "llama3")


def _check_llama_rope(p: dict) -> None:
    """ModelLoadError unless a linear / llama3 scaling has the numbers it needs."""
    need = ["factor"]
    if p["rope_type"] == "llama3":
        need += ["low_freq_factor", "high_freq_factor", "original_max_position_embeddings"]
    try:
        values = [float(p[k]) for k in need]
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"rope_scaling {p!r} needs numeric {', '.join(need)}") from exc
    if any(v <= 0 for v in values) or (p["rope_type"] == "llama3" and values[1] >= values[2]):
        raise ModelLoadError(
            f"rope_scaling {p!r}: values must be positive (and low_freq_factor < high_freq_factor)"
        )


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _mla_from_hf(cfg: dict, scaling: dict | None) -> MlaConfig:
    """DeepSeek-V3's attention dimensions and softmax scale (YaRN's mscale_all_dim squared)."""
    nope, rope = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"])
    scale = (nope + rope) ** -0.5
    if scaling and scaling.get("mscale_all_dim"):
        factor = _yarn_factor(cfg, scaling)
        scale *= yarn_mscale(factor, float(scaling["mscale_all_dim"])) ** 2
    q_rank = cfg.get("q_lora_rank")
    return MlaConfig(
        q_lora_rank=None if q_rank is None else int(q_rank),
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=int(cfg["v_head_dim"]),
        softmax_scale=scale,
        rope_interleave=bool(cfg.get("rope_interleave", True)),
    )


def _yarn_factor(cfg: dict, scaling: dict) -> float:
    factor = scaling.get("factor")
    if factor is None:
        factor = int(cfg.get("max_position_embeddings", 2048)) / int(
            scaling["original_max_position_embeddings"]
        )
    return float(factor)


def _rotary_dim(fam: str, cfg: dict, head_dim: int) -> int:
    """RoPE's rotated dimension: ``partial_rotary_factor`` of the head (top level or in
    rope_parameters; GLM-4.5's default is 0.5), the whole head otherwise."""
    params = cfg.get("rope_parameters") or {}
    factor = cfg.get("partial_rotary_factor") or params.get("partial_rotary_factor")
    if factor is None:
        factor = 0.5 if fam == "glm4_moe" else 1.0
    return int(head_dim * float(factor))


def config_from_hf(cfg: dict) -> ModelConfig:
    """Build a ModelConfig from a Hugging Face config.json dictionary."""
    archs = cfg.get("architectures") or [cfg.get("model_type", "")]
    fam = family_of(archs[0])
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ModelLoadError(f"hidden_act {act!r} is not supported (the MLPs are SwiGLU: silu)")
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        if fam == "deepseek_v3":  # RoPE covers only the shared rope key (transformers' head_dim)
            head_dim = int(cfg["qk_rope_head_dim"])
        num_layers = int(cfg["num_hidden_layers"])
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        rope_scaling = rope_params(cfg)
        kind = rope_scaling["rope_type"] if rope_scaling else None
        # DeepSeek-V3 takes YaRN (its released scaling), every other family linear and llama3
        allowed = ("yarn",) if fam == "deepseek_v3" else LLAMA_ROPE_TYPES
        if kind is not None and kind not in allowed:
            raise ModelLoadError(f"rope_scaling {rope_scaling!r} is not supported yet")
        if kind == "yarn":
            rope_scaling["factor"] = _yarn_factor(cfg, rope_scaling)
        elif kind is not None:
            _check_llama_rope(rope_scaling)
        rope_theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return ModelConfig(
            arch=fam,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=heads if fam == "deepseek_v3" else int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=fam == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=fam in ("qwen3", "qwen3_moe") or bool(cfg.get("use_qk_norm", False)),
            **_sliding_from_hf(fam, cfg, num_layers),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            rotary_dim=_rotary_dim(fam, cfg, head_dim),
            moe=_moe_from_hf(fam, cfg, num_layers),
            mla=_mla_from_hf(cfg, rope_scaling) if fam == "deepseek_v3" else None,
            rope_scaling=rope_scaling,
        )
    except KeyError as exc:
        raise ModelLoadError(f"config.json is missing required field {exc.args[0]!r}") from exc
