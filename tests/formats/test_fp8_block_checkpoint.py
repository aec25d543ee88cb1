"""A DeepSeek-V3 checkpoint in block-scaled FP8 (``weight_scale_inv`` per block, partial edge
blocks on every axis) served as stored: ``--dtype float32`` computes with the exact dequantized
values, and FP8 phases keep the e4m3 values and their block scales (dense projections and routed
experts alike). Both are compared greedily with transformers on the block-dequantized weights,
which is the block-scaled reference: dequantize each block, float32 matmuls."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from pagoda.kernels.linear import DenseLinear, Fp8BlockLinear
from pagoda.node_agent.engine.config import EngineConfig, PhaseFormats
from pagoda.node_agent.engine.llm_engine import LLMEngine
from pagoda.node_agent.engine.memory import estimate_weight_bytes
from pagoda.node_agent.models.loader import load_model
from pagoda.node_agent.models.moe import MoeMLP
from pagoda.node_agent.params import SamplingParams
from tests.formats.test_checkpoint_formats import _fused, _per_expert
from tests.tiny_models import TOKENIZER_VOCAB, random_causal_lm

pytestmark = pytest.mark.slow

BLOCK = 32  # DeepSeek-V3 uses 128; 32 keeps the model tiny with several blocks per axis
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [
    "Once upon a time",
    "The quick brown fox jumps over the lazy dog.",
    "1 2 3 4 5 6 7 8",
    "Block scales keep every value as the checkpoint stored it.",
    "def add(a, b):\n    return",
    "Paris is the capital of",
    "A B C D E F G",
    "Experts route each token to two of eight.",
]


def _config():
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=TOKENIZER_VOCAB,
        hidden_size=80,  # 2.5 blocks
        intermediate_size=144,  # 4.5 blocks
        moe_intermediate_size=48,  # 1.5 blocks
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        max_position_embeddings=256,
        initializer_range=0.05,
        tie_word_embeddings=False,
        q_lora_rank=40,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
    )


def encode_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (e4m3 [N, K], scale_inv [ceil(N/B), ceil(K/B)]): each block's amax maps to 448."""
    n, k = w.shape
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    s = torch.empty(-(-n // BLOCK), -(-k // BLOCK))
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = w[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK]
            s[i, j] = max(blk.abs().max().item(), 1e-8) / 448.0
            q[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK] = (blk / s[i, j]).to(q.dtype)
    return q, s


def decode_blocks(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    return q.float() * s.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:n, :k]


@pytest.fixture(scope="module")
def fp8_deepseek(tmp_path_factory, builtin_tokenizer):
    """(checkpoint path, transformers model holding the block-dequantized weights)."""

    def draw_routers(model) -> None:
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                torch.nn.init.normal_(gate.weight, std=0.5)
                gate.e_score_correction_bias.normal_(std=0.2)

    model = random_causal_lm(_config(), prepare=draw_routers)
    path = tmp_path_factory.mktemp("deepseek-fp8-block")
    stored, deq = {}, {}
    for name, t in _per_expert(model.state_dict()).items():
        t = t.detach().float().contiguous()
        if name.startswith("model.layers.") and name.endswith(("_proj.weight", "_proj_with_mqa.weight")):
            q, s = encode_blocks(t)
            stored[name], stored[name.removesuffix("weight") + "weight_scale_inv"] = q, s
            deq[name] = decode_blocks(q, s)
        else:
            stored[name] = deq[name] = t
    save_file(stored, str(path / "model.safetensors"))
    cfg = model.config.to_dict()
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "weight_block_size": [BLOCK, BLOCK],
        "activation_scheme": "dynamic",
    }
    (path / "config.json").write_text(json.dumps(cfg))
    builtin_tokenizer._tok.save_pretrained(path)
    model.load_state_dict(_fused(deq, model.state_dict()))
    return path, model


def _engine(path, formats: PhaseFormats) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", formats=formats, kv_memory=8 << 20))


def _greedy(engine: LLMEngine) -> list[list[int]]:
    rids = [engine.add_request(engine.tokenize(p), PARAMS) for p in PROMPTS]
    final = engine.run_until_done()
    return [final[r].token_ids for r in rids]


@pytest.fixture(scope="module")
def reference_tokens(fp8_deepseek, builtin_tokenizer) -> list[list[int]]:
    _, model = fp8_deepseek
    outs = []
    with torch.inference_mode():
        for p in PROMPTS:
            ids = builtin_tokenizer.encode(p)
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=PARAMS.max_tokens, do_sample=False, pad_token_id=0
            )
            outs.append(out[0, len(ids) :].tolist())
    return outs


def test_float32_computes_with_the_exact_dequantized_values(fp8_deepseek, reference_tokens):
    engine = _engine(fp8_deepseek[0], PhaseFormats("bf16", "bf16", "bf16", "bf16"))
    lin = engine.model.layers[0].mlp.down_proj.by_phase["decode"]
    assert isinstance(lin, DenseLinear) and lin.weight.dtype == torch.float32
    assert _greedy(engine) == reference_tokens


