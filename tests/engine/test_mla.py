"""A tiny random-weight DeepSeek-V3 (multi-head latent attention, YaRN RoPE, grouped sigmoid MoE
with a shared expert) saved by transformers runs in the engine over latent KV pages: logits and
greedy output match transformers, through batching, chunked prefill, preemption and the CLI."""

from __future__ import annotations

import json

import pytest
import torch

from pagoda.node_agent.engine.config import EngineConfig, PhaseFormats
from pagoda.node_agent.engine.kv_setup import kv_components
from pagoda.node_agent.engine.llm_engine import LLMEngine
from pagoda.node_agent.kv.pool import KVPagePool
from pagoda.node_agent.models.mla import MlaAttention
from pagoda.node_agent.models.moe import MoeMLP
from pagoda.node_agent.params import SamplingParams
from tests.tiny_models import TOKENIZER_VOCAB, save_random_model

# float32 end to end; the absorbed form (W_UK folded into q, W_UV after attention) and the paged
# gathers reorder sums, nothing else differs.
MAX_ABS_LOGIT_DIFF = 1e-3
PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = [
    "Once upon a time",
    "The quick brown fox jumps over the lazy dog and keeps running through the forest.",
    "Latent attention stores one compressed vector per token.",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
]
# FP8 e4m3 latent + rope-key pages (static per-layer scales, headroom 1.5) vs float32 pages on this
# random model, whose logits are nearly flat (perplexity ~ the vocabulary), so argmax is fragile:
# on the text below mean KL measures 2.4e-3 nats and top-1 0.875 (`pagoda eval`'s prompts: 4e-4, 0.93).
FP8_MAX_MEAN_KL = 0.01
FP8_MIN_TOP1 = 0.75
LORA = dict(q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)


def _hf_config():
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
        max_position_embeddings=512,
        initializer_range=0.05,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        **LORA,
    )


@pytest.fixture(scope="module")
def tiny_mla(tmp_path_factory, builtin_tokenizer):
    def draw_routers(model) -> None:  # routers that matter (transformers zero-initialises them)
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                torch.nn.init.normal_(gate.weight, std=0.5)
                gate.e_score_correction_bias.normal_(std=0.2)

    path = tmp_path_factory.mktemp("deepseek_v3")
    model, path = save_random_model(_hf_config(), path, builtin_tokenizer, prepare=draw_routers)
    engine = _engine(path)
    return model, engine, path


def _engine(path, **kw) -> LLMEngine:
    kw.setdefault("kv_memory", 4 << 20)
    kw.setdefault("formats", PhaseFormats.reference())
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", **kw))


def _hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return out[0, len(ids) :].tolist()


def test_structure_and_latent_pages(tiny_mla):
    _, engine, _ = tiny_mla
    mc = engine.model_config
    assert mc.arch == "deepseek_v3" and mc.mla.q_lora_rank == 24 and mc.rope_scaling["rope_type"] == "yarn"
    assert [isinstance(layer.mlp, MoeMLP) for layer in engine.model.layers] == [False, True, True]
    assert all(isinstance(layer.mla, MlaAttention) for layer in engine.model.layers)
    assert kv_components(mc) == {"latent": (1, 32), "rope_k": (1, 8)}
    assert engine.decode_pool.layers[0]["latent"].shape[1:] == (engine.decode_pool.page_size, 1, 32)
    # softmax scale: (16 + 8) ** -0.5 * (0.1 * ln 4 + 1) ** 2
    assert mc.mla.softmax_scale == pytest.approx(
        24**-0.5 * (0.1 * torch.log(torch.tensor(4.0)).item() + 1) ** 2
    )


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_logits_match_transformers(tiny_mla, phase):
    model, engine, _ = tiny_mla
    ids = engine.tokenize(PROMPTS[1] * 3)
    assert len(ids) > 2 * engine.decode_pool.page_size  # spans several pages
    with torch.inference_mode():
        want = model(torch.tensor([ids])).logits[0].float()
    got = engine.score(ids, phase=phase)
    diff = (got - want).abs().max().item()
    assert diff <= MAX_ABS_LOGIT_DIFF, f"max |logit diff| {diff}"
    assert want.std().item() > 0.05  # the logits are not flat (the check above could not pass trivially)


@pytest.fixture(scope="module")
def hf_outputs(tiny_mla) -> list[list[int]]:
    """transformers' greedy continuations of PROMPTS."""
    model, engine, _ = tiny_mla
    return [_hf_greedy(model, engine.tokenize(p), PARAMS.max_tokens) for p in PROMPTS]


