"""Tiny random-weight Qwen3-MoE and GLM-4.5 MoE models saved by transformers load into the engine:
logits and greedy output match transformers, chunked prefill and preemption keep the output, the
CLI serves them, and INT4 decode experts shrink with a bounded error."""

from __future__ import annotations

import json

import pytest
import torch

from pagoda.kernels.moe import make_expert_stack
from pagoda.node_agent.engine.config import EngineConfig, PhaseFormats
from pagoda.node_agent.engine.kv_setup import kv_components
from pagoda.node_agent.engine.llm_engine import LLMEngine
from pagoda.node_agent.kv.pool import KVPagePool
from pagoda.node_agent.models.moe import MoeMLP
from pagoda.node_agent.params import SamplingParams
from tests.tiny_models import TOKENIZER_VOCAB, save_random_model

# float32 end to end (router included); paged attention and the grouped expert GEMMs reorder sums.
MAX_ABS_LOGIT_DIFF = 1e-3
# INT4 decode experts (group 64, asymmetric) swapped into the float32 model: relative L2 error of
# the logits. Group-wise 4-bit random Gaussian weights carry ~9% relative error per matrix (step
# range/15, error step/sqrt(12)); only the experts' share of the residual stream carries it, and it
# measures 0.065 (qwen3_moe) / 0.030 (glm4_moe). 0.15 leaves room for routing flips on other
# seeds, while a wrong scale, a swapped gate/up half or a wrong expert (~1.0) fails.
MAX_INT4_EXPERTS_REL_ERR = 0.15
MIN_INT4_EXPERTS_TOP1 = 0.75  # measured 0.91 / 1.0 of the positions keep their argmax
# The whole default decode path (INT4 attention and dense MLPs too, FP8 KV) of these random
# models measures 0.30 / 0.12, dominated by the non-expert INT4 layers; bounded loosely.
MAX_INT4_ALL_REL_ERR = 0.5
# Under --int4-compute float32 (the default) the CPU holds the exact native kernel's layout, as a
# dense INT4 layer does: nibbles + float32 scale and offset + uint8 zero per 64 weights (experts
# quantized at load have scales float16 cannot hold exactly) = (0.5 + 9/64) / 2 = 0.320x of bf16;
# torch's int4pack layout (bf16 compute) 0.281x, canonical on GPU 0.289x.
INT4_MAX_RATIO_VS_BF16 = 0.33

PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [
    "Once upon a time",
    "The quick brown fox jumps over the lazy dog and keeps running through the forest.",
    "Mixture of experts models route every token to a few experts.",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
]

COMMON = dict(
    vocab_size=TOKENIZER_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts_per_tok=2,
    max_position_embeddings=256,
    initializer_range=0.05,  # large enough that the experts, not the residual stream, shape the logits
    norm_topk_prob=True,
    tie_word_embeddings=False,
)


def _hf_config(arch: str):
    from transformers import Glm4MoeConfig, Qwen3MoeConfig

    if arch == "qwen3_moe":  # layer 1 dense through mlp_only_layers
        return Qwen3MoeConfig(**COMMON, num_experts=8, decoder_sparse_step=1, mlp_only_layers=[1])
    return Glm4MoeConfig(  # layer 0 dense; 4 groups of 2 experts, the best 2 groups eligible
        **COMMON,
        n_routed_experts=8,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        attention_bias=True,
        use_qk_norm=True,
        partial_rotary_factor=0.5,
    )


def _randomize_routing(model, arch: str) -> None:
    """Router weights and biases that matter (transformers zero-initialises some of them)."""
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "weight") and gate.weight.dim() == 2:
            torch.nn.init.normal_(gate.weight, std=0.5)
            if arch == "glm4_moe":
                gate.e_score_correction_bias.normal_(std=0.2)
        if arch == "glm4_moe":
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)


@pytest.fixture(scope="module", params=["qwen3_moe", "glm4_moe"])
def tiny_moe(request, tmp_path_factory, builtin_tokenizer):
    arch = request.param
    path = tmp_path_factory.mktemp(arch)
    model, path = save_random_model(
        _hf_config(arch), path, builtin_tokenizer, prepare=lambda m: _randomize_routing(m, arch)
    )
    engine = LLMEngine(
        EngineConfig(model=str(path), dtype="float32", formats=PhaseFormats.reference(), kv_memory=8 << 20)
    )
    return arch, model, engine, path


def _hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return out[0, len(ids) :].tolist()


