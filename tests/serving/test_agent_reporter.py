"""The agent reporter against the kmock Kubernetes emulator, with the real kopf operator reading
the reports: the pod annotation has the contract's shape and the operator aggregates it."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import pathlib
import sys

import pytest

from pagoda.agent_report import REPORT_ANNOTATION, REPORT_VERSION, AgentReport, IntegrityReport
from pagoda.node_agent.agent.reporter import AgentReporter, KubeAuth, ReporterConfig, build_report
from pagoda.node_agent.engine.state import KVPoolState
from pagoda.node_agent.serving.api.metrics import EngineSnapshot

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "operator"))

from op_cluster import MD_PATH, POD_PATH, Cluster  # noqa: E402
from op_schema import admit, example  # noqa: E402

from pagoda.operator.config import Config  # noqa: E402

pytestmark = [pytest.mark.timeout(300)]
NS = "default"
MD = MD_PATH.format(ns=NS) + "/smollm"
POD = "smollm-decode-7c9f-x2k4q"


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    kubeconfig = tmp_path / "kubeconfig"
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    running = Cluster(Config(resync_s=0.5, stale_after_s=30, report_interval_s=1), kubeconfig)
    running.start()
    try:
        yield running
    finally:
        running.stop()


def test_reporter_is_off_outside_a_deployment() -> None:
    assert ReporterConfig.from_env("decode", env={}) is None
    assert ReporterConfig.from_env("decode", env={"PAGODA_MD_NAME": "x"}) is None
    cfg = ReporterConfig.from_env(
        "both",
        env={
            "PAGODA_MD_NAME": "smollm",
            "PAGODA_POD_NAME": "p",
            "PAGODA_MD_NAMESPACE": "ns",
            "PAGODA_POOL": "decode",
            "PAGODA_REPORT_INTERVAL_S": "3",
        },
    )
    assert (cfg.pool, cfg.interval_s, cfg.path) == (
        "decode",
        3.0,
        "/api/v1/namespaces/ns/pods/p",  # its own pod: the report is an annotation there
    )


def test_report_carries_every_engine_counter_and_parses_back() -> None:
    counters = {
        "checks": 9,
        "pages_checked": 90,
        "mismatches": 1,
        "requests_aborted": 1,
        "pages_audited": 40,
        "checksum_mismatches": 2,
    }
    snap = EngineSnapshot(
        ready=True,
        pools=[KVPoolState("decode", num_pages=8, num_used=2, page_size=16, capacity_tokens=128)],
        running=2,
        waiting=1,
        integrity_mode="audit",
        integrity=counters,
        weight_bytes=1000,
        formats={
            "prefill_weights": "fp8",
            "prefill_kv": "bf16",
            "decode_weights": "int4",
            "decode_kv": "fp8_e4m3",
        },
        model="builtin://smollm2-135m",
    )
    cfg = ReporterConfig("smollm", "default", POD, "decode", "node-a")
    when = dt.datetime(2026, 11, 29, 12, 0, 0, 250_000, tzinfo=dt.UTC)
    wire = json.loads(json.dumps(build_report(cfg, snap, 12.34567, when).to_status()))
    assert wire["integrity"]["pagesAudited"] == 40 and wire["integrity"]["checksumMismatches"] == 2
    assert wire["lastReportTime"] == "2026-11-29T12:00:00Z" and wire["tokensPerSecond"] == 12.346
    report = AgentReport.from_status(wire)
    assert report.integrity == IntegrityReport.from_counters("audit", counters)
    assert (report.kv_capacity_tokens, report.kv_used_tokens) == (128, 32)
    assert (report.running_requests, report.waiting_requests) == (2, 1)
    assert report.formats.decode_weights == "int4" and report.model == "builtin://smollm2-135m"
    assert report.version == REPORT_VERSION and report.ready is True


def test_reporter_annotates_its_pod_and_the_operator_aggregates_it(cluster, stack) -> None:
    stored = admit(example(prefill={"gpus": 0}, decode={"gpus": 0}))
    stored["metadata"].update(
        uid="uid-1", generation=1, resourceVersion="1", creationTimestamp="2026-11-29T12:00:00Z"
    )
    cluster.create(MD_PATH.format(ns=NS), stored)
    labels = {"pagoda.dev/model-deployment": "smollm", "pagoda.dev/pool": "decode"}
    cluster.create(POD_PATH.format(ns=NS), {"metadata": {"name": POD, "namespace": NS, "labels": labels}})
    cfg = ReporterConfig.from_env(
        "decode",
        interval=0.3,
        env={
            "PAGODA_MD_NAME": "smollm",
            "PAGODA_MD_NAMESPACE": NS,
            "PAGODA_POD_NAME": POD,
            "PAGODA_POOL": "decode",
            "PAGODA_NODE_NAME": "node-a",
            "PAGODA_REPORT_HEARTBEAT_S": "0.3",  # write each interval though an idle engine's figures stay
        },
    )
    snap = stack.aengine.snapshot  # a live engine's figures

    async def run() -> AgentReporter:
        rep = AgentReporter(cfg, snap, KubeAuth.from_kubeconfig(str(cluster.kubeconfig)))
        await rep.start()
        await asyncio.sleep(1.5)
        await rep.stop()
        return rep

    rep = asyncio.run(run())
    assert rep.sent >= 2 and rep.failures == 0
    annotations = cluster.get(f"{POD_PATH.format(ns=NS)}/{POD}")["metadata"]["annotations"]
    report = json.loads(annotations[REPORT_ANNOTATION])
    assert set(report) >= {
        "pool",
        "node",
        "ready",
        "formats",
        "weightBytes",
        "kvCapacityTokens",
        "kvUsedTokens",
        "tokensPerSecond",
        "runningRequests",
        "waitingRequests",
        "integrity",
        "lastReportTime",
    }
    s = snap()
    assert report["pool"] == "decode" and report["node"] == "node-a" and report["ready"] is True
    assert report["kvCapacityTokens"] == s.kv_capacity_tokens > 0
    assert report["weightBytes"] == s.weight_bytes > 0
    assert report["formats"] == {
        "prefillWeights": "bf16",
        "prefillKv": "bf16",
        "decodeWeights": "bf16",
        "decodeKv": "bf16",
    }
    assert set(report["integrity"]) == {
        "mode",
        "checks",
        "pagesChecked",
        "mismatches",
        "requestsAborted",
        "pagesAudited",
        "checksumMismatches",
    }
    assert report["integrity"]["mode"] == "enforce"
    parsed = AgentReport.from_status(report)
    assert parsed.version == REPORT_VERSION and parsed.model == s.model
    assert parsed.to_status() == report and "stale" not in report  # stale is the operator's mark
    assert report["lastReportTime"].endswith("Z")
    decode = cluster.wait_for(
        lambda: (
            (m := cluster.get(MD))
            and (d := m["status"].get("decode") or {}).get("reportingAgents") == 1
            and d
        ),
        what="the operator's aggregation of the report",
    )
    assert decode["kvCapacityTokens"] == s.kv_capacity_tokens
