"""The measured window of a traced run: pure decode steps, at full batch when asked (no model)."""

from __future__ import annotations

import pytest

from pagoda.node_agent.bench.stepping import StepRecord, Trace


def step(seconds: float, prefill: int = 0, decode: int = 0, migrations: int = 0) -> StepRecord:
    return StepRecord(seconds, prefill, decode, migrations, preemptions=0)


def test_window_leaves_out_prefill_recompute_and_migration_steps() -> None:
    trace = Trace(
        steps=[
            step(5.0, prefill=300),  # prefill chunk
            step(0.1, decode=2),  # the first two decode while the rest prefill
            step(5.0, prefill=200),
            step(0.2, decode=4, migrations=2),  # migration work inside: not pure decode
            step(0.2, decode=4),
            step(0.2, decode=4),
            step(0.1, decode=2),  # tail after the first two finished
        ],
        ttft_s=[1.0, 2.0, 3.0],
        total_s=11.0,
    )
    full = trace.decode_rate(batch=4)
    assert full["window_steps"] == 2 and full["decode_tok_s"] == pytest.approx(8 / 0.4)
    assert full["window_mean_batch"] == 4 and full["decode_step_s"] == pytest.approx(0.2)
    anyb = trace.decode_rate()
    assert anyb["window_steps"] == 4 and anyb["decode_tok_s"] == pytest.approx(12 / 0.6)
    assert trace.median_ttft() == 2.0


def test_a_batch_never_held_is_refused_not_reported_as_zero() -> None:
    trace = Trace(
        steps=[step(1.0, prefill=64), step(0.1, decode=4), step(0.1, decode=4)], ttft_s=[], total_s=1.2
    )
    assert trace.full_batch_rate(4)["window_steps"] == 2
    with pytest.raises(ValueError, match="no decode step ran all 8 sequences at once"):
        trace.full_batch_rate(8)
