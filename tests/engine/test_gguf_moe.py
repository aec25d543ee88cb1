"""Mixture-of-experts GGUF files load into the engine: a tiny random transformers model is written
with ``gguf.GGUFWriter`` under llama.cpp's metadata keys and tensor names (experts stacked
[E, out, in], one expert stack in Q8_0) with the built-in model's tokenizer metadata, and its
logits and greedy output match transformers. The families not built yet stay refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pagoda.node_agent.engine.config import EngineConfig, PhaseFormats
from pagoda.node_agent.engine.llm_engine import LLMEngine
from pagoda.node_agent.engine.sequence import SamplingParams
from pagoda.node_agent.models.moe import MoeMLP

from .test_moe_models import COMMON

MAX_ABS_LOGIT_DIFF = 1e-3  # float32 end to end, as in test_moe_models
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPT = "Mixture of experts models route every token to a few experts."


def _copy_tokenizer_fields(writer, source: Path) -> None:
    """The built-in SmolLM2 GGUF's tokenizer.* metadata (the tiny models share its 49152 vocabulary)."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, field.contents())
        elif vtype == gguf.GGUFValueType.STRING:
            writer.add_string(key, field.contents())
        else:
            writer.add_key_value(key, field.contents(), vtype)


def _q8_roundtrip(arr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(Q8_0 bytes, their dequantized float32 values) of a float32 array."""
    import gguf

    q = gguf.quants.quantize(arr, gguf.GGMLQuantizationType.Q8_0)
    return q, gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0).astype(np.float32)


def _write_qwen3moe(model, path: Path, builtin_gguf: Path) -> None:
    """What llama.cpp's Qwen3MoeModel converter writes: no q/k row permutation (NeoX RoPE), experts
    stacked per projection. Layer 0's down-projection stack goes out as Q8_0; the transformers
    model gets the dequantized values so both sides compute with the same weights."""
    import gguf

    cfg = model.config
    arch = "qwen3moe"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    _copy_tokenizer_fields(w, builtin_gguf)

    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    names = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "mlp.gate": "ffn_gate_inp",
    }
    ff = cfg.moe_intermediate_size
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        for hf, gg in names.items():
            w.add_tensor(f"blk.{i}.{gg}.weight", sd[p + hf + ".weight"])
        gate_up = sd[p + "mlp.experts.gate_up_proj"]  # [E, 2*ff, hidden]: gate rows, then up rows
        w.add_tensor(f"blk.{i}.ffn_gate_exps.weight", np.ascontiguousarray(gate_up[:, :ff]))
        w.add_tensor(f"blk.{i}.ffn_up_exps.weight", np.ascontiguousarray(gate_up[:, ff:]))
        down = sd[p + "mlp.experts.down_proj"]  # [E, hidden, ff]
        if i == 0:
            q, deq = _q8_roundtrip(down)
            w.add_tensor(f"blk.{i}.ffn_down_exps.weight", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            with torch.no_grad():
                layer.mlp.experts.down_proj.copy_(torch.from_numpy(deq))
        else:
            w.add_tensor(f"blk.{i}.ffn_down_exps.weight", down)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_qwen3moe_gguf(tmp_path_factory, builtin_loaded):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from pagoda.node_agent.models.loader import resolve_source

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**COMMON, num_experts=8)).float().eval()
    for layer in model.model.layers:  # routers that matter
        torch.nn.init.normal_(layer.mlp.gate.weight, std=0.5)
    path = tmp_path_factory.mktemp("qwen3moe") / "tiny-qwen3moe.gguf"
    _write_qwen3moe(model, path, resolve_source("builtin://smollm2-135m")[1])
    engine = LLMEngine(
        EngineConfig(model=str(path), dtype="float32", formats=PhaseFormats.reference(), kv_memory=8 << 20)
    )
    return model, engine


def test_qwen3moe_gguf_structure(tiny_qwen3moe_gguf):
    _, engine = tiny_qwen3moe_gguf
    mc = engine.model_config
    assert mc.arch == "qwen3_moe" and mc.qk_norm and mc.head_dim == 16
    assert (mc.moe.num_experts, mc.moe.top_k, mc.moe.expert_intermediate_size) == (8, 2, 64)
    assert mc.moe.router == "softmax" and mc.moe.norm_topk_prob
    assert all(isinstance(layer.mlp, MoeMLP) for layer in engine.model.layers)


def test_qwen3moe_gguf_logits_and_greedy_match_transformers(tiny_qwen3moe_gguf):
    model, engine = tiny_qwen3moe_gguf
    ids = engine.tokenize(PROMPT * 2)
    with torch.inference_mode():
        want = model(torch.tensor([ids])).logits[0].float()
    got = engine.score(ids, phase="prefill")
    diff = (got - want).abs().max().item()
    assert diff <= MAX_ABS_LOGIT_DIFF, f"max |logit diff| {diff}"
    assert want.std().item() > 0.1  # the comparison is not between near-zero logits

    ids = engine.tokenize(PROMPT)
    rid = engine.add_request(ids, PARAMS)
    got_ids = engine.run_until_done()[rid].token_ids
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    assert got_ids == out[0, len(ids) :].tolist()


@pytest.mark.parametrize("arch, name", [("glm4moe", "GLM-4.5/4.6 MoE"), ("deepseek2", "DeepSeek-V3")])
def test_unbuilt_gguf_moe_families_are_refused(tmp_path, arch, name):
    import gguf

    from pagoda.node_agent.models.config import ModelLoadError
    from pagoda.node_agent.models.loader import load_model

    f = tmp_path / f"tiny-{arch}.gguf"
    w = gguf.GGUFWriter(str(f), arch)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match=f"'{arch}' \\({name}, mixture of experts\\).*hf-dir://"):
        load_model(str(f))


def test_qwen3moe_gguf_without_expert_keys_is_refused(tmp_path):
    import gguf

    from pagoda.node_agent.models.config import ModelLoadError
    from pagoda.node_agent.models.loader import load_model

    f = tmp_path / "tiny-qwen3moe.gguf"
    w = gguf.GGUFWriter(str(f), "qwen3moe")
    for key, value in dict(
        context_length=64, embedding_length=64, block_count=1, feed_forward_length=128
    ).items():
        w.add_uint32(f"qwen3moe.{key}", value)
    w.add_head_count(4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="misses qwen3moe.expert_count"):
        load_model(str(f))
