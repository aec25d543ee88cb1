"""Bounded status, apply errors as conditions and quiet resyncs: reconcile passes over an in-memory
API (2,048 pods need no emulator)."""

from __future__ import annotations

import asyncio
import datetime as dt
import json

import pytest
from fake_kube import FakeKube
from op_schema import admit, example

from pagoda.agent_report import REPORT_ANNOTATION, AgentReport, IntegrityReport, to_annotation
from pagoda.operator import crd as crd_mod
from pagoda.operator.config import Config
from pagoda.operator.reconcile import reconcile
from pagoda.operator.status import Agents, worst

NOW = dt.datetime(2026, 11, 29, 12, 0, 0, tzinfo=dt.UTC)
CFG = Config(stale_after_s=60)
NS = "default"


def md(**spec: object) -> dict:
    body = admit(example("smollm", **spec))
    body["metadata"].update(uid="uid-md", generation=1)
    return body


def pod(name: str, pool: str, report: AgentReport | None) -> dict:
    meta: dict = {
        "name": name,
        "namespace": NS,
        "labels": {"pagoda.dev/model-deployment": "smollm", "pagoda.dev/pool": pool},
    }
    if report is not None:
        meta["annotations"] = {REPORT_ANNOTATION: to_annotation(report)}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta}


def report(
    pool: str, *, age_s: float = 1, used: int = 100, mismatches: int = 0, waiting: int = 0
) -> AgentReport:
    return AgentReport(
        pool=pool,
        node="node-with-a-long-name-0123456789",
        ready=True,
        model="hf-dir:///mnt/models/some/very/long/model/path/Kimi-K2-Instruct",
        kv_capacity_tokens=1_000_000,
        kv_used_tokens=used,
        tokens_per_second=1234.567,
        waiting_requests=waiting,
        integrity=IntegrityReport("enforce", checks=10**9, pages_checked=10**10, mismatches=mismatches),
        last_report_time=NOW - dt.timedelta(seconds=age_s),
    )


def run(kube: FakeKube, body: dict, cfg: Config = CFG, **kw: object):
    return asyncio.run(reconcile(kube, body, cfg, now=NOW, **kw))  # type: ignore[arg-type]


def stored_md(kube: FakeKube) -> dict:
    return kube.objects[("ModelDeployment", NS, "smollm")]


def test_status_stays_under_64_kib_with_2048_agents() -> None:
    kube = FakeKube()
    body = kube.put(md(prefill={"gpus": 0, "replicas": 1024}, decode={"gpus": 0, "replicas": 1024}))
    for i in range(2048):
        pool = "prefill" if i % 2 else "decode"
        age = 600 if i % 97 == 0 else 1  # some stale
        kube.put(
            pod(
                f"smollm-{pool}-6d5f8c7b9-{i:05d}",
                pool,
                report(pool, age_s=age, used=i, mismatches=i % 13 == 0),
            )
        )
    windows: dict = {}
    out = run(kube, body, windows=windows)
    status = stored_md(kube)["status"]
    size = len(json.dumps(status, separators=(",", ":")).encode())
    assert size < 64 * 1024, size
    assert status["agentsTotal"] == 2048 and len(status["agents"]) == 16
    assert status["decode"]["reportingAgents"] + status["decode"]["staleAgents"] == 1024
    assert status["integrityWindow"]["agents"] == len(windows[(NS, "smollm")]["counters"]) > 2000
    stale = [p for p, r in status["agents"].items() if r["stale"]]
    assert len(stale) == 16  # 22 stale agents: the 16 oldest/first shown
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "StaleAgents" and "and 12 more" in degraded["message"]
    assert out.status_patch is not None

    # A second pass with the same reports (and the baselines in memory) stays as small.
    kube.objects[("ModelDeployment", NS, "smollm")]["metadata"]["generation"] = 1
    run(kube, stored_md(kube), windows=windows)
    assert len(json.dumps(stored_md(kube)["status"]).encode()) < 64 * 1024


def test_worst_agents_come_first_stale_then_mismatching_then_loaded() -> None:
    agents = Agents(
        fresh={
            "idle": report("decode", used=1),
            "busy": report("decode", used=900_000),
            "bad": report("decode", mismatches=3),
            "queued": report("decode", used=1, waiting=9),
        },
        stale={"old": report("decode", age_s=900), "older": report("decode", age_s=1800)},
    )
    assert worst(agents, 10) == ["older", "old", "bad", "busy", "queued", "idle"]
    assert worst(agents, 3) == ["older", "old", "bad"] and worst(agents, 0) == []