def test_greedy_batched_matches_transformers(tiny_mla, hf_outputs):
    _, engine, _ = tiny_mla
    rids = [engine.add_request(engine.tokenize(p), PARAMS) for p in PROMPTS]  # one batch
    final = engine.run_until_done()
    assert [final[r].token_ids for r in rids] == hf_outputs


def test_chunked_prefill_and_preemption_keep_greedy_output(tiny_mla, hf_outputs):
    _, engine, path = tiny_mla
    prompts = [engine.tokenize(p) for p in PROMPTS]
    mc = engine.model_config
    per_page = KVPagePool.bytes_per_page(mc.num_layers, 16, kv_components(mc), torch.float32)
    # ~8 pages for the four sequences at full length; 4 force decode to preempt, 16-token chunks
    small = _engine(path, kv_memory=4 * per_page, max_num_batched_tokens=16, enable_prefix_caching=False)
    rids = [small.add_request(ids, PARAMS) for ids in prompts]
    final = small.run_until_done()
    assert small.scheduler.num_preemptions > 0, "the budget was meant to force preemption"
    assert [final[r].token_ids for r in rids] == hf_outputs
    small.decode_pool.check_idle()


def test_cli_generate_matches_transformers(tiny_mla, capsys):
    from pagoda.node_agent.cli.main import main

    model, engine, path = tiny_mla
    argv = ["generate", "--model", f"hf-dir://{path}", "--dtype", "float32", "--temperature", "0"]
    argv += ["--max-tokens", "8", "--json", "--prompt", PROMPTS[0]]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    want = _hf_greedy(model, engine.tokenize(PROMPTS[0]), 8)
    assert out["token_ids"] == want[: len(out["token_ids"])]
    assert len(out["token_ids"]) == 8 or out["finish_reason"] == "stop"


def test_plain_q_proj_and_rotate_half_rope_variant(tmp_path, builtin_tokenizer):
    """q_lora_rank null (a plain q_proj), rope_interleave false and no RoPE scaling: logits match."""
    cfg = _hf_config()
    cfg.q_lora_rank, cfg.rope_interleave, cfg.num_hidden_layers = None, False, 2
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    model, _ = save_random_model(cfg, tmp_path, builtin_tokenizer, seed=1)
    engine = _engine(tmp_path)
    mc = engine.model_config
    assert mc.mla.q_lora_rank is None and not mc.mla.rope_interleave and mc.rope_scaling is None
    assert mc.mla.softmax_scale == pytest.approx(24**-0.5)
    ids = engine.tokenize(PROMPTS[1] * 2)
    with torch.inference_mode():
        want = model(torch.tensor([ids])).logits[0].float()
    diff = (engine.score(ids, phase="decode") - want).abs().max().item()
    assert diff <= MAX_ABS_LOGIT_DIFF, f"max |logit diff| {diff}"


FP8_DECODE = PhaseFormats("bf16", "bf16", "bf16", "fp8_e4m3")  # compute-dtype prefill pages, fp8 decode


@pytest.fixture(scope="module")
def fp8_engines(tiny_mla):
    """A --role both engine (float32 prefill pool -> fp8 decode pool), and a prefill-only and a
    decode-only worker with the same formats."""
    _, _, path = tiny_mla
    return tuple(_engine(path, formats=FP8_DECODE, role=role) for role in ("both", "prefill", "decode"))


def test_fp8_latent_pages_are_calibrated_per_layer_and_component(tiny_mla, fp8_engines):
    _, ref, _ = tiny_mla
    both, _, _ = fp8_engines
    assert both.decode_pool.kv_format == "fp8_e4m3" and both.prefill_pool.dtype == torch.float32
    for scales in both.decode_pool.scales:
        assert set(scales) == {"latent", "rope_k"}
        assert all(
            s.shape == (1,) and bool(torch.isfinite(s).all()) and float(s) > 0 for s in scales.values()
        )
        assert float(scales["latent"]) != float(scales["rope_k"])  # calibrated, each its own
    mc = both.model_config
    comps = kv_components(mc)
    fp8 = KVPagePool.pages_for_budget(8 << 20, mc.num_layers, 16, comps, torch.float8_e4m3fn)
    bf16 = KVPagePool.pages_for_budget(8 << 20, mc.num_layers, 16, comps, torch.bfloat16)
    assert fp8 / bf16 >= 1.95
    # quality of the fp8 latent pages against float32 ones, same weights
    ids = ref.tokenize(PROMPTS[1] * 3)
    want = ref.score(ids, phase="decode").log_softmax(-1)
    got = both.score(ids, phase="decode").log_softmax(-1)
    kl = (want.exp() * (want - got)).sum(-1).mean().item()
    top1 = (want.argmax(-1) == got.argmax(-1)).float().mean().item()
    assert kl <= FP8_MAX_MEAN_KL and top1 >= FP8_MIN_TOP1, (kl, top1)


