"""INT8 and FP8 KV and INT4 weights on SmolLM2 stay close to the float32 reference (bounds measured, pinned
with a margin: see docs/measurements.md, "Quality", for the measured figures)."""

from __future__ import annotations

import pytest

from pagoda.node_agent.bench.evaluate import (
    EVAL_PROMPTS,
    EVAL_TEXT,
    expand_entries,
    format_table,
    greedy_agreement,
    greedy_tokens,
    kl_top1,
    perplexity,
    run_eval,
)

from ..engine.prompts import CHAT_PROMPTS

N_NEW = 16


@pytest.fixture(scope="module")
def reference(engine):
    """Float32 weights and KV: logits on the eval text and greedy continuations."""
    ids = engine.tokenize(EVAL_TEXT)
    return ids, engine.score(ids, phase="decode"), greedy_tokens(engine, CHAT_PROMPTS, N_NEW)


# (fixture, max mean KL, min top-1, max perplexity rise, min greedy prefix agreement).
# Measured (float32 compute, 352 text tokens, 4 chat prompts x 16 tokens), per-head static KV scales
# (per-token K scales, now the default, measure lower: see test_per_token_k_scales_beat_static_ones):
#   fp8 KV:         KL 0.0082, top-1 0.963, ppl +1.1%, greedy prefix 0.78, 2/4 prompts identical
#   int4 W + fp8 KV: KL 0.397, top-1 0.707, ppl +29%, greedy prefix 0.125, 0/4 identical
#   int8 KV:        KL 0.00098, top-1 0.983 (int4/int8 in `pagoda eval`; int4 is exact there)
# INT4 (round to nearest, group 128/64) of this already 4-bit (Q4_1) model does not keep greedy
# output; its greedy bound is left out rather than pinned at a value that cannot fail. The int8 row's
# top-1 bound is the formats issue's bar for 1-byte KV (>= 0.975 against bf16 KV).
CASES = [
    ("int8_kv_engine", 0.003, 0.975, 0.01, 0.6),
    ("fp8_kv_engine", 0.02, 0.93, 0.03, 0.6),
    ("int4_fp8_engine", 0.5, 0.65, 0.40, None),
]


@pytest.mark.parametrize(("name", "max_kl", "min_top1", "max_ppl_rise", "min_prefix"), CASES)
def test_close_to_reference(request, reference, name, max_kl, min_top1, max_ppl_rise, min_prefix) -> None:
    ids, ref_logits, ref_greedy = reference
    eng = request.getfixturevalue(name)
    logits = eng.score(ids, phase="decode")
    kl, top1 = kl_top1(ref_logits, logits)
    rise = perplexity(logits, ids) / perplexity(ref_logits, ids) - 1
    prefix, same = greedy_agreement(ref_greedy, greedy_tokens(eng, CHAT_PROMPTS, N_NEW))
    print(f"{name}: KL {kl:.5f} top-1 {top1:.3f} ppl +{rise:.2%} greedy prefix {prefix:.3f} same {same}")
    assert 0 < kl <= max_kl
    assert top1 >= min_top1
    assert rise <= max_ppl_rise
    if min_prefix is not None:
        assert prefix >= min_prefix
        assert same > 0  # at least one prompt's continuation is fully identical


def test_metrics_see_a_difference(reference) -> None:
    """The metrics themselves: identical logits give KL 0 and top-1 1; shuffled ones do not."""
    ids, ref_logits, _ = reference
    assert kl_top1(ref_logits, ref_logits) == (0.0, 1.0)
    kl, top1 = kl_top1(ref_logits, ref_logits.roll(1, dims=0))
    assert kl > 1.0 and top1 < 0.5
    assert greedy_agreement([[1, 2, 3, 4]], [[1, 2, 9, 4]]) == (0.5, 0.0)


@pytest.mark.slow
def test_per_token_k_scales_beat_static_ones(make_engine) -> None:
    """`pagoda eval`'s granularity rows on the whole eval text: per-token K scales lower the mean KL
    against bf16 KV (the baseline run; float32 pages on a CPU) below static per-head scales, for
    6 more bytes per token and layer. Measured: KL 0.0052 vs 0.0078 (per-tensor 0.0085)."""
    res = run_eval(
        make_engine,
        ["bf16/fp8"],
        kv_memory=16 << 20,
        max_new_tokens=2,
        prompts=EVAL_PROMPTS[:1],
        log=lambda line: None,
        kv_granularities=["per-token-k", "per-head"],
    )
    rows = {r["kv_scale_granularity"]: r for r in res["rows"]}
    tok, head = rows["per-token-k"], rows["per-head"]
    assert tok["formats"] == "bf16/fp8[per-token-k]" and res["baseline"] == "bf16/bf16"
    assert (tok["kv_bytes_per_token"], head["kv_bytes_per_token"]) == (390.0, 384.0)
    assert set(tok["vs_baseline"]) == {"mean_kl", "top1", "greedy_prefix", "greedy_identical"}
    print(f"KL per-token-k {tok['mean_kl']:.5f}, per-head {head['mean_kl']:.5f}")
    assert 0 < tok["vs_baseline"]["mean_kl"] < 0.85 * head["vs_baseline"]["mean_kl"]
    assert "KL vs bf16/bf16" in format_table(res)


def test_fp8_entries_expand_per_granularity() -> None:
    got = expand_entries(["bf16/bf16", "int4/fp8", "bf16/bf16/bf16/fp8_e4m3"], ["per-head", "per-tensor"])
    assert got == [
        ("bf16/bf16", None),
        ("int4/fp8[per-head]", "per-head"),
        ("int4/fp8[per-tensor]", "per-tensor"),
        ("bf16/bf16/bf16/fp8_e4m3[per-head]", "per-head"),
        ("bf16/bf16/bf16/fp8_e4m3[per-tensor]", "per-tensor"),
    ]
    assert expand_entries(["bf16/fp8"], None) == [("bf16/fp8", None)]
