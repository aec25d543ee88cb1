"""Mixture-of-experts GGUF files load into the engine: a tiny random transformers model is written
with ``gguf.GGUFWriter`` under llama.cpp's metadata keys and tensor names (experts stacked
[E, out, in], one expert stack in Q8_0) with the built-in model's tokenizer metadata, and its
logits and greedy output match transformers (qwen3moe, glm4moe, and deepseek2 with MLA, YaRN and
the split attn_k_b/attn_v_b). Other MoE architectures stay refused."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from pagoda.node_agent.engine.config import EngineConfig, PhaseFormats
from pagoda.node_agent.engine.llm_engine import LLMEngine
from pagoda.node_agent.models.moe import MoeMLP
from pagoda.node_agent.params import SamplingParams

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


def _write_gguf(model, path: Path, arch: str, builtin_gguf: Path) -> None:
    """What llama.cpp's Qwen3MoeModel / Glm4MoeModel converters write: tensor names from gguf's own
    tensor map, no q/k row permutation (NeoX RoPE), experts stacked per projection, GLM's
    multi-token-prediction block counted in block_count. Layer 1's down-projection stack goes out
    as Q8_0; the transformers model gets the dequantized values so both compute with the same weights."""
    import gguf

    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    nextn = int(getattr(cfg, "num_nextn_predict_layers", 0) or 0) if arch == "glm4moe" else 0
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers + nextn)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.num_experts if arch == "qwen3moe" else cfg.n_routed_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "glm4moe":
        w.add_rope_dimension_count(int(cfg.head_dim * cfg.rope_parameters.get("partial_rotary_factor", 0.5)))
        w.add_expert_shared_count(cfg.n_shared_experts)
        w.add_leading_dense_block_count(cfg.first_k_dense_replace)
        w.add_expert_weights_scale(cfg.routed_scaling_factor)
        w.add_expert_weights_norm(cfg.norm_topk_prob)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_group_count(cfg.n_group)
        w.add_expert_group_used_count(cfg.topk_group)
        w.add_nextn_predict_layers(nextn)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    _copy_tokenizer_fields(w, builtin_gguf)

    names = gguf.get_tensor_name_map(
        {"qwen3moe": gguf.MODEL_ARCH.QWEN3MOE, "glm4moe": gguf.MODEL_ARCH.GLM4_MOE}[arch],
        cfg.num_hidden_layers + nextn,
    )
    ff = cfg.moe_intermediate_size
    for hf, t in model.state_dict().items():
        arr = t.detach().float().numpy()
        if hf.endswith("mlp.experts.gate_up_proj"):  # [E, 2*ff, hidden]: gate rows, then up rows
            p = names.get_name(hf.replace("gate_up_proj", "gate_proj.weight"), try_suffixes=(".weight",))
            w.add_tensor(p, np.ascontiguousarray(arr[:, :ff]))
            w.add_tensor(p.replace("ffn_gate_exps", "ffn_up_exps"), np.ascontiguousarray(arr[:, ff:]))
            continue
        if hf.endswith("mlp.experts.down_proj"):  # [E, hidden, ff]
            p = names.get_name(hf + ".weight", try_suffixes=(".weight",))
            if p.startswith("blk.1."):
                q, deq = _q8_roundtrip(arr)
                w.add_tensor(p, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
                with torch.no_grad():
                    t.copy_(torch.from_numpy(deq))
            else:
                w.add_tensor(p, arr)
            continue
        if hf.endswith("e_score_correction_bias"):  # the converter's rename to a ".bias" suffix
            hf = hf.replace("e_score_correction_bias", "e_score_correction.bias")
        p = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        assert p is not None, hf
        w.add_tensor(p, arr)
    if nextn:  # an MTP block as llama.cpp stores it (the engine must skip it)
        b = cfg.num_hidden_layers
        w.add_tensor(
            f"blk.{b}.nextn.eh_proj.weight", np.ones((cfg.hidden_size, 2 * cfg.hidden_size), np.float32)
        )
        w.add_tensor(f"blk.{b}.attn_norm.weight", np.ones(cfg.hidden_size, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module", params=["qwen3moe", "glm4moe"])
def tiny_gguf(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from pagoda.node_agent.models.loader import resolve_source

    from .test_moe_models import _hf_config, _randomize_routing

    arch = request.param
    torch.manual_seed(0)
    if arch == "qwen3moe":  # every layer sparse: llama.cpp's qwen3moe has no dense layers
        hf_cfg, family = Qwen3MoeConfig(**COMMON, num_experts=8), "qwen3_moe"
    else:
        hf_cfg, family = _hf_config("glm4_moe"), "glm4_moe"
    model = AutoModelForCausalLM.from_config(hf_cfg).float().eval()
    _randomize_routing(model, family)
    path = tmp_path_factory.mktemp(arch) / f"tiny-{arch}.gguf"
    _write_gguf(model, path, arch, resolve_source("builtin://smollm2-135m")[1])
    engine = LLMEngine(
        EngineConfig(model=str(path), dtype="float32", formats=PhaseFormats.reference(), kv_memory=8 << 20)
    )
    return arch, model, engine


def test_gguf_moe_structure(tiny_gguf):
    arch, _, engine = tiny_gguf
    mc = engine.model_config
    assert mc.qk_norm and mc.head_dim == 16 and mc.num_layers == 3
    assert (mc.moe.num_experts, mc.moe.top_k, mc.moe.expert_intermediate_size) == (8, 2, 64)
    sparse = [isinstance(layer.mlp, MoeMLP) for layer in engine.model.layers]
    if arch == "qwen3moe":
        assert mc.arch == "qwen3_moe" and mc.moe.router == "softmax" and mc.moe.norm_topk_prob
        assert sparse == [True, True, True]
    else:
        assert mc.arch == "glm4_moe" and mc.moe.router == "sigmoid_grouped" and mc.attention_bias
        assert mc.rotary_dim == 8 and mc.moe.routed_scaling_factor == 2.5
        assert (mc.moe.n_group, mc.moe.topk_group, mc.moe.n_shared_experts) == (4, 2, 1)
        assert sparse == [False, True, True]


def test_gguf_moe_logits_and_greedy_match_transformers(tiny_gguf):
    arch, model, engine = tiny_gguf
    ids = engine.tokenize(PROMPT * 2)
    with torch.inference_mode():
        want = model(torch.tensor([ids])).logits[0].float()
    got = engine.score(ids, phase="prefill")
    diff = (got - want).abs().max().item()
    assert diff <= MAX_ABS_LOGIT_DIFF, f"{arch}: max |logit diff| {diff}"
    assert want.std().item() > 0.1  # the comparison is not between near-zero logits

    ids = engine.tokenize(PROMPT)
    rid = engine.add_request(ids, PARAMS)
    got_ids = engine.run_until_done()[rid].token_ids
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    assert got_ids == out[0, len(ids) :].tolist(), arch


def _write_deepseek2_gguf(model, path: Path, builtin_gguf: Path, split: bool) -> None:
    """What llama.cpp's DeepseekV2Model converter writes for DeepSeek-V3: MLA as MQA (head_count_kv 1,
    key/value_length over the latent, the head sizes in key/value_length_mla), kv_b_proj split per
    head into attn_k_b (key rows transposed) and attn_v_b, YaRN with yarn_log_multiplier =
    0.1 * mscale_all_dim, sigmoid grouped routing, q/k rows unpermuted. ``split=False``: the layout
    of files from before llama.cpp's MLA change (head sizes in key/value_length, attn_kv_b whole)."""
    import gguf

    cfg = model.config
    rp = cfg.rope_parameters
    w = gguf.GGUFWriter(str(path), "deepseek2")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(1 if split else cfg.num_attention_heads)
    w.add_rope_freq_base(float(rp["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rp["factor"])
    w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_beta_fast(rp["beta_fast"])
    w.add_rope_scaling_yarn_beta_slow(rp["beta_slow"])
    w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_group_count(cfg.n_group)
    w.add_expert_group_used_count(cfg.topk_group)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    w.add_vocab_size(cfg.vocab_size)
    w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(cfg.kv_lora_rank)
    if split:
        w.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        w.add_value_length(cfg.kv_lora_rank)
        w.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        w.add_value_length_mla(cfg.v_head_dim)
    else:
        w.add_key_length(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        w.add_value_length(cfg.v_head_dim)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(cfg.qk_rope_head_dim)
    w.add_rope_scaling_yarn_log_mul(0.1 * rp["mscale_all_dim"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    _copy_tokenizer_fields(w, builtin_gguf)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, cfg.num_hidden_layers)
    ff, heads = cfg.moe_intermediate_size, cfg.num_attention_heads
    nope, v = cfg.qk_nope_head_dim, cfg.v_head_dim
    for hf, t in model.state_dict().items():
        arr = t.detach().float().numpy()
        if hf.endswith("mlp.experts.gate_up_proj"):
            p = names.get_name(hf.replace("gate_up_proj", "gate_proj.weight"), try_suffixes=(".weight",))
            w.add_tensor(p, np.ascontiguousarray(arr[:, :ff]))
            w.add_tensor(p.replace("ffn_gate_exps", "ffn_up_exps"), np.ascontiguousarray(arr[:, ff:]))
            continue
        if hf.endswith("mlp.experts.down_proj"):
            w.add_tensor(names.get_name(hf + ".weight", try_suffixes=(".weight",)), arr)
            continue
        if split and hf.endswith(
            "kv_b_proj.weight"
        ):  # [H*(nope+v), rank] -> k_b [H, rank, nope], v_b [H, v, rank]
            kv_b = arr.reshape(heads, nope + v, -1)
            p = hf.split(".")[2]
            w.add_tensor(f"blk.{p}.attn_k_b.weight", np.ascontiguousarray(kv_b[:, :nope].transpose(0, 2, 1)))
            w.add_tensor(f"blk.{p}.attn_v_b.weight", np.ascontiguousarray(kv_b[:, nope:]))
            continue
        if hf.endswith("e_score_correction_bias"):
            hf = hf.replace("e_score_correction_bias", "e_score_correction.bias")
        p = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        assert p is not None, hf
        w.add_tensor(p, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module", params=["split_kv_b", "joined_kv_b"])
def tiny_deepseek2(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from pagoda.node_agent.models.loader import resolve_source

    from .test_mla import _hf_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_hf_config()).float().eval()
    for layer in model.model.layers:  # routers that matter (transformers zero-initialises them)
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            torch.nn.init.normal_(gate.weight, std=0.5)
            gate.e_score_correction_bias.normal_(std=0.2)
    path = tmp_path_factory.mktemp("deepseek2") / "tiny-deepseek2.gguf"
    _write_deepseek2_gguf(
        model, path, resolve_source("builtin://smollm2-135m")[1], request.param == "split_kv_b"
    )
    engine = LLMEngine(
        EngineConfig(model=str(path), dtype="float32", formats=PhaseFormats.reference(), kv_memory=4 << 20)
    )
    return model, engine


def test_deepseek2_gguf_config_matches_transformers(tiny_deepseek2):
    from pagoda.node_agent.models.config import config_from_hf

    model, engine = tiny_deepseek2
    got, want = engine.model_config, config_from_hf(model.config.to_dict())
    assert got.arch == "deepseek_v3" and got.num_kv_heads == 4 and got.head_dim == 8
    # yarn_log_multiplier is stored as float32: the scale agrees to float32 precision
    assert got.mla.softmax_scale == pytest.approx(want.mla.softmax_scale, rel=1e-6)
    assert replace(got.mla, softmax_scale=0.0) == replace(want.mla, softmax_scale=0.0)
    assert got.mla.q_lora_rank == 24 and got.mla.rope_interleave
    assert got.moe == want.moe and got.moe.n_group == 2 and got.moe.sparse_layers == (1, 2)
    for key in ("factor", "original_max_position_embeddings", "mscale", "mscale_all_dim", "beta_fast"):
        assert got.rope_scaling[key] == pytest.approx(want.rope_scaling[key]), key


def test_deepseek2_gguf_logits_and_greedy_match_transformers(tiny_deepseek2):
    model, engine = tiny_deepseek2
    ids = engine.tokenize(PROMPT * 2)
    with torch.inference_mode():
        want = model(torch.tensor([ids])).logits[0].float()
    got = engine.score(ids, phase="prefill")
    diff = (got - want).abs().max().item()
    assert diff <= MAX_ABS_LOGIT_DIFF, f"max |logit diff| {diff}"
    assert want.std().item() > 0.1

    ids = engine.tokenize(PROMPT)
    rid = engine.add_request(ids, PARAMS)
    got_ids = engine.run_until_done()[rid].token_ids
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    assert got_ids == out[0, len(ids) :].tolist()


def test_unknown_gguf_moe_architecture_is_refused(tmp_path):
    import gguf

    from pagoda.node_agent.models.config import ModelLoadError
    from pagoda.node_agent.models.loader import load_model

    f = tmp_path / "tiny-olmoe.gguf"
    w = gguf.GGUFWriter(str(f), "olmoe")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="unsupported architecture 'olmoe'"):
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


@pytest.mark.parametrize(
    "drop, message",
    [
        ("kv_lora_rank", "misses rope.dimension_count, attention.kv_lora_rank"),
        ("expert_gating_func", "DeepSeek-V2 \\(softmax router\\), which is not supported"),
    ],
)
def test_deepseek2_gguf_without_mla_or_gating_keys_is_refused(tmp_path, drop, message):
    import gguf

    from pagoda.node_agent.models.config import ModelLoadError
    from pagoda.node_agent.models.loader import load_model

    f = tmp_path / "tiny-deepseek2.gguf"
    w = gguf.GGUFWriter(str(f), "deepseek2")
    keys = dict(
        context_length=64,
        embedding_length=64,
        block_count=1,
        feed_forward_length=128,
        expert_count=8,
        expert_used_count=2,
        expert_feed_forward_length=32,
        expert_gating_func=2,
        **{"attention.head_count": 4, "attention.kv_lora_rank": 32, "rope.dimension_count": 8},
        **{"attention.key_length_mla": 24, "attention.value_length_mla": 12},
    )
    for key, value in keys.items():
        if key.rpartition(".")[2] != drop:
            w.add_uint32(f"deepseek2.{key}", value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match=message):
        load_model(str(f))