def test_fp8_phases_compute_with_the_block_scales(fp8_deepseek, reference_tokens):
    engine = _engine(fp8_deepseek[0], PhaseFormats("fp8", "bf16", "fp8", "bf16"))
    down = engine.model.layers[0].mlp.down_proj.by_phase["decode"]
    assert isinstance(down, Fp8BlockLinear) and down.weight.block == (BLOCK, BLOCK)
    moes = [la.mlp for la in engine.model.layers if isinstance(la.mlp, MoeMLP)]
    assert moes and all(m.stacks["decode"].fmt == "fp8_block" for m in moes)
    by_format = engine.model.weight_bytes()["by_format"]
    assert by_format["fp8_block"] > 0 and "fp8" not in by_format
    loaded = load_model(str(fp8_deepseek[0]))
    formats = {"prefill": "fp8", "decode": "fp8"}
    estimate = estimate_weight_bytes(loaded.weights, formats, torch.float32, head_format="fp32")
    assert estimate.by_format["fp8_block"] == by_format["fp8_block"]
    assert _greedy(engine) == reference_tokens


def test_tensor_parallel_slices_keep_the_blocks():
    """Row slices (heads, MLP rows) keep each row's block scale; a down_proj's columns split at
    whole column blocks (the MLP split unit), and a slice inside a block is refused."""
    from pagoda.kernels.fp8_block import quantize_fp8_block
    from pagoda.node_agent.models.config import ModelLoadError
    from pagoda.node_agent.models.parallel import column_shard, int4_unit, take_rows

    torch.manual_seed(3)
    w = quantize_fp8_block(torch.randn(72, 96), (BLOCK, BLOCK))
    assert int4_unit(w, {"fp8"}, None) == BLOCK
    assert torch.equal(take_rows(w, 24, 60).dequantize(), w.dequantize()[24:60])
    shard = column_shard(w, 32, 96, need_amax=True, name="model.layers.0.mlp.down_proj.weight")
    assert shard.row_amax is None and torch.equal(shard.weight.dequantize(), w.dequantize()[:, 32:])
    with pytest.raises(
        ModelLoadError, match=r"down_proj\.weight: a column slice \[16, 96\) splits the FP8 blocks"
    ):
        column_shard(w, 16, 96, need_amax=False, name="model.layers.0.mlp.down_proj.weight")


def test_stored_format_keeps_each_layer_as_the_checkpoint_holds_it(fp8_deepseek, reference_tokens, caplog):
    """``stored`` in both phases: FP8-block layers and experts run as stored, layers the checkpoint
    holds dense run in the compute dtype; the engine logs the bytes per format of each phase."""
    from pagoda.kernels.int4 import quantize_int4
    from pagoda.node_agent.models.layers import as_stored

    assert as_stored("stored", quantize_int4(torch.randn(8, 64), 32)) == "int4"
    assert as_stored("stored", torch.randn(8, 64)) == "bf16" and as_stored("fp8", torch.randn(8, 64)) == "fp8"
    with caplog.at_level("INFO", logger="pagoda.engine"):
        engine = _engine(fp8_deepseek[0], PhaseFormats("stored", "bf16", "stored", "bf16"))
    layer = engine.model.layers[1]
    assert isinstance(layer.mla.o_proj.by_phase["prefill"], Fp8BlockLinear)
    assert isinstance(layer.mla.kv_b_proj.by_phase["decode"], DenseLinear)  # stored dense
    assert layer.mlp.stacks["prefill"].fmt == "fp8_block"
    assert "decode weights by format: bf16 " in caplog.text and "experts fp8_block" in caplog.text
    loaded = load_model(str(fp8_deepseek[0]))
    estimate = estimate_weight_bytes(loaded.weights, {"prefill": "stored", "decode": "stored"}, torch.float32)
    assert estimate.by_format["fp8_block"] == engine.model.weight_bytes()["by_format"]["fp8_block"]
    assert _greedy(engine) == reference_tokens


def test_stored_format_serves_the_builtin_gguf_blocks_as_int4(builtin_loaded):
    """The built-in model's Q4_1 linears resolve to INT4 in both phases under ``stored`` (the file's
    own blocks, no copy); its dense tensors (embeddings, norms) to the compute dtype."""
    from pagoda.kernels.linear import Int4Linear
    from pagoda.node_agent.models.layers import PhaseLinear, as_stored

    w = builtin_loaded.weights
    linears = [n for n in w if n.startswith("model.layers.") and n.endswith("_proj.weight")]
    assert linears and all(as_stored("stored", w[n]) == "int4" for n in linears)
    assert as_stored("stored", w["model.embed_tokens.weight"]) == "bf16"
    from pagoda.node_agent.models.llama import _to_device

    o = _to_device(
        w["model.layers.0.self_attn.o_proj.weight"], torch.device("cpu")
    )  # a copy: layouts mutate it
    lin = PhaseLinear(o, None, {"prefill": "stored", "decode": "stored"}, torch.float32)
    assert (
        isinstance(lin.by_phase["decode"], Int4Linear) and lin.by_phase["prefill"] is lin.by_phase["decode"]
    )
    assert lin.by_phase["decode"].weight is o