def test_structure_follows_the_config(tiny_moe):
    arch, _, engine, _ = tiny_moe
    mc = engine.model_config
    assert mc.arch == arch
    sparse = [isinstance(layer.mlp, MoeMLP) for layer in engine.model.layers]
    assert sparse == ([True, False, True] if arch == "qwen3_moe" else [False, True, True])
    if arch == "glm4_moe":
        assert mc.rotary_dim == mc.head_dim // 2 and mc.attention_bias and mc.qk_norm
        assert (mc.moe.n_group, mc.moe.topk_group, mc.moe.n_shared_experts) == (4, 2, 1)
    sizes = engine.model.weight_bytes()
    assert sizes["experts"] == 2 * 8 * 3 * 64 * 64 * 4  # 2 sparse layers, 8 float32 experts
    assert sizes["total"] > sizes["linear"] + sizes["experts"]


def test_logits_match_transformers(tiny_moe):
    arch, model, engine, _ = tiny_moe
    ids = engine.tokenize(PROMPTS[1] * 2)
    assert len(ids) > engine.decode_pool.page_size  # spans several pages
    with torch.inference_mode():
        want = model(torch.tensor([ids])).logits[0].float()
    got = engine.score(ids, phase="prefill")
    diff = (got - want).abs().max().item()
    assert diff <= MAX_ABS_LOGIT_DIFF, f"{arch}: max |logit diff| {diff}"
    assert want.std().item() > 0.1  # the comparison is not between near-zero logits


def test_greedy_decode_matches_transformers(tiny_moe):
    arch, model, engine, _ = tiny_moe
    ids = engine.tokenize(PROMPTS[0])
    rid = engine.add_request(ids, PARAMS)
    got = engine.run_until_done()[rid].token_ids
    assert got == _hf_greedy(model, ids, PARAMS.max_tokens), arch


def test_cli_generate_matches_transformers(tiny_moe, capsys):
    from pagoda.node_agent.cli.main import main

    arch, model, engine, path = tiny_moe
    argv = ["generate", "--model", f"hf-dir://{path}", "--dtype", "float32", "--temperature", "0"]
    argv += ["--max-tokens", "8", "--json", "--prompt", PROMPTS[0]]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    want = _hf_greedy(model, engine.tokenize(PROMPTS[0]), 8)
    assert out["token_ids"] == want[: len(out["token_ids"])], arch
    assert len(out["token_ids"]) == 8 or out["finish_reason"] == "stop"


def test_chunked_prefill_and_preemption_keep_greedy_output(tiny_moe):
    arch, _, engine, path = tiny_moe
    prompts = [engine.tokenize(p) for p in PROMPTS]
    reference = []
    for ids in prompts:
        rid = engine.add_request(ids, PARAMS)
        reference.append(engine.run_until_done()[rid].token_ids)
    mc = engine.model_config
    per_page = KVPagePool.bytes_per_page(mc.num_layers, 16, kv_components(mc), torch.float32)
    # ~16 pages for the four sequences at full length; 6 force decode to preempt
    small = LLMEngine(
        EngineConfig(
            model=str(path),
            dtype="float32",
            formats=PhaseFormats.reference(),
            kv_memory=6 * per_page,
            max_num_batched_tokens=16,
            enable_prefix_caching=False,
        )
    )
    rids = [small.add_request(ids, PARAMS) for ids in prompts]
    final = small.run_until_done()
    assert small.scheduler.num_preemptions > 0, "the budget was meant to force preemption"
    assert [final[r].token_ids for r in rids] == reference, arch
    small.decode_pool.check_idle()


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


