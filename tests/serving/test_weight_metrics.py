"""Weight bytes by part and by format: on a live server's /metrics, not in its agent report."""

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


def test_the_agent_report_leaves_the_breakdown_to_prometheus() -> None:
    """The split by part and format is on /metrics; the pod's report keeps only the total."""
    breakdown = {
        "total": 90,
        "embeddings": 40,
        "attention": 20,
        "mlp": 30,
        "by_format": {"bf16": 90},
        "by_phase": {"prefill": {"bf16": 50}, "decode": {"bf16": 20, "experts int4": 30}},
    }
    snap = EngineSnapshot(ready=True, weight_bytes=90, weight_breakdown=breakdown)
    cfg = ReporterConfig("smollm", "default", "pod-0", "decode", "node-a")
    wire = json.loads(json.dumps(build_report(cfg, snap, 1.0, dt.datetime.now(dt.UTC)).to_status()))
    assert "weights" not in wire and wire["weightBytes"] == 90
    report = AgentReport.from_status(wire)  # as the operator reads it: zeros, as from an older agent
    assert report.weight_bytes == 90 and not any(report.weights.parts.values())
    m = parse_metrics(ServeMetrics("decode", lambda: snap).render().decode())
    assert metric_sum(m, "pagoda_weight_part_bytes", part="mlp") == 30
    assert metric_sum(m, "pagoda_weight_format_bytes", format="bf16") == 90
    assert metric_sum(m, "pagoda_weight_phase_format_bytes", phase="decode", format="experts int4") == 30
    assert metric_sum(m, "pagoda_weight_phase_format_bytes", phase="prefill") == 50


def test_no_breakdown_before_the_engine_reports() -> None:
    """A snapshot taken before the engine loaded (no breakdown) exports no part/format samples."""
    m = parse_metrics(ServeMetrics("decode", EngineSnapshot).render().decode())
    assert not [
        k
        for k in m
        if k.startswith(("pagoda_weight_part_bytes", "pagoda_weight_format_bytes", "pagoda_weight_phase"))
    ]
    assert metric_sum(m, "pagoda_weight_bytes") == 0
