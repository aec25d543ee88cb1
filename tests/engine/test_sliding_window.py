"""Sliding-window models: config.json's window semantics as transformers reads them, and tiny random
Mistral / Qwen2 models with a 64-token window serving prompts several windows long exactly as
transformers does (full context, not capped at the window), long and short prompts in one batch."""

from __future__ import annotations

import pytest
import torch

from pagoda.node_agent.engine.config import EngineConfig, PhaseFormats
from pagoda.node_agent.engine.llm_engine import LLMEngine
from pagoda.node_agent.models.config import config_from_hf
from pagoda.node_agent.params import SamplingParams
from tests.tiny_models import TOKENIZER_VOCAB, save_random_model

WINDOW = 64
LONG = 400  # prompt tokens: six windows and more
NEW_TOKENS = 8
MAX_ABS_LOGIT_DIFF = 2e-4  # float32 end to end, as tests/engine/test_architectures.py

COMMON = dict(
    vocab_size=TOKENIZER_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
)


def _hf(arch: str, **extra) -> dict:
    base = {"architectures": [arch], "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 4}
    return {**base, "vocab_size": 100, "intermediate_size": 128, **extra}


@pytest.mark.parametrize(
    "cfg,window,layers",
    [
        (_hf("MistralForCausalLM", sliding_window=4096), 4096, None),
        (_hf("MistralForCausalLM", sliding_window=None), None, None),
        # Mistral has no use_sliding_window: transformers windows every layer whatever it says
        (_hf("MistralForCausalLM", sliding_window=32, use_sliding_window=False), 32, None),
        (_hf("Qwen2ForCausalLM", sliding_window=32), None, None),  # use_sliding_window defaults off
        (
            _hf("Qwen2ForCausalLM", sliding_window=32, use_sliding_window=True, max_window_layers=1),
            32,
            (1, 2, 3),
        ),
        (_hf("Qwen2ForCausalLM", sliding_window=32, use_sliding_window=True), None, None),  # 28 >= 4 layers
        (
            _hf(
                "Qwen3ForCausalLM",
                sliding_window=32,
                use_sliding_window=True,
                layer_types=["full_attention", "sliding_attention"] * 2,
            ),
            32,
            (1, 3),
        ),
        (_hf("LlamaForCausalLM", sliding_window=32, use_sliding_window=True), None, None),
    ],
)
def test_window_semantics_follow_transformers(cfg, window, layers):
    mc = config_from_hf(cfg)
    assert (mc.sliding_window, mc.sliding_layers) == (window, layers)
    want = [window if layers is None or i in layers else None for i in range(4)]
    assert [mc.layer_window(i) for i in range(4)] == want


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(100, TOKENIZER_VOCAB, (length,), generator=gen).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def mistral(tmp_path_factory, builtin_tokenizer):
    from transformers import MistralConfig

    config = MistralConfig(**COMMON, num_hidden_layers=2, sliding_window=WINDOW)
    model, path = save_random_model(config, tmp_path_factory.mktemp("mistral_swa"), builtin_tokenizer)
    engine = LLMEngine(
        EngineConfig(model=str(path), dtype="float32", formats=PhaseFormats.reference(), kv_memory=16 << 20)
    )
    return model, engine


def _hf_greedy(model, ids: list[int]) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return out[0, len(ids) :].tolist()


def test_mistral_serves_past_its_window(mistral):
    model, engine = mistral
    assert engine.model_config.sliding_window == WINDOW
    assert engine.max_model_len == COMMON["max_position_embeddings"]  # not capped at the window
    ids = _prompts(1, LONG, seed=1)[0]
    with torch.inference_mode():
        want = model(torch.tensor([ids])).logits[0].float()
    got = engine.score(ids, phase="prefill")
    assert (got - want).abs().max().item() < MAX_ABS_LOGIT_DIFF
    # the window matters: without it the late positions' logits are another model's
    with torch.inference_mode():
        model.config.sliding_window = None
        try:
            full = model(torch.tensor([ids])).logits[0].float()
        finally:
            model.config.sliding_window = WINDOW
    assert (full[WINDOW + 8 :] - want[WINDOW + 8 :]).abs().max().item() > 100 * MAX_ABS_LOGIT_DIFF


def test_mistral_long_and_short_prompts_in_one_batch_match_transformers(mistral):
    """Eight 400-token prompts and three short ones (shorter than, as long as and just past the
    window) in one batch, prefilled in chunks: every answer equals transformers' greedy one."""
    model, engine = mistral
    prompts = _prompts(8, LONG, seed=2) + [
        p[:n] for p, n in zip(_prompts(3, 80, seed=3), (9, WINDOW, 70), strict=True)
    ]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request(ids, params) for ids in prompts]
    done = engine.run_until_done()
    equal = [done[rid].token_ids == _hf_greedy(model, ids) for rid, ids in zip(rids, prompts, strict=True)]
    assert all(equal), f"{sum(equal)}/{len(equal)} prompts equal transformers"


