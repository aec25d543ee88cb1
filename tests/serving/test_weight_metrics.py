"""Weight bytes by part and by format, from a live server's /metrics and its agent report."""

from __future__ import annotations

import datetime as dt
import json

import httpx

from pagoda.agent_report import WEIGHT_PARTS, AgentReport
from pagoda.node_agent.agent.reporter import ReporterConfig, build_report
from pagoda.node_agent.serving.api.metrics import EngineSnapshot, ServeMetrics, metric_sum, parse_metrics


def test_metrics_split_the_weight_total_by_part_and_format(stack) -> None:
    m = parse_metrics(httpx.get(stack.url + "/metrics", timeout=30).text)
    total = metric_sum(m, "pagoda_weight_bytes")
    wb = stack.engine.model.weight_bytes()
    assert total == wb["total"] > 0  # the existing series is unchanged
    for part in WEIGHT_PARTS:
        assert metric_sum(m, "pagoda_weight_part_bytes", part=part) == wb[part], part
    assert metric_sum(m, "pagoda_weight_part_bytes") == total
    assert metric_sum(m, "pagoda_weight_format_bytes") == total
    assert metric_sum(m, "pagoda_weight_format_bytes", format="bf16") == wb["by_format"]["bf16"] > 0


def test_agent_report_carries_the_breakdown(stack) -> None:
    snap = stack.aengine.snapshot()
    cfg = ReporterConfig("smollm", "default", "pod-0", "decode", "node-a")
    wire = json.loads(json.dumps(build_report(cfg, snap, 1.0, dt.datetime.now(dt.UTC)).to_status()))
    wb = stack.engine.model.weight_bytes()
    assert wire["weights"] == {**{p: wb[p] for p in WEIGHT_PARTS}, "byFormat": wb["by_format"]}
    report = AgentReport.from_status(wire)  # as the operator reads it
    assert sum(report.weights.parts.values()) == report.weight_bytes == wb["total"]
    assert sum(report.weights.by_format.values()) == wb["total"]


def test_no_breakdown_before_the_engine_reports() -> None:
    """A snapshot taken before the engine loaded (no breakdown) exports no part/format samples."""
    m = parse_metrics(ServeMetrics("decode", EngineSnapshot).render().decode())
    assert not [k for k in m if k.startswith(("pagoda_weight_part_bytes", "pagoda_weight_format_bytes"))]
    assert metric_sum(m, "pagoda_weight_bytes") == 0
