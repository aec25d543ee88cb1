"""compressed-tensors checkpoints as llmcompressor writes them: GPTQ's default W4A16 (actorder
"static", no g_idx), W4A16_ASYM (zero points), W8A16 (8-bit per channel), act-ordered "group"
schemes (g_idx), the ignore list and the refusals. Tiny random models are written by tests/formats/
ct_writer.py (the published layout, checked here once against the compressed-tensors package where
it is installed), loaded by Pagoda and compared greedily with transformers on the dequantized
weights; an all-INT4 DeepSeek-V3 at group 32 decodes in INT4 with float32 compute."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from pagoda.kernels.cpu_int4_native import library
from pagoda.kernels.int4 import Int4Weight
from pagoda.node_agent.engine.config import EngineConfig, PhaseFormats
from pagoda.node_agent.engine.llm_engine import LLMEngine
from pagoda.node_agent.models.checkpoint_formats import convert_checkpoint, parse_quantization_config
from pagoda.node_agent.models.compressed_tensors_format import (
    convert_module,
    parse_compressed_tensors,
    unpack_rows,
)
from pagoda.node_agent.models.config import ModelLoadError
from pagoda.node_agent.models.loader import load_model
from pagoda.node_agent.models.moe import MoeMLP
from pagoda.node_agent.params import SamplingParams
from tests.formats.ct_writer import pack_rows, quant_config, quantize, weights_args, write_ct_checkpoint
from tests.tiny_models import TOKENIZER_VOCAB, random_causal_lm

pytestmark = pytest.mark.slow

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [
    "Once upon a time",
    "The quick brown fox jumps over the lazy dog.",
    "1 2 3 4 5 6 7 8",
    "Quantized weights move fewer bytes per decoded token.",
    "def add(a, b):\n    return",
    "Paris is the capital of",
    "A B C D E F G",
    "Zero points shift each group of weights.",
]
LLAMA = dict(
    vocab_size=TOKENIZER_VOCAB,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=256,
    initializer_range=0.05,
    tie_word_embeddings=False,
)
# name -> (weights args, g_idx mode, whether the quantized linears load as Int4Weight)
VARIANTS = {
    "gptq_default": (weights_args(4, 128, True, actorder="static"), None, True),
    "w4a16_asym": (weights_args(4, 128, False), None, True),
    "w8a16": (weights_args(8, 0, True), None, False),
    "actorder_group_runs": (weights_args(4, 32, True, actorder="group"), "runs", True),
    "actorder_group_scatter": (weights_args(4, 32, False, actorder="group"), "scatter", False),
}
native = pytest.mark.skipif(library() is None, reason="float32 INT4 compute needs the native CPU kernels")


def _greedy_hf(model, engine: LLMEngine) -> list[list[int]]:
    outs = []
    with torch.inference_mode():
        for p in PROMPTS:
            ids = engine.tokenize(p)
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=PARAMS.max_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            outs.append(out[0, len(ids) :].tolist())
    return outs


def _greedy(engine: LLMEngine) -> list[list[int]]:
    rids = [engine.add_request(engine.tokenize(p), PARAMS) for p in PROMPTS]
    final = engine.run_until_done()
    return [final[r].token_ids for r in rids]


def _engine(path, formats: PhaseFormats, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", formats=formats, kv_memory=8 << 20, **kw))


# ---------------------------------------------------------------- the writer vs the real package


@pytest.mark.skipif(
    importlib.util.find_spec("compressed_tensors") is None,
    reason="the compressed-tensors package is not installed",
)
@pytest.mark.parametrize(("bits", "group", "symmetric"), [(4, 32, True), (4, 64, False), (8, 0, True)])
def test_writer_and_reader_agree_with_compressed_tensors(bits, group, symmetric):
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    torch.manual_seed(5)
    w = torch.randn(48, 128)
    q, scale, zero, idx = quantize(w, bits, group, symmetric)
    packed = pack_rows(q, bits)
    assert torch.equal(packed, pack_to_int32(q, bits))
    assert torch.equal(unpack_rows(packed, bits, 128), unpack_from_int32(packed, bits, torch.Size([48, 128])))
    state = {"weight_packed": packed, "weight_scale": scale.float(), "weight_shape": torch.tensor([48, 128])}
    if zero is not None:
        state["weight_zero_point"] = pack_rows(zero.t(), bits).t().contiguous()
        assert torch.equal(state["weight_zero_point"], pack_to_int32(zero, bits, packed_dim=0))
    args = weights_args(bits, group, symmetric)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**args))
    theirs = PackedQuantizationCompressor.decompress(dict(state), scheme)["weight"]
    cfg = parse_compressed_tensors(quant_config({"g": (args, ["Linear"])}, []))
    ours, _ = convert_module({f"x.{k}": v for k, v in state.items()}, "x", cfg.schemes[0])
    ours = ours.dequantize() if isinstance(ours, Int4Weight) else ours
    assert torch.equal(ours, theirs.float())  # float32 scales: both exact


# ---------------------------------------------------------------- tiny models, greedy


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory, builtin_tokenizer):
    from transformers import LlamaConfig

    args, g_idx, _ = VARIANTS[request.param]
    model = random_causal_lm(LlamaConfig(**LLAMA))
    path = tmp_path_factory.mktemp(request.param)
    stored, deq = write_ct_checkpoint(model, path, builtin_tokenizer, args, ["lm_head"], g_idx=g_idx)
    model.load_state_dict(deq)
    return request.param, path, stored, model


@native
def test_llmcompressor_schemes_match_their_dequantized_weights(variant):
    name, path, stored, model = variant
    args, g_idx, int4 = VARIANTS[name]
    loaded = load_model(str(path))
    o = loaded.weights["model.layers.0.self_attn.o_proj.weight"]
    if int4:
        assert isinstance(o, Int4Weight) and o.group_size == args["group_size"]
        assert o.symmetric == args["symmetric"] and (o.zeros is None) == args["symmetric"]
        words = stored["model.layers.0.self_attn.o_proj.weight_packed"]
        assert torch.equal(o.packed, words.view(torch.uint8))  # the stored nibbles, as they are
    else:
        assert isinstance(o, torch.Tensor) and o.dtype == torch.float32
    # INT4-loaded schemes decode in INT4 from the stored values (exact float32 compute); the others
    # are dense, exactly dequantized
    formats = PhaseFormats("bf16", "bf16", "int4", "bf16") if int4 else PhaseFormats.reference()
    engine = _engine(path, formats)
    assert _greedy(engine) == _greedy_hf(model, engine)


# ---------------------------------------------------------------- all-INT4 DeepSeek-V3


def _deepseek_config():
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=TOKENIZER_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
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
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
    )


@native
def test_all_int4_deepseek_v3_decodes_exactly_in_float32(tmp_path, builtin_tokenizer):
    def draw_routers(model) -> None:
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                torch.nn.init.normal_(gate.weight, std=0.5)
                gate.e_score_correction_bias.normal_(std=0.2)

    model = random_causal_lm(_deepseek_config(), prepare=draw_routers)
    args = weights_args(4, 32, True)
    _, deq = write_ct_checkpoint(model, tmp_path, builtin_tokenizer, args, ["lm_head", "re:.*mlp\\.gate$"])
    model.load_state_dict(deq)
    engine = _engine(tmp_path, PhaseFormats("bf16", "bf16", "int4", "bf16"), int4_compute="float32")
    moes = [la.mlp for la in engine.model.layers if isinstance(la.mlp, MoeMLP)]
    assert moes and all(m.stacks["decode"].fmt == "int4" for m in moes)
    assert all(m.stacks["decode"].cpu_compute == "float32" for m in moes)
    assert engine.model.kernels.table["moe"].backend.startswith("native")
    assert _greedy(engine) == _greedy_hf(model, engine)
    fast = _engine(tmp_path, PhaseFormats("bf16", "bf16", "int4", "bf16"), int4_compute="bf16")
    assert all(
        la.mlp.stacks["decode"].cpu_compute == "bf16"
        for la in fast.model.layers
        if isinstance(la.mlp, MoeMLP)
    )


# ---------------------------------------------------------------- ignore list and refusals


def _qc(**weights) -> dict:
    args = {**weights_args(4, 32, True), **weights}
    return quant_config({"group_0": (args, ["Linear"])}, ["lm_head"])


def test_ignore_list_and_targets_are_honoured():
    torch.manual_seed(2)
    w = torch.randn(16, 64)
    q, scale, _, _ = quantize(w, 4, 32, True)
    packed = {"weight_packed": pack_rows(q, 4), "weight_scale": scale, "weight_shape": torch.tensor([16, 64])}
    a, b = "model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj"
    stored = {f"{a}.{k}": v for k, v in packed.items()} | {f"{b}.weight": w.bfloat16()}
    raw = quant_config(
        {"group_0": (weights_args(4, 32, True), ["re:.*up_proj$"])}, ["lm_head", "re:.*down_proj"]
    )
    out = convert_checkpoint(stored, parse_quantization_config({"quantization_config": raw}))
    assert isinstance(out[f"{a}.weight"], Int4Weight) and out[f"{b}.weight"].dtype == torch.float32
    # an ignored module stored quantized, or a quantized one no target names, is refused by name
    bad = {f"{b}.{k}": v for k, v in packed.items()}
    with pytest.raises(
        ModelLoadError, match=r"down_proj is stored quantized but quantization_config\.ignore"
    ):
        convert_checkpoint(bad, parse_quantization_config({"quantization_config": raw}))
    raw["ignore"] = []
    with pytest.raises(ModelLoadError, match="matches no compressed-tensors config_groups target"):
        convert_checkpoint(bad, parse_quantization_config({"quantization_config": raw}))


@pytest.mark.parametrize(
    ("qc", "message"),
    [
        (_qc(num_bits=3), "num_bits is 3"),
        (_qc(type="float"), "type is 'float'"),
        (
            _qc(num_bits=8, strategy="channel", group_size=None, symmetric=False),
            "symmetric is False: asymmetric 8-bit",
        ),
        (_qc(strategy="tensor", group_size=None), "strategy is 'tensor'"),
        (_qc(strategy="channel", group_size=None), "strategy is 'channel': 4-bit weights need 'group'"),
        (_qc(group_size=48), "group_size is 48"),
        (_qc(actorder="sideways"), "actorder is 'sideways'"),
        (_qc(dynamic=True), "dynamic is True"),
        ({**_qc(), "format": "float-quantized"}, "format is 'float-quantized'"),
        ({**_qc(), "quantization_status": "frozen"}, "quantization_status is 'frozen'"),
        ({**_qc(), "kv_cache_scheme": {"num_bits": 8}}, "kv_cache_scheme is"),
    ],
)
def test_unsupported_schemes_are_refused_naming_the_field(qc, message):
    with pytest.raises(ModelLoadError, match=message):
        parse_quantization_config({"quantization_config": qc})


def test_act_order_group_without_g_idx_is_refused():
    torch.manual_seed(0)
    q, scale, _, _ = quantize(torch.randn(8, 64), 4, 32, True)
    stored = {"m.layers.0.x_proj.weight_packed": pack_rows(q, 4), "m.layers.0.x_proj.weight_scale": scale}
    stored["m.layers.0.x_proj.weight_shape"] = torch.tensor([8, 64])
    qc = json.loads(json.dumps(_qc(actorder="group")))
    with pytest.raises(ModelLoadError, match="actorder is 'group' but the checkpoint has no"):
        convert_checkpoint(stored, parse_quantization_config({"quantization_config": qc}))