def test_int4_decode_experts_shrink_with_bounded_error(tiny_moe):
    arch, _, engine, path = tiny_moe
    # --dtype float32 --decode-weights int4 with the default formats otherwise (fp8 prefill weights)
    q = LLMEngine(EngineConfig(model=str(path), dtype="float32", formats=PhaseFormats(), kv_memory=8 << 20))
    moes = [layer.mlp for layer in q.model.layers if isinstance(layer.mlp, MoeMLP)]
    for m in moes:
        assert (m.stacks["prefill"].fmt, m.stacks["decode"].fmt) == ("fp8", "int4")
        dec = m.stacks["decode"]
        bf16 = make_expert_stack(*_zero_experts(dec), "dense", dtype=torch.bfloat16).nbytes()
        assert dec.nbytes() <= INT4_MAX_RATIO_VS_BF16 * bf16, (dec.nbytes(), bf16)
    expert_bytes = q.model.weight_bytes()["experts"]
    assert expert_bytes == sum(m.expert_bytes() for m in moes)
    ids = engine.tokenize(PROMPTS[1] * 2)
    want = engine.score(ids, phase="decode")
    assert _rel_err(q.score(ids, phase="decode"), want) <= MAX_INT4_ALL_REL_ERR, arch
    # the INT4 experts alone, in the otherwise float32 model
    dense = [layer.mlp for layer in engine.model.layers if isinstance(layer.mlp, MoeMLP)]
    saved = [m.stacks for m in dense]
    try:
        for m, qm in zip(dense, moes, strict=True):
            m.stacks = {"prefill": m.stacks["prefill"], "decode": qm.stacks["decode"]}
        got = engine.score(ids, phase="decode")
    finally:
        for m, stacks in zip(dense, saved, strict=True):
            m.stacks = stacks
    rel = _rel_err(got, want)
    top1 = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert rel <= MAX_INT4_EXPERTS_REL_ERR, f"{arch}: relative logit error {rel:.3f}"
    assert top1 >= MIN_INT4_EXPERTS_TOP1, f"{arch}: argmax kept at {top1:.2f} of the positions"
    rid = q.add_request(ids[:8], PARAMS)  # generation runs through the int4 decode path
    assert len(q.run_until_done()[rid].token_ids) == PARAMS.max_tokens
    assert q.model.weight_bytes()["experts"] == expert_bytes  # no layout built on first use


def _zero_experts(stack) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gate, up, down) of the stack's shapes, to size the same experts as bf16."""
    e, i, h = stack.num_experts, stack.intermediate, stack.hidden
    return torch.zeros(e, i, h), torch.zeros(e, i, h), torch.zeros(e, h, i)


def test_quantize_refuses_moe_models_before_loading_weights(tiny_moe, tmp_path):
    from pagoda.node_agent.models.quantize import quantize_checkpoint

    arch, _, _, path = tiny_moe
    with pytest.raises(ValueError, match=f"does not support mixture-of-experts models \\({arch}\\)"):
        quantize_checkpoint(str(path), "int4", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_unknown_gguf_moe_architecture_is_refused_naming_it(tmp_path):
    import gguf

    from pagoda.node_agent.models.config import ModelLoadError
    from pagoda.node_agent.models.loader import load_model

    # qwen3moe, glm4moe and deepseek2 GGUF files load (tests/engine/test_gguf_moe.py)
    f = tmp_path / "tiny-qwen2moe.gguf"
    w = gguf.GGUFWriter(str(f), "qwen2moe")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="unsupported architecture 'qwen2moe'"):
        load_model(str(f))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_experts_per_tok": 9}, "num_experts_per_tok \\(9\\) must be in \\[1, num_experts \\(8\\)\\]"),
        ({"n_group": 3}, "n_group \\(3\\) must divide the experts \\(8\\)"),
        ({"topk_group": 5}, "topk_group \\(5\\) be in \\[1, n_group\\]"),
        ({"n_group": 8, "topk_group": 1}, "groups of 1 experts cannot give top-2"),
        ({"partial_rotary_factor": 0.3125}, "rotary dimension 5 must be even"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ],
)
def test_bad_moe_configs_are_refused(change, message):
    from pagoda.node_agent.models.config import ModelLoadError, config_from_hf

    raw = _hf_config("glm4_moe").to_dict() | {"partial_rotary_factor": 0.5} | change
    with pytest.raises(ModelLoadError, match=message):
        config_from_hf(raw)


def test_missing_or_misshapen_experts_fail_at_load(tiny_moe, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from pagoda.node_agent.models.config import ModelLoadError
    from pagoda.node_agent.models.loader import load_model

    arch, _, _, path = tiny_moe
    layer = 0 if arch == "qwen3_moe" else 1
    shutil.copytree(path, tmp_path / "m")
    weights = load_file(str(tmp_path / "m" / "model.safetensors"))
    gone = f"model.layers.{layer}.mlp.experts.3.up_proj.weight"
    del weights[gone]
    save_file(weights, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=f"missing weights \\['{gone}'\\]"):
        load_model(str(tmp_path / "m"))
    raw = json.loads((path / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps(raw | {"moe_intermediate_size": 32}))
    shutil.copyfile(path / "model.safetensors", tmp_path / "m" / "model.safetensors")
    with pytest.raises(ModelLoadError, match="do not match num_experts=8, moe_intermediate_size=32"):
        LLMEngine(EngineConfig(model=str(tmp_path / "m"), dtype="float32", kv_memory=1 << 20))
