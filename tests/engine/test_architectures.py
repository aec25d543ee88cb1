"""Tiny random-weight Llama, Mistral, Qwen2 and Qwen3 models (and Llama 3.1 / linear RoPE scaling)
saved by transformers load into the engine and match transformers' logits."""

from __future__ import annotations

import pytest
import torch

from pagoda.node_agent.engine.config import EngineConfig, PhaseFormats
from pagoda.node_agent.engine.llm_engine import LLMEngine
from pagoda.node_agent.params import SamplingParams
from tests.tiny_models import TOKENIZER_VOCAB, save_random_model

# float32 end to end; paged attention and fused ops reorder sums, so allow a little rounding.
MAX_ABS_LOGIT_DIFF = 2e-4

COMMON = dict(
    vocab_size=TOKENIZER_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)


def _configs():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    return {
        "llama": LlamaConfig(**COMMON, rope_theta=10000.0, tie_word_embeddings=False),
        "mistral": MistralConfig(**COMMON, rope_theta=10000.0, sliding_window=None),
        "qwen2": Qwen2Config(**COMMON, rope_theta=1000000.0, tie_word_embeddings=True),
        "qwen3": Qwen3Config(**COMMON, head_dim=32, rope_theta=1000000.0, tie_word_embeddings=False),
        # Llama 3.1-style and linear RoPE scaling (a small original context so the stretch matters)
        "llama3_rope": LlamaConfig(
            **COMMON,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
        "linear_rope": Qwen2Config(
            **COMMON,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "linear", "rope_theta": 1000000.0, "factor": 4.0},
        ),
    }


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2", "qwen3", "llama3_rope", "linear_rope"])
def tiny_model(request, tmp_path_factory, builtin_tokenizer):
    def draw_biases(model) -> None:  # q/k/v biases are zero-initialised; make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)

    prepare = draw_biases if request.param in ("qwen2", "linear_rope") else None
    path = tmp_path_factory.mktemp(request.param)
    model, path = save_random_model(_configs()[request.param], path, builtin_tokenizer, prepare=prepare)
    engine = LLMEngine(
        EngineConfig(model=str(path), dtype="float32", formats=PhaseFormats.reference(), kv_memory=8 << 20)
    )
    return request.param, model, engine


def test_logits_match_transformers(tiny_model):
    arch, model, engine = tiny_model
    assert engine.model_config.arch == {"llama3_rope": "llama", "linear_rope": "qwen2"}.get(arch, arch)
    ids = engine.tokenize("The quick brown fox jumps over the lazy dog. " * 3)
    assert len(ids) > engine.decode_pool.page_size  # spans several pages
    with torch.inference_mode():
        want = model(torch.tensor([ids])).logits[0].float()
    got = engine.score(ids, phase="prefill")
    diff = (got - want).abs().max().item()
    assert diff < MAX_ABS_LOGIT_DIFF, f"{arch}: max |logit diff| {diff}"


