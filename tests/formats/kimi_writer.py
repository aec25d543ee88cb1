"""A tiny Kimi-K2 directory laid out as Moonshot releases Kimi-K2-Thinking, for the tests.

What the release holds, in small: ``config.json`` with ``model_type: kimi_k2`` (the DeepSeek-V3
architecture, ``architectures: [DeepseekV3ForCausalLM]``, an ``auto_map`` to its own modeling code)
and YaRN ``rope_scaling`` in the old spelling (``type: yarn``, beta_fast = beta_slow = 1); the
routed experts in compressed-tensors ``pack-quantized`` INT4 W4A16, symmetric, group 32; attention,
shared experts, the dense first layer, the router, embeddings and head in BF16; a tiktoken tokenizer
that is custom code (tests/data/kimi_k2: ``tokenization_kimi.py`` and its ``tiktoken.model`` ranks),
named by ``auto_map`` in ``tokenizer_config.json`` with the special tokens after the ranks.

The ranks were made by ``train_ranks`` on ``CORPUS`` (byte-level BPE: the 256 bytes, then the most
frequent adjacent pair merged, 240 times); the committed file is its output.
"""

from __future__ import annotations

import base64
import json
import shutil
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import save_file

from tests.formats.ct_writer import pack_rows, quant_config, quantize, weights_args
from tests.formats.test_checkpoint_formats import _fused, _per_expert
from tests.tiny_models import random_causal_lm

DATA = Path(__file__).resolve().parent.parent / "data" / "kimi_k2"
RANKS = 496  # byte-pair ranks in tiktoken.model: the 256 bytes and 240 merges
SPECIALS = [
    "[BOS]",
    "[EOS]",
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
]
RESERVED = 16  # special ids after the ranks (the named ones first, the rest reserved)
VOCAB = RANKS + RESERVED
GROUP = 32
CORPUS = (
    "Once upon a time there was a small model that learned to speak. The quick brown fox jumps over "
    "the lazy dog. Mixture of experts models route every token to a few experts, and the shared "
    "expert sees them all. Quantized weights move fewer bytes per decoded token; the attention stays "
    "in bfloat16. Paris is the capital of France, Rome the capital of Italy. def add(a, b): return "
    "a + b. 1 2 3 4 5 6 7 8 9 10. Tensor parallel ranks hold their share of the heads and experts. "
    "A tokenizer that needs custom code runs Python from the model directory, so it loads only when "
    "the operator trusts it. The released layout keeps each layer in the format it was stored in."
)
# Kimi-K2-Thinking's quantization_config.ignore: everything but the routed experts stays dense
IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]


def train_ranks(text: str, merges: int) -> dict[bytes, int]:
    """Byte-level BPE ranks of ``text`` (split into words the way tokenization_kimi.PATTERN does)."""
    import importlib.util

    import regex

    spec = importlib.util.spec_from_file_location("tokenization_kimi", DATA / "tokenization_kimi.py")
    code = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(code)
    words = Counter(tuple(bytes([b]) for b in w.encode()) for w in regex.findall(code.PATTERN, text))
    ranks = {bytes([b]): b for b in range(256)}
    for _ in range(merges):
        pairs: Counter = Counter()
        for w, n in words.items():
            for a, b in zip(w, w[1:], strict=False):
                pairs[a, b] += n
        if not pairs:
            break
        (a, b), _n = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        ranks[a + b] = len(ranks)
        merged = Counter()
        for w, n in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == (a, b):
                    out.append(a + b)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] += n
        words = merged
    return ranks


def ranks_text(ranks: dict[bytes, int]) -> str:
    """The tiktoken.model text of ``ranks``."""
    return "".join(
        f"{base64.b64encode(t).decode()} {r}\n" for t, r in sorted(ranks.items(), key=lambda x: x[1])
    )


