"""The typed agent report: round trip through the wire shape, and tolerance of peers' reports."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import math

import pytest

from pagoda.agent_report import (
    MAX_FORMAT_NAME,
    MAX_WEIGHT_FORMATS,
    REPORT_VERSION,
    WEIGHT_PARTS,
    AgentReport,
    IntegrityReport,
    PhaseFormats,
    WeightReport,
)

WHEN = dt.datetime(2026, 11, 29, 12, 0, 0, tzinfo=dt.UTC)

# What build_report wrote before the report was typed (docs/operator.md, "Agent contract"): no version.
OLD_WIRE = {
    "pool": "decode",
    "node": "node-a",
    "ready": True,
    "formats": {
        "prefillWeights": "fp8",
        "prefillKv": "bf16",
        "decodeWeights": "int4",
        "decodeKv": "fp8_e4m3",
    },
    "weightBytes": 123,
    "kvCapacityTokens": 100000,
    "kvUsedTokens": 512,
    "tokensPerSecond": 250.5,
    "runningRequests": 3,
    "waitingRequests": 0,
    "integrity": {
        "mode": "enforce",
        "checks": 1000,
        "pagesChecked": 50000,
        "mismatches": 2,
        "requestsAborted": 1,
    },
    "lastReportTime": "2026-11-29T12:00:00Z",
}


def full_report() -> AgentReport:
    return AgentReport(
        pool="decode",
        node="node-a",
        ready=True,
        model="builtin://smollm2-135m",
        formats=PhaseFormats("fp8", "bf16", "int4", "fp8_e4m3"),
        weight_bytes=123,
        kv_capacity_tokens=100000,
        kv_used_tokens=512,
        tokens_per_second=250.5,
        running_requests=3,
        waiting_requests=1,
        integrity=IntegrityReport("audit", 10, 400, 2, 1, 64, 3),
        last_report_time=WHEN,
    )


def test_round_trip_through_json() -> None:
    report = full_report()
    wire = json.loads(json.dumps(report.to_status()))
    assert AgentReport.from_status(wire) == report
    assert wire["version"] == REPORT_VERSION
    assert wire["lastReportTime"] == "2026-11-29T12:00:00Z"
    assert wire["integrity"] == {
        "mode": "audit",
        "checks": 10,
        "pagesChecked": 400,
        "mismatches": 2,
        "requestsAborted": 1,
        "pagesAudited": 64,
        "checksumMismatches": 3,
    }
    assert "stale" not in wire  # the operator's key; agents never send it


def test_wire_keeps_every_key_written_before_the_version_field() -> None:
    wire = full_report().to_status()
    assert set(wire) >= set(OLD_WIRE)
    assert set(wire["formats"]) == set(OLD_WIRE["formats"])
    assert set(wire["integrity"]) >= set(OLD_WIRE["integrity"])


def test_an_old_agents_report_reads_as_version_zero() -> None:
    report = AgentReport.from_status(OLD_WIRE)
    assert report.version == 0 and report.model == ""
    assert (report.pool, report.node, report.ready) == ("decode", "node-a", True)
    assert report.formats == PhaseFormats("fp8", "bf16", "int4", "fp8_e4m3")
    assert report.integrity == IntegrityReport("enforce", 1000, 50000, 2, 1, 0, 0)
    assert report.last_report_time == WHEN and report.stale is None
    assert report.tokens_per_second == 250.5 and report.kv_capacity_tokens == 100000
    resent = report.to_status()  # written again, nothing reported before is lost
    assert {k: resent[k] for k in OLD_WIRE if k != "integrity"} == {
        k: v for k, v in OLD_WIRE.items() if k != "integrity"
    }
    assert resent["integrity"] == {**OLD_WIRE["integrity"], "pagesAudited": 0, "checksumMismatches": 0}


def test_a_newer_agents_report_reads_what_is_known() -> None:
    wire = {**full_report().to_status(), "version": REPORT_VERSION + 5, "gpuTemperature": 71}
    wire["integrity"] = {**wire["integrity"], "somethingNew": 9}
    report = AgentReport.from_status(wire)
    assert report.version == REPORT_VERSION + 5
    assert report.integrity.pages_audited == 64 and report.kv_used_tokens == 512


@pytest.mark.parametrize(
    "raw",
    [None, [], "report", 7, {}, {"integrity": "lots"}, {"formats": [1, 2]}, {"version": "one"}],
)
def test_malformed_input_gives_defaults(raw: object) -> None:
    report = AgentReport.from_status(raw)
    assert report.integrity == IntegrityReport() and report.formats == PhaseFormats()
    assert report.version == 0 and report.last_report_time is None and report.ready is False


def test_malformed_fields_take_their_defaults_one_by_one() -> None:
    report = AgentReport.from_status(
        {
            "version": True,
            "pool": 3,
            "node": None,
            "ready": "yes",
            "stale": "no",
            "formats": {"prefillWeights": 8, "decodeKv": "fp8_e4m3"},
            "weightBytes": -5,
            "kvCapacityTokens": 1e3,
            "kvUsedTokens": "12",
            "tokensPerSecond": math.nan,
            "runningRequests": math.inf,
            "waitingRequests": [1],
            "integrity": {"mode": None, "checks": 4.0, "mismatches": False, "pagesAudited": {"n": 1}},
            "lastReportTime": "yesterday",
        }
    )
    assert report.version == 0 and report.pool == "" and report.node == ""
    assert report.ready is False and report.stale is None
    assert report.formats == PhaseFormats(decode_kv="fp8_e4m3")
    assert (report.weight_bytes, report.kv_capacity_tokens, report.kv_used_tokens) == (0, 1000, 0)
    assert report.tokens_per_second == 0.0
    assert (report.running_requests, report.waiting_requests) == (0, 0)
    assert report.integrity == IntegrityReport("", checks=4)
    assert report.last_report_time is None


def test_counters_from_the_engine_use_its_snake_case_names() -> None:
    counters = {
        "checks": 5,
        "pages_checked": 50,
        "mismatches": 1,
        "requests_aborted": 1,
        "pages_audited": 20,
        "checksum_mismatches": 2,
    }
    integrity = IntegrityReport.from_counters("audit", counters)
    assert integrity == IntegrityReport("audit", 5, 50, 1, 1, 20, 2)
    assert IntegrityReport.from_counters("off", {}) == IntegrityReport("off")
    formats = PhaseFormats.from_formats({"prefill_weights": "bf16", "decode_kv": "fp8_e4m3"})
    assert formats == PhaseFormats(prefill_weights="bf16", decode_kv="fp8_e4m3")


def test_weights_round_trip_and_old_reports_read_empty() -> None:
    weights = WeightReport(
        {"embeddings": 10, "attention": 20, "mlp": 30, "experts": 40, "other": 1},
        {"int4": 60, "bf16": 40, "fp32": 1},
    )
    report = dataclasses.replace(full_report(), weights=weights)
    wire = json.loads(json.dumps(report.to_status()))
    assert wire["weights"] == {
        "embeddings": 10,
        "attention": 20,
        "mlp": 30,
        "experts": 40,
        "other": 1,
        "byFormat": {"int4": 60, "bf16": 40, "fp32": 1},
    }
    assert AgentReport.from_status(wire) == report
    old = AgentReport.from_status(OLD_WIRE)  # an agent from before the field
    assert old.weights == WeightReport() and old.weights.parts == dict.fromkeys(WEIGHT_PARTS, 0)
    assert old.weight_bytes == 123


@pytest.mark.parametrize(
    "raw",
    [
        "lots",
        [1, 2],
        {"attention": -5, "mlp": "many", "experts": math.inf, "byFormat": "int4"},
        {"byFormat": {"": 5, "x" * (MAX_FORMAT_NAME + 1): 5, "int4": -1}},
        {"byFormat": {f"f{i}": i for i in range(100)}},
    ],
)
def test_malformed_weights_from_a_peer_take_defaults(raw) -> None:
    """Unknown parts are dropped, bad counts read 0 and a peer cannot send unbounded format keys."""
    report = AgentReport.from_status({**OLD_WIRE, "weights": raw, "unknownPart": 1})
    assert set(report.weights.parts) == set(WEIGHT_PARTS)
    assert all(v == 0 for v in report.weights.parts.values())
    assert len(report.weights.by_format) <= MAX_WEIGHT_FORMATS
    assert all(0 < len(k) <= MAX_FORMAT_NAME for k in report.weights.by_format)
    assert report.weight_bytes == 123


def test_the_pod_annotation_round_trips_and_bad_ones_read_as_none() -> None:
    from pagoda.agent_report import MAX_REPORT_BYTES, from_annotation, to_annotation

    report = AgentReport(pool="decode", node="n", ready=True, kv_capacity_tokens=10)
    text = to_annotation(report)
    assert " " not in text and json.loads(text) == report.to_status()
    assert from_annotation(text) == report
    for bad in (None, "", "not json", "[1, 2]", "3", 7, "{" + " " * MAX_REPORT_BYTES + "}"):
        assert from_annotation(bad) is None, bad
    assert from_annotation('{"pool": "decode", "kvCapacityTokens": "many"}').kv_capacity_tokens == 0


def test_the_quality_field_is_optional_and_reads_defensively() -> None:
    import datetime as dt

    from pagoda.agent_report import AgentReport, QualityReport

    assert "quality" not in AgentReport().to_status()  # agents that probe nothing leave it out
    assert AgentReport.from_status({"pool": "decode"}).quality is None
    when = dt.datetime(2026, 12, 2, 13, 0, tzinfo=dt.UTC)
    q = QualityReport(0.0123456789, 0.95, 0.7, 0.5, 351, 6, 4.2, 3, 1, when)
    wire = AgentReport(pool="decode", quality=q).to_status()["quality"]
    assert wire["meanKL"] == 0.012346 and wire["lastProbeTime"] == "2026-12-02T13:00:00Z"
    back = AgentReport.from_status({"quality": wire}).quality
    assert back is not None and (back.positions, back.probes, back.failures) == (351, 3, 1)
    assert back.last_probe_time == when
    bad = AgentReport.from_status(
        {"quality": {"meanKL": "x", "top1": 7, "greedyPrefix": -1, "probes": True, "lastProbeTime": 5}}
    ).quality
    assert bad == QualityReport(top1=1.0)
