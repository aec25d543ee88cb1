"""Architecture hyper-parameters of a Llama-family model, read from GGUF or HF config.json."""

from __future__ import annotations

from dataclasses import dataclass, field

SUPPORTED_ARCHITECTURES = {
    # HF `architectures[0]` / `model_type` and GGUF `general.architecture` -> family name
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
}


# Per-layer weights of a dense Llama-family block (HF names, without "model.layers.N." and ".weight")
LINEAR_NAMES = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
NORM_NAMES = ("input_layernorm", "post_attention_layernorm")


class ModelLoadError(ValueError):
    """A model source is missing, malformed or of an unsupported architecture."""


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
    sliding_window: int | None = None
    rope_scaling: dict | None = field(default=None)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )


def family_of(name: str) -> str:
    """Map an architecture name to a supported family or raise a clear error."""
    fam = SUPPORTED_ARCHITECTURES.get(name)
    if fam is None:
        supported = sorted({v for v in SUPPORTED_ARCHITECTURES.values()})
        raise ModelLoadError(f"unsupported architecture {name!r}; supported: {', '.join(supported)}")
    return fam


def config_from_hf(cfg: dict) -> ModelConfig:
    """Build a ModelConfig from a Hugging Face config.json dictionary."""
    archs = cfg.get("architectures") or [cfg.get("model_type", "")]
    fam = family_of(archs[0])
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        rope_scaling = cfg.get("rope_scaling")
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) not in (None, "default"):
            raise ModelLoadError(f"rope_scaling {rope_scaling!r} is not supported yet")
        rope_theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return ModelConfig(
            arch=fam,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=fam == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=fam == "qwen3",
            sliding_window=cfg.get("sliding_window")
            if cfg.get("use_sliding_window", fam == "mistral")
            else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
    except KeyError as exc:
        raise ModelLoadError(f"config.json is missing required field {exc.args[0]!r}") from exc