def test_an_engine_pod_that_never_reports_turns_stale() -> None:
    """An agent that cannot write its report (RBAC, admission policy) is not invisible."""
    kube = FakeKube()
    body = kube.put(md(prefill={"gpus": 0}, decode={"gpus": 0}))
    old = (NOW - dt.timedelta(seconds=300)).strftime("%Y-%m-%dT%H:%M:%SZ")
    young = (NOW - dt.timedelta(seconds=10)).strftime("%Y-%m-%dT%H:%M:%SZ")
    for name, pool, created in (
        ("d-mute", "decode", old),
        ("d-new", "decode", young),
        ("r-0", "router", old),
    ):
        p = pod(name, pool, None)
        p["metadata"]["creationTimestamp"] = created
        kube.put(p)
    run(kube, body)
    status = stored_md(kube)["status"]
    assert set(status["agents"]) == {"d-mute"} and status["agents"]["d-mute"]["stale"] is True
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "StaleAgents" and "d-mute" in degraded["message"]


def test_agents_of_gone_pods_leave_the_status() -> None:
    kube = FakeKube()
    body = kube.put(md(prefill={"gpus": 0}, decode={"gpus": 0}))
    kube.put(pod("d-0", "decode", report("decode")))
    kube.put(pod("d-1", "decode", report("decode")))
    kube.put(pod("d-2", "decode", None))  # starting: no report yet
    run(kube, body)
    assert set(stored_md(kube)["status"]["agents"]) == {"d-0", "d-1"}
    del kube.objects[("Pod", NS, "d-1")]
    run(kube, stored_md(kube))
    assert set(stored_md(kube)["status"]["agents"]) == {"d-0"}
    assert stored_md(kube)["status"]["agentsTotal"] == 1


def test_a_refused_child_surfaces_as_a_condition_with_the_api_servers_message() -> None:
    kube = FakeKube()
    body = kube.put(md(prefill={"gpus": 0}, decode={"gpus": 0}))
    message = 'poddisruptionbudgets.policy "smollm-decode" is forbidden: exceeded quota: objects'
    kube.refuse[("PodDisruptionBudget", "create")] = (
        403,
        {"kind": "Status", "message": message, "code": 403},
    )
    out = run(kube, body)
    assert out.apply_errors == [
        f"PodDisruptionBudget/smollm-prefill: {message}",
        f"PodDisruptionBudget/smollm-decode: {message}",
        f"PodDisruptionBudget/smollm-router: {message}",
    ]
    conds = {c["type"]: c for c in stored_md(kube)["status"]["conditions"]}
    assert conds["Degraded"]["status"] == "True" and conds["Degraded"]["reason"] == "ApplyFailed"
    assert message in conds["Degraded"]["message"]
    assert conds["Ready"]["status"] == "False" and conds["Ready"]["reason"] == "ApplyFailed"
    assert ("Deployment", NS, "smollm-decode") in kube.objects  # the other children were applied

    del kube.refuse[("PodDisruptionBudget", "create")]
    run(kube, stored_md(kube))
    conds = {c["type"]: c for c in stored_md(kube)["status"]["conditions"]}
    assert conds["Degraded"]["reason"] != "ApplyFailed"


def test_an_unchanged_resync_posts_no_event_and_writes_nothing() -> None:
    kube = FakeKube()
    body = kube.put(md(prefill={"gpus": 0}, decode={"gpus": 0}))
    kube.put(pod("d-0", "decode", report("decode")))
    events: list = []
    windows: dict = {}
    run(kube, body, emit=lambda *e: events.append(e), windows=windows)
    assert events  # the first pass created the children
    events.clear()
    writes = len(kube.writes)
    for _ in range(3):
        run(kube, stored_md(kube), emit=lambda *e: events.append(e), windows=windows)
    assert events == [] and len(kube.writes) == writes


def test_the_crd_is_server_side_applied_and_a_refusal_is_reported() -> None:
    kube = FakeKube()
    assert asyncio.run(crd_mod.install(kube)) is None  # type: ignore[arg-type]
    verb, kind, url = kube.writes[-1]
    assert (verb, kind) == ("apply", "CustomResourceDefinition")
    assert url == (
        "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/modeldeployments.pagoda.dev"
        "?fieldManager=pagoda-operator&force=true"
    )
    kube.refuse[("CustomResourceDefinition", "apply")] = (
        403,
        {"message": "customresourcedefinitions is forbidden"},
    )
    why = asyncio.run(crd_mod.install(kube))  # type: ignore[arg-type]
    assert why is not None and "customresourcedefinitions is forbidden" in why


@pytest.mark.parametrize("limit", [0, 3])
def test_the_number_of_agents_shown_is_configurable(limit: int) -> None:
    kube = FakeKube()
    body = kube.put(md(prefill={"gpus": 0}, decode={"gpus": 0}))
    for i in range(5):
        kube.put(pod(f"d-{i}", "decode", report("decode")))
    run(kube, body, Config(status_max_agents=limit))
    assert len(stored_md(kube)["status"]["agents"]) == limit