def _prefill_payload(prefill: LLMEngine, ids: list[int]):
    pid = prefill.add_request(ids, PARAMS, prefill_only=True)
    out = prefill.run_until_done()[pid]
    assert out.finish_reason == "prefilled" and out.kv_payload.kv_format == "bf16"
    assert set(out.kv_payload.layers[0]) == {"latent", "rope_k"}
    return out.kv_payload


def test_latent_pages_migrate_and_hand_off_bf16_to_fp8(fp8_engines):
    """The --role both engine migrates each prefilled sequence's latent pages into its fp8 decode
    pool; a prefill worker's payload continued on a decode worker gives the same tokens."""
    both, prefill, decode = fp8_engines
    prompts = [both.tokenize(p) for p in PROMPTS]
    rids = [both.add_request(ids, PARAMS) for ids in prompts]
    want = both.run_until_done()
    assert both.stats.migrations == len(PROMPTS)
    for ids, rid in zip(prompts, rids, strict=True):
        did = decode.add_prefilled(_prefill_payload(prefill, ids), PARAMS)
        assert decode.run_until_done()[did].token_ids == want[rid].token_ids
    decode.decode_pool.check_idle()


def test_latent_pages_cross_the_kv_transport(fp8_engines):
    """A bf16 latent payload sent over the TCP KV transport to a decode worker's limits arrives
    bit-exact and decodes as the in-process handoff does."""
    import asyncio

    from pagoda.node_agent.serving.api.internal_auth import InternalAuth
    from pagoda.node_agent.serving.worker.kv_limits import KVLimits
    from pagoda.node_agent.serving.worker.kv_transport import TcpKVReceiver, TcpKVSender

    _, prefill, decode = fp8_engines
    ids = decode.tokenize(PROMPTS[3])
    sent = _prefill_payload(prefill, ids)
    auth = InternalAuth("test-internal-token-0123456789")

    async def transfer():
        got = {}

        async def handler(ticket, payload):
            got[ticket] = payload

        rx = TcpKVReceiver("127.0.0.1", 0, handler, auth, KVLimits.for_engine(decode), lambda t: None)
        addr = await rx.start()
        try:
            await TcpKVSender(auth, timeout=30).send(addr, "t1", sent)
        finally:
            await rx.stop()
        (payload,) = got.values()
        return payload

    received = asyncio.run(transfer())
    for a, b in zip(sent.layers, received.layers, strict=True):
        assert set(a) == set(b) and all(torch.equal(a[c], b[c]) for c in a)
    outs = []
    for payload in (sent, received):  # one after the other: they share a request id
        rid = decode.add_prefilled(payload, PARAMS)
        outs.append(decode.run_until_done()[rid].token_ids)
    assert outs[1] == outs[0] and len(outs[0]) == PARAMS.max_tokens
    decode.decode_pool.check_idle()


def test_a_payload_of_gqa_pages_is_refused_by_an_mla_decode_worker(fp8_engines):
    from dataclasses import replace

    from pagoda.node_agent.params import RequestError

    _, prefill, decode = fp8_engines
    good = _prefill_payload(prefill, decode.tokenize(PROMPTS[0]))
    n = good.num_pages
    gqa = [{c: torch.zeros(n, 16, 4, 8) for c in ("k", "v")} for _ in good.layers]
    with pytest.raises(RequestError, match="latent|rope_k|component"):
        decode.add_prefilled(replace(good, layers=gqa), PARAMS)
    decode.decode_pool.check_idle()  # refused before anything was allocated


def test_bad_mla_configs_and_missing_weights_fail_at_load(tiny_mla, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from pagoda.node_agent.models.config import ModelLoadError, config_from_hf
    from pagoda.node_agent.models.loader import load_model

    _, _, path = tiny_mla
    raw = json.loads((path / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="qk_rope_head_dim even"):
        config_from_hf(raw | {"qk_rope_head_dim": 7})
    with pytest.raises(ModelLoadError, match="rope_scaling .* not supported"):
        config_from_hf(raw | {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}})
    with pytest.raises(ModelLoadError, match="missing required field 'kv_lora_rank'"):
        config_from_hf({k: v for k, v in raw.items() if k != "kv_lora_rank"})
    for f in path.iterdir():
        shutil.copy(f, tmp_path / f.name)
    weights = load_file(str(path / "model.safetensors"))
    del weights["model.layers.1.self_attn.kv_b_proj.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="kv_b_proj"):
        load_model(f"hf-dir://{tmp_path}")
