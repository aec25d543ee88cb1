"""The released Kimi-K2 layout (tests/formats/kimi_writer.py): ``model_type: kimi_k2`` with YaRN,
routed experts in compressed-tensors INT4 group 32, the rest in BF16, and a tiktoken tokenizer that
is custom code. Refused without --trust-remote-code, naming it; with it, greedy tokens equal
transformers' (``trust_remote_code=True`` for the tokenizer; the model read as deepseek_v3, which
this transformers has and kimi_k2 is) on the checkpoint's exact values, in float32 with ``stored``
formats, 8 of 8 prompts over 48 tokens, on one rank and on two."""

from __future__ import annotations

import argparse

import pytest
import torch

from pagoda.kernels.int4 import Int4Weight
from pagoda.node_agent.cli.engine_args import add_engine_args, engine_config_from_args
from pagoda.node_agent.engine.config import EngineConfig, ParallelConfig, PhaseFormats
from pagoda.node_agent.engine.llm_engine import LLMEngine
from pagoda.node_agent.models.moe import MoeMLP
from pagoda.node_agent.models.tokenizer_code import UntrustedCodeError, tokenizer_code
from pagoda.node_agent.params import SamplingParams
from tests.formats.kimi_writer import GROUP, VOCAB, write_kimi_k2

NEW_TOKENS = 48
PARAMS = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
PROMPTS = [
    "Once upon a time",
    "The quick brown fox jumps over the lazy dog.",
    "Mixture of experts models route every token to a few experts.",
    "1 2 3 4 5 6 7 8 9 10",
    "def add(a, b):\n    return a + b",
    "Paris is the capital of France, Rome the capital of",
    "Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich.",
    "<|im_user|>user<|im_middle|>Which layers stay in bfloat16?<|im_end|><|im_assistant|>assistant<|im_middle|>",
]
STORED = PhaseFormats("stored", "bf16", "stored", "bf16")


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    path = tmp_path_factory.mktemp("kimi_k2")
    model, cfg = write_kimi_k2(path)
    return path, model, cfg


def _config(path, **kw) -> EngineConfig:
    kw.setdefault("formats", STORED)
    return EngineConfig(model=str(path), dtype="float32", kv_memory=16 << 20, max_model_len=512, **kw)


@pytest.fixture(scope="module")
def engine(kimi):
    return LLMEngine(_config(kimi[0], trust_remote_code=True))


def _greedy(engine: LLMEngine) -> list[list[int]]:
    rids = [engine.add_request(engine.tokenize(p), PARAMS) for p in PROMPTS]
    final = engine.run_until_done()
    return [final[r].token_ids for r in rids]


@pytest.fixture(scope="module")
def reference(kimi, engine) -> list[list[int]]:
    """transformers' greedy tokens on the checkpoint's exact values (float32)."""
    model = kimi[1]
    outs = []
    with torch.inference_mode():
        for p in PROMPTS:
            ids = engine.tokenize(p)
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            outs.append(out[0, len(ids) :].tolist())
    return outs


def test_refused_without_trust_remote_code_naming_it(kimi):
    code = tokenizer_code(kimi[0])
    assert code is not None and (code.file, code.cls) == ("tokenization_kimi.py", "TikTokenTokenizer")
    with pytest.raises(UntrustedCodeError, match="--trust-remote-code"):
        LLMEngine(_config(kimi[0]))


def test_trust_remote_code_flag_is_off_by_default():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config_from_args(p.parse_args([])).trust_remote_code is False
    assert engine_config_from_args(p.parse_args(["--trust-remote-code"])).trust_remote_code is True


def test_tokenizer_is_the_directorys_own_code(kimi, engine):
    from transformers import AutoTokenizer, PreTrainedConfig

    hf = AutoTokenizer.from_pretrained(str(kimi[0]), trust_remote_code=True, config=PreTrainedConfig())
    assert type(hf).__name__ == type(engine.tokenizer._tok).__name__ == "TikTokenTokenizer"
    for p in PROMPTS:
        assert engine.tokenize(p) == hf.encode(p)
        assert engine.tokenizer.decode(hf.encode(p), skip_special_tokens=False) == p
    assert engine.tokenizer.eos_token_id == kimi[2]["eos_token_id"]


def test_layers_keep_their_stored_formats(kimi, engine):
    mc = engine.model_config
    assert mc.arch == "deepseek_v3" and mc.vocab_size == VOCAB
    assert mc.rope_scaling["rope_type"] == "yarn" and mc.rope_scaling["factor"] == 32.0
    moes = [la.mlp for la in engine.model.layers if isinstance(la.mlp, MoeMLP)]
    assert len(moes) == 2 and not isinstance(engine.model.layers[0].mlp, MoeMLP)
    for m in moes:
        for phase in ("prefill", "decode"):
            assert m.stacks[phase].fmt == "int4"
    for layer in engine.model.layers:  # attention, shared experts and the dense MLP: the compute dtype
        for lin in layer.linears():
            assert {w.fmt for w in lin.by_phase.values()} == {"bf16"}
    assert all(isinstance(w, Int4Weight) and w.group_size == GROUP for w in _expert_weights(engine))


def _expert_weights(engine):
    from pagoda.node_agent.models.loader import load_model

    loaded = load_model(engine.config.model)
    return [w for n, w in loaded.weights.items() if ".mlp.experts." in n]


def test_formats_default_to_stored(kimi):
    engine = LLMEngine(_config(kimi[0], trust_remote_code=True, formats=PhaseFormats()))
    f = engine.config.formats
    assert (f.prefill_weights, f.decode_weights) == ("stored", "stored")
    moes = [la.mlp for la in engine.model.layers if isinstance(la.mlp, MoeMLP)]
    assert all(m.stacks["prefill"].fmt == m.stacks["decode"].fmt == "int4" for m in moes)
    assert engine.state().formats["prefill_weights"] == "stored"


def test_one_rank_matches_transformers(engine, reference):
    got = _greedy(engine)
    same = [g == w for g, w in zip(got, reference, strict=True)]
    assert all(len(g) == NEW_TOKENS for g in got)
    first = next((p for p, s in zip(PROMPTS, same, strict=True) if not s), None)
    assert all(same), f"{sum(same)}/8 prompts equal at TP 1 (first apart: {first!r})"


def test_two_ranks_match_transformers(kimi, reference):
    engine = LLMEngine(
        _config(kimi[0], trust_remote_code=True, parallel=ParallelConfig(tensor_parallel=2, dist_timeout=60))
    )
    try:
        got = _greedy(engine)
    finally:
        engine.close()
    same = [g == w for g, w in zip(got, reference, strict=True)]
    assert all(same), f"{sum(same)}/8 prompts equal at TP 2"