def test_greedy_decode_matches_transformers(tiny_model):
    arch, model, engine = tiny_model
    ids = engine.tokenize("Once upon a time")
    rid = engine.add_request(ids, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    got = engine.run_until_done()[rid].token_ids
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    assert got == out[0, len(ids) :].tolist(), arch


def _decode_logits(engine, ids: list[int]) -> torch.Tensor:
    """The logits of one decode step (the last token of ``ids``) after a prefill of the others."""
    from pagoda.node_agent.engine.scheduler import ScheduledStep
    from pagoda.node_agent.engine.sequence import Sequence

    runner, pool = engine.runner, engine.decode_pool
    seq = Sequence("native-check", ids, SamplingParams(max_tokens=1))
    seq.block_table = pool.allocate_pages(-(-len(ids) // pool.page_size))
    try:
        batch, _ = runner.build_batch(ScheduledStep("prefill", [seq], [len(ids) - 1]), pool)
        runner.forward(batch, pool, logits=False)
        seq.num_computed_tokens = len(ids) - 1
        batch, _ = runner.build_batch(ScheduledStep("decode", [seq], [1]), pool)
        assert batch.phase == "decode"
        return runner.forward(batch, pool)
    finally:
        pool.release_all(seq.block_table)


def test_native_decode_layer_matches_the_torch_path(tiny_model, monkeypatch):
    """INT4 decode weights over float32 pages: every family here runs the native decode layer (Qwen2's
    q/k/v biases and Qwen3's q/k norms included), and a decode step's logits equal the torch path's
    within float32 rounding (a random tiny model's tokens barely depend on its logits)."""
    from pagoda.kernels.dispatch import kernel_stats, reset_kernel_stats

    arch, _, ref = tiny_model
    engine = LLMEngine(
        EngineConfig(
            model=ref.config.model,
            dtype="float32",
            formats=PhaseFormats("bf16", "bf16", "int4", "bf16"),
            kv_memory=8 << 20,
        )
    )
    assert engine.model.native is not None, f"{arch}: {engine.model.native_reason}"
    ids = engine.tokenize("The quick brown fox jumps over the lazy dog. " * 2)
    reset_kernel_stats()
    native = _decode_logits(engine, ids)
    assert kernel_stats().get("decode_layers/native") == 1
    monkeypatch.setenv("PAGODA_NATIVE_DECODE", "0")
    reset_kernel_stats()
    torch_path = _decode_logits(engine, ids)
    assert "decode_layers/native" not in kernel_stats()
    scale = torch_path.abs().max().item()
    assert (native - torch_path).abs().max().item() <= 1e-5 * scale, arch


def _native_and_torch_prefill(engine, ids: list[int], monkeypatch) -> tuple[torch.Tensor, torch.Tensor]:
    """A prompt's logits at every position through the prefill weights: the native layer's, then
    the torch path's (the same engine, every chunk sent to torch)."""
    from pagoda.kernels.dispatch import kernel_stats, reset_kernel_stats
    from pagoda.node_agent.models import native_decode

    reset_kernel_stats()
    native = engine.score(ids, phase="prefill")
    assert kernel_stats().get("prefill_layers/native") == 1
    monkeypatch.setattr(native_decode, "PREFILL_BELOW_TOKENS", 0)
    reset_kernel_stats()
    torch_path = engine.score(ids, phase="prefill")
    assert "prefill_layers/native" not in kernel_stats()
    return native, torch_path


def fp8_prefill_engine(path) -> LLMEngine:
    """FP8 prefill weights over float32 pages (INT4 decode), where the fused FP8 kernel runs."""
    from pagoda.kernels.cpu_fp8_native import fused_available

    from ..native_build import require_native

    require_native()
    if not fused_available():
        pytest.skip("the fused FP8 kernel needs AVX-512 F: FP8 prefill chunks keep the torch path here")
    engine = LLMEngine(
        EngineConfig(
            model=str(path),
            dtype="float32",
            formats=PhaseFormats("fp8", "bf16", "int4", "bf16"),
            kv_memory=8 << 20,
        )
    )
    assert engine.model.native is not None and "prefill" in engine.model.native.specs, (
        engine.model.native_reasons
    )
    return engine


def test_native_prefill_layer_matches_the_torch_path(tiny_model, monkeypatch):
    """FP8 prefill weights: every family here runs a small prefill chunk natively (Qwen2's biases,
    Qwen3's q/k norms, scaled RoPE), and the prompt's logits at every position equal the torch
    path's within float32 rounding."""
    arch, _, ref = tiny_model
    engine = fp8_prefill_engine(ref.config.model)
    ids = engine.tokenize("The quick brown fox jumps over the lazy dog. " * 3)
    native, torch_path = _native_and_torch_prefill(engine, ids, monkeypatch)
    scale = torch_path.abs().max().item()
    assert (native - torch_path).abs().max().item() <= 1e-5 * scale, arch
