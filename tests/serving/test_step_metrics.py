"""Preemptions and the time budget's figures on /metrics, from an engine snapshot (no server)."""

from __future__ import annotations

from pagoda.node_agent.engine.state import KVPoolState
from pagoda.node_agent.engine.step_budget import BudgetStats
from pagoda.node_agent.serving.api.metrics import EngineSnapshot, ServeMetrics, metric_sum, parse_metrics

POOLS = [
    KVPoolState("prefill-kv", 10, 0, 16, 160, "bf16"),
    KVPoolState("decode-kv", 20, 5, 16, 320, "int8"),
]


def render(snap: EngineSnapshot) -> dict[str, float]:
    return parse_metrics(ServeMetrics("both", lambda: snap).render().decode())


def test_preemptions_are_counted_by_kv_pool_and_format() -> None:
    m = render(EngineSnapshot(pools=POOLS, preemptions={"prefill-kv": 1, "decode-kv": 7}))
    assert metric_sum(m, "pagoda_preemptions_total", pool="both", kv_pool="decode-kv", kv_format="int8") == 7
    assert metric_sum(m, "pagoda_preemptions_total", kv_pool="prefill-kv", kv_format="bf16") == 1
    assert metric_sum(m, "pagoda_preemptions_total") == 8


def test_step_budget_figures() -> None:
    b = BudgetStats(budgeted_steps=4, planned_s=0.3, target_s=0.4, floor_steps=1, last_target_s=0.1)
    b.timed_steps.update(prefill=5, decode=9)
    b.predicted_s.update(prefill=0.5, decode=0.2)
    b.actual_s.update(prefill=0.6, decode=0.25)
    m = render(EngineSnapshot(pools=POOLS, step_budget=b.as_dict()))
    assert metric_sum(m, "pagoda_step_timed_total", phase="decode") == 9
    assert metric_sum(m, "pagoda_step_predicted_seconds_total", phase="prefill") == 0.5
    assert metric_sum(m, "pagoda_step_actual_seconds_total", phase="decode") == 0.25
    assert metric_sum(m, "pagoda_step_budgeted_total") == 4
    assert metric_sum(m, "pagoda_step_budget_floor_total") == 1
    assert abs(metric_sum(m, "pagoda_step_budget_utilisation", pool="both") - 0.75) < 1e-9
    assert metric_sum(m, "pagoda_itl_target_seconds") == 0.1


def test_no_budget_no_budget_series() -> None:
    m = render(EngineSnapshot(pools=POOLS))
    assert not any(k.startswith("pagoda_step_") for k in m)
    assert metric_sum(m, "pagoda_preemptions_total") == 0
