"""Weight bytes by part and by format (models/weight_bytes.py), on the built-in model and a tiny MoE."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pagoda.node_agent.engine.config import EngineConfig, PhaseFormats
from pagoda.node_agent.engine.llm_engine import LLMEngine
from pagoda.node_agent.engine.memory import estimate_weight_bytes, phase_weight_formats
from pagoda.node_agent.models.weight_bytes import PARTS
from tests.engine.test_moe_models import _hf_config
from tests.tiny_models import save_random_model


def _consistent(wb: dict) -> None:
    assert sum(wb[p] for p in PARTS) == wb["total"] == sum(wb["by_format"].values())
    assert wb["linear"] == wb["attention"] + wb["mlp"]


def test_dense_model_parts_match_its_shapes(engine) -> None:
    """Reference formats on a float32 CPU engine: every linear weight is 4 bytes a parameter."""
    wb = engine.model.weight_bytes()
    _consistent(wb)
    c = engine.model_config
    h, hd, n = c.hidden_size, c.head_dim, c.num_layers
    assert wb["attention"] == n * 4 * h * hd * (2 * c.num_heads + 2 * c.num_kv_heads)
    assert wb["mlp"] == n * 4 * 3 * h * c.intermediate_size
    assert wb["experts"] == 0
    assert wb["embeddings"] >= 2 * 4 * c.vocab_size * h  # embeddings + (tied) head, as held
    assert wb["other"] == 4 * h * (2 * n + 1)  # two norms a layer + the final norm
    # linear layers by format; embeddings, norms by dtype; the decode head (auto) holds the file's Q8_0
    # blocks exactly: a byte a weight and a float16 scale per 32
    assert set(wb["by_format"]) == {"bf16", "fp32", "int8"}
    assert engine.model.decode_head_format == "int8"
    assert wb["by_format"]["int8"] == c.vocab_size * h + c.vocab_size * h // 32 * 2
    assert wb["by_format"]["fp32"] == 4 * c.vocab_size * h + wb["other"]


def test_phase_formats_split_the_bytes(int4_fp8_engine, engine) -> None:
    """INT4 weights in both phases: one INT4 copy of each linear layer, far smaller than dense."""
    wb, ref = int4_fp8_engine.model.weight_bytes(), engine.model.weight_bytes()
    _consistent(wb)
    assert wb["by_format"]["int4"] == wb["linear"]
    assert wb["linear"] < 0.2 * ref["linear"]
    assert wb["embeddings"] == ref["embeddings"] and wb["other"] == ref["other"]


def test_builtin_int4_linears_are_under_0_3x_bf16(int4_fp8_engine, engine) -> None:
    """The file's Q4_1 blocks, held without a value changed (codes for their float16 scales and mins),
    take at most 0.3x of the same layers as 2-byte bf16 (0.3125x as float16 parameters)."""
    wb, ref = int4_fp8_engine.model.weight_bytes(), engine.model.weight_bytes()
    model = int4_fp8_engine.model
    weights = [w.weight for layer in model.layers for lin in layer.linears() for w in lin.unique_weights()]
    if any(w.cpu_compute != "float32" for w in weights):
        pytest.skip("native INT4 kernel unavailable here (no C compiler): the bf16 layout is held")
    assert all(w.codes is not None for w in weights)
    groups = sum(w.out_features * w.num_groups for w in weights)
    assert wb["by_format"]["int4"] == 16 * groups + 3 * groups + sum(w.codes.table.nbytes for w in weights)
    assert wb["by_format"]["int4"] <= 0.3 * (ref["linear"] // 4 * 2)


@pytest.fixture(scope="module")
def mixed_moe(tmp_path_factory, builtin_tokenizer) -> LLMEngine:
    """A tiny GLM-4.5-MoE (shared + routed experts) with bf16 prefill and INT4 decode weights."""
    _, path = save_random_model(
        _hf_config("glm4_moe"), tmp_path_factory.mktemp("glm4_moe_bytes"), builtin_tokenizer
    )
    formats = PhaseFormats("bf16", "bf16", "int4", "bf16")
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", formats=formats, kv_memory=8 << 20))


def test_moe_parts_and_formats(mixed_moe) -> None:
    wb = mixed_moe.model.weight_bytes()
    _consistent(wb)
    c = mixed_moe.model_config
    stacks = [layer.mlp.stacks for layer in mixed_moe.model.layers if hasattr(layer.mlp, "stacks")]
    assert len(stacks) == 2
    dense_experts = sum(s["prefill"].nbytes() for s in stacks)
    int4_experts = sum(s["decode"].nbytes() for s in stacks)
    assert dense_experts == 2 * 8 * 3 * c.hidden_size * c.moe.expert_intermediate_size * 4
    assert wb["experts"] == dense_experts + int4_experts
    # every linear layer and expert stack is held twice: a bf16 copy for prefill, an INT4 one for decode
    lins = [lin for layer in mixed_moe.model.layers for lin in layer.linears()]
    linear_bf16 = sum(lin.by_phase["prefill"].nbytes for lin in lins)
    linear_int4 = sum(lin.by_phase["decode"].nbytes for lin in lins)
    assert wb["linear"] == linear_bf16 + linear_int4
    head = mixed_moe.model.lm_head.by_phase["prefill"]  # the dense head serves both phases by default
    assert wb["by_format"]["bf16"] == linear_bf16 + dense_experts + head.nbytes
    assert wb["by_format"]["int4"] == linear_int4 + int4_experts
    assert 0 < wb["by_format"]["int4"] < 0.5 * wb["by_format"]["bf16"]
    # the load-time estimate from the checkpoint's shapes (biases with their linear layer) is exact here
    tensors = {
        k: v for f in Path(mixed_moe.config.model).glob("*.safetensors") for k, v in load_file(f).items()
    }
    est = estimate_weight_bytes(tensors, phase_weight_formats(mixed_moe.config), torch.float32)
    assert est.by_format == wb["by_format"]
    assert wb["other"] > 2 * 8 * c.hidden_size * 4  # the routers (float32) are in "other"


def test_mla_model_counts_every_checkpoint_tensor_once(tmp_path, builtin_tokenizer) -> None:
    """A tiny DeepSeek-V3 in reference formats (float32): each checkpoint tensor is held once at 4 bytes
    a value, latent attention (LoRA projections, their norms, kv_b_proj) under attention/other."""
    from tests.engine.test_mla import _hf_config as mla_config

    save_random_model(mla_config(), tmp_path, builtin_tokenizer)
    engine = LLMEngine(
        EngineConfig(
            model=str(tmp_path), dtype="float32", formats=PhaseFormats.reference(), kv_memory=4 << 20
        )
    )
    tensors = {k: v for f in tmp_path.glob("*.safetensors") for k, v in load_file(f).items()}
    wb = engine.model.weight_bytes()
    _consistent(wb)
    assert wb["total"] == 4 * sum(t.numel() for t in tensors.values())
    attn = [t for k, t in tensors.items() if ".self_attn." in k and t.dim() == 2]
    assert wb["attention"] == 4 * sum(t.numel() for t in attn)
    norms = [t for k, t in tensors.items() if k.endswith("norm.weight")]
    routers = [t for k, t in tensors.items() if ".mlp.gate." in k]
    assert wb["other"] == 4 * sum(t.numel() for t in norms + routers)
    fp8 = LLMEngine(
        EngineConfig(model=str(tmp_path), dtype="float32", formats=PhaseFormats("fp8", "bf16", "fp8", "bf16"))
    )
    est = estimate_weight_bytes(tensors, phase_weight_formats(fp8.config), torch.float32)
    assert est.by_format == fp8.model.weight_bytes()["by_format"]  # kv_b_proj stays dense
