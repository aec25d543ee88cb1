"""EngineCollector exports every counter of the engine snapshot (no server, no engine)."""

from __future__ import annotations

import dataclasses

from pagoda.agent_report import INTEGRITY_COUNTERS
from pagoda.node_agent.engine.integrity import IntegrityCounters
from pagoda.node_agent.engine.state import KVPoolState
from pagoda.node_agent.serving.api.metrics import (
    EngineSnapshot,
    ServeMetrics,
    metric_sum,
    parse_metrics,
)

# every counter the engine keeps, each with its own value
COUNTERS = dataclasses.asdict(
    IntegrityCounters(**{f.name: 10 + i for i, f in enumerate(dataclasses.fields(IntegrityCounters))})
)


def test_the_report_and_metrics_cover_every_engine_counter() -> None:
    assert set(INTEGRITY_COUNTERS) == set(COUNTERS)
    assert {"pages_audited", "checksum_mismatches"} <= set(COUNTERS)


def test_every_integrity_counter_is_on_metrics() -> None:
    snap = EngineSnapshot(
        ready=True,
        pools=[KVPoolState("decode", num_pages=10, num_used=3, page_size=16, capacity_tokens=160)],
        integrity_mode="audit",
        integrity=dict(COUNTERS),
    )
    m = parse_metrics(ServeMetrics("decode", lambda: snap).render().decode())
    for name, value in COUNTERS.items():
        assert metric_sum(m, f"pagoda_integrity_{name}_total", pool="decode") == value, name
    assert metric_sum(m, "pagoda_integrity_pages_audited_total", pool="decode") == COUNTERS["pages_audited"]
    assert metric_sum(m, "pagoda_integrity_checksum_mismatches_total") == COUNTERS["checksum_mismatches"]
    assert metric_sum(m, "pagoda_kv_used_tokens", pool="decode", kv_pool="decode") == 48


def test_counters_read_zero_before_the_engine_counts() -> None:
    m = parse_metrics(ServeMetrics("prefill", EngineSnapshot).render().decode())
    for name in COUNTERS:
        assert f'pagoda_integrity_{name}_total{{pool="prefill"}}' in m
        assert metric_sum(m, f"pagoda_integrity_{name}_total") == 0