def test_native_decode_layer_keeps_the_window(mistral, monkeypatch):
    """INT4 decode weights over float32 pages run the native decode layer, which takes each layer's
    window: a decode step 400 tokens in equals the torch path's."""
    from pagoda.kernels.dispatch import kernel_stats, reset_kernel_stats
    from tests.engine.test_architectures import _decode_logits

    _, ref = mistral
    engine = LLMEngine(
        EngineConfig(
            model=ref.config.model,
            dtype="float32",
            formats=PhaseFormats("bf16", "bf16", "int4", "bf16"),
            kv_memory=8 << 20,
        )
    )
    assert engine.model.native is not None, engine.model.native_reason
    ids = _prompts(1, LONG, seed=4)[0]
    reset_kernel_stats()
    native = _decode_logits(engine, ids)
    assert kernel_stats().get("decode_layers/native") == 1
    monkeypatch.setenv("PAGODA_NATIVE_DECODE", "0")
    torch_path = _decode_logits(engine, ids)
    assert (native - torch_path).abs().max().item() <= 1e-5 * torch_path.abs().max().item()


def test_qwen2_windows_only_its_upper_layers(tmp_path, builtin_tokenizer):
    """Qwen2 with use_sliding_window and max_window_layers=1: layer 0 attends to everything, layer 1
    to its window; the logits of a 400-token prompt equal transformers'."""
    from transformers import Qwen2Config

    config = Qwen2Config(
        **COMMON,
        num_hidden_layers=2,
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=1,
        tie_word_embeddings=True,
    )
    model, path = save_random_model(config, tmp_path, builtin_tokenizer)
    engine = LLMEngine(
        EngineConfig(model=str(path), dtype="float32", formats=PhaseFormats.reference(), kv_memory=8 << 20)
    )
    assert [layer.window for layer in engine.model.layers] == [None, WINDOW]
    ids = _prompts(1, LONG, seed=5)[0]
    with torch.inference_mode():
        want = model(torch.tensor([ids])).logits[0].float()
    got = engine.score(ids, phase="prefill")
    assert (got - want).abs().max().item() < MAX_ABS_LOGIT_DIFF


def test_native_prefill_layer_keeps_the_window(mistral, monkeypatch):
    """A 200-token prompt through FP8 prefill weights, three windows long: the native layer's
    per-token attention rows take the window as the torch path's causal mask does."""
    from tests.engine.test_architectures import _native_and_torch_prefill, fp8_prefill_engine

    _, ref = mistral
    engine = fp8_prefill_engine(ref.config.model)
    ids = _prompts(1, 200, seed=5)[0]
    native, torch_path = _native_and_torch_prefill(engine, ids, monkeypatch)
    assert (native - torch_path).abs().max().item() <= 1e-5 * torch_path.abs().max().item()