def kimi_config(**over) -> dict:
    """config.json as released (tiny sizes): the DeepSeek-V3 fields, kimi_k2, YaRN, token ids."""
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_deepseek.DeepseekV3Config",
            "AutoModel": "modeling_deepseek.DeepseekV3Model",
            "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
        },
        "model_type": "kimi_k2",
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "routed_scaling_factor": 2.827,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "q_lora_rank": 32,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 50000.0,
        "max_position_embeddings": 4096,
        "rope_scaling": {
            "beta_fast": 1.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 128,
            "type": "yarn",
        },
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": RANKS,
        "eos_token_id": RANKS + 1,
        "pad_token_id": RANKS + 1,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "initializer_range": 0.05,
        "use_cache": True,
    }
    return cfg | over


def reference_config(cfg: dict):
    """The config transformers builds the reference from: kimi_k2 read as deepseek_v3 (this
    transformers has no kimi_k2 config class; the release's own configuration_deepseek.py is not
    shipped by this writer, and the architecture is the same)."""
    from transformers import DeepseekV3Config

    fields = {k: v for k, v in cfg.items() if k not in ("auto_map", "model_type", "architectures")}
    return DeepseekV3Config(**fields)


def tokenizer_config() -> dict:
    specials = SPECIALS + [f"<|reserved_token_{i}|>" for i in range(len(SPECIALS), RESERVED)]
    return {
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "tokenizer_class": "TikTokenTokenizer",
        "added_tokens_decoder": {
            str(RANKS + i): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i, t in enumerate(specials)
        },
        "additional_special_tokens": SPECIALS[2:],
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[EOS]",
        "unk_token": None,
        "model_max_length": 1000000,
        "clean_up_tokenization_spaces": False,
        "chat_template": (
            "{%- for m in messages -%}<|im_{{ m['role'] }}|>{{ m['role'] }}<|im_middle|>{{ m['content'] }}"
            "<|im_end|>{%- endfor -%}{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
            "{%- endif -%}"
        ),
    }


def _draw_routers(model) -> None:
    """Random routers and correction biases (transformers zero-initialises the biases)."""
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            torch.nn.init.normal_(gate.weight, std=0.5)
            gate.e_score_correction_bias.normal_(std=0.2)


def _routed_expert(name: str) -> bool:
    return ".mlp.experts." in name and name.endswith("_proj.weight")


def write_kimi_k2(path: Path, seed: int = 0, **over):
    """Write the directory into ``path``; returns (transformers reference model holding the
    checkpoint's exact values in float32, the config.json dictionary)."""
    cfg = kimi_config(**over)
    model = random_causal_lm(reference_config(cfg), seed=seed, prepare=_draw_routers)
    stored, exact = {}, {}
    for name, t in _per_expert(model.state_dict()).items():
        t = t.detach().float().contiguous()
        if _routed_expert(name):
            q, scale, _, idx = quantize(t, 4, GROUP, True)
            base = name.removesuffix(".weight")
            stored[base + ".weight_packed"] = pack_rows(q, 4)
            stored[base + ".weight_shape"] = torch.tensor(list(t.shape), dtype=torch.int64)
            stored[base + ".weight_scale"] = scale
            exact[name] = q.float() * scale.float()[:, idx]
        elif name.endswith("e_score_correction_bias"):  # float32 in the release
            stored[name] = exact[name] = t
        else:
            stored[name] = t.to(torch.bfloat16)
            exact[name] = stored[name].float()
    path.mkdir(parents=True, exist_ok=True)
    save_file(stored, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg["quantization_config"] = quant_config(
        {"group_0": (weights_args(4, GROUP, True) | {"actorder": None}, ["Linear"])}, IGNORE
    )
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2))
    (path / "generation_config.json").write_text(
        json.dumps({"bos_token_id": RANKS, "eos_token_id": RANKS + 1})
    )
    for f in ("tokenization_kimi.py", "tiktoken.model"):
        shutil.copy(DATA / f, path / f)
    model.load_state_dict(_fused(exact, model.state_dict()))
    return model, cfg
