"""Signals read as each controller gives them: LeaderWorkerSet rollout progress with and without
``observedGeneration``, the installed LeaderWorkerSet's version, and the KV mismatch rate, which
turns unknown after a whole window without checks."""

from __future__ import annotations

import asyncio
import datetime as dt

import pytest
from fake_kube import FakeKube
from op_schema import admit, example

from pagoda.agent_report import REPORT_ANNOTATION, AgentReport, IntegrityReport, PhaseFormats, to_annotation
from pagoda.operator import children, lws_support, rollout
from pagoda.operator.config import Config
from pagoda.operator.reconcile import reconcile
from pagoda.operator.spec import parse

NOW = dt.datetime(2026, 11, 29, 12, 0, 0, tzinfo=dt.UTC)
NS = "default"
MULTI = {"gpus": 0, "tensorParallel": 2, "nodesPerReplica": 2}


def lws(status: dict, generation: int | None = 2) -> dict:
    meta = {"name": "m-decode"} | ({"generation": generation} if generation is not None else {})
    return {"kind": "LeaderWorkerSet", "metadata": meta, "spec": {"replicas": 1}, "status": status}


def conds(**types: str) -> list[dict]:
    return [{"type": t, "status": s} for t, s in types.items()]


COUNTS = {"replicas": 1, "updatedReplicas": 1, "readyReplicas": 1}


@pytest.mark.parametrize(
    ("status", "current"),
    [
        ({**COUNTS, "observedGeneration": 2}, True),  # a release with observedGeneration
        ({**COUNTS, "observedGeneration": 1}, False),  # ... that has not seen the change yet
        (
            {**COUNTS, "conditions": conds(Available="True", Progressing="False", UpdateInProgress="False")},
            True,
        ),
        ({**COUNTS, "conditions": conds(Available="True", UpdateInProgress="True")}, False),  # rolling
        ({**COUNTS, "readyReplicas": 0, "conditions": conds(Available="False", Progressing="True")}, False),
        ({**COUNTS, "conditions": conds(Available="True", Progressing="True")}, True),  # scaling up
        ({"replicas": 2, "updatedReplicas": 1, "readyReplicas": 2}, False),  # an old group left
        (COUNTS, True),  # no conditions yet, the counts agree
    ],
)
def test_leader_worker_set_progress_with_or_without_observed_generation(status: dict, current: bool) -> None:
    assert rollout.only_current_pods(lws(status)) is current


def test_a_deployment_without_observed_generation_is_not_current() -> None:
    dep = {"kind": "Deployment", "metadata": {"generation": 2}, "status": COUNTS}
    assert not rollout.only_current_pods(dep)  # the Deployment controller always sets it


def openapi(max_surge: bool) -> dict:
    rolling = {"properties": {"maxUnavailable": {}} | ({"maxSurge": {}} if max_surge else {})}
    schema = {
        "x-kubernetes-group-version-kind": [
            {"group": "leaderworkerset.x-k8s.io", "version": "v1", "kind": "LeaderWorkerSet"}
        ],
        "properties": {
            "spec": {
                "properties": {"rolloutStrategy": {"properties": {"rollingUpdateConfiguration": rolling}}}
            }
        },
    }
    return {"components": {"schemas": {"io.x-k8s.leaderworkerset.v1.LeaderWorkerSet": schema}}}


def test_the_leader_worker_set_schema_says_whether_it_is_recent_enough() -> None:
    assert lws_support.problem(openapi(max_surge=True)) is None
    why = lws_support.problem(openapi(max_surge=False))
    assert why is not None and lws_support.MIN_VERSION in why and "maxSurge" in why
    assert lws_support.problem({"components": {"schemas": {}}}) is None  # nothing to judge by
    assert lws_support.problem(None) is None


def md(**spec: object) -> dict:
    body = admit(example("smollm", **spec))
    body["metadata"].update(uid="uid-md", generation=1)
    return body


def stored(kube: FakeKube) -> dict:
    return kube.objects[("ModelDeployment", NS, "smollm")]


def condition(body: dict, kind: str) -> dict:
    return next(c for c in body["status"]["conditions"] if c["type"] == kind)


def test_a_too_old_leader_worker_set_blocks_multi_node_pools_with_a_clear_condition() -> None:
    kube = FakeKube()
    kube.documents[lws_support.OPENAPI_PATH] = openapi(max_surge=False)
    kube.put({"kind": "ModelDeployment", **md(prefill={"gpus": 0}, decode=MULTI)})
    checked: dict = {}
    asyncio.run(reconcile(kube, stored(kube), Config(), now=NOW, lws_checked=checked))  # type: ignore[arg-type]
    degraded = condition(stored(kube), "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "LeaderWorkerSetTooOld")
    assert "LeaderWorkerSet v0.3.0 or newer" in degraded["message"]
    assert condition(stored(kube), "Progressing")["reason"] == "Blocked"
    assert not any(k[0] in ("LeaderWorkerSet", "Deployment") for k in kube.objects)  # nothing applied
    assert checked == {lws_support.CHECKED: degraded["message"]}  # read once per operator run

    kube.documents[lws_support.OPENAPI_PATH] = openapi(max_surge=True)  # upgraded: the next run sees it
    asyncio.run(reconcile(kube, stored(kube), Config(), now=NOW, lws_checked={}))  # type: ignore[arg-type]
    assert condition(stored(kube), "Degraded")["reason"] != "LeaderWorkerSetTooOld"
    assert ("LeaderWorkerSet", NS, "smollm-decode") in kube.objects


def agent_pod(name: str, checks: int, mismatches: int, at: dt.datetime) -> dict:
    report = AgentReport(
        pool="decode",
        ready=True,
        integrity=IntegrityReport("enforce", checks=checks, mismatches=mismatches),
        last_report_time=at,
    )
    return reporting_pod(name, report, {"pagoda.dev/model-deployment": "smollm", "pagoda.dev/pool": "decode"})


def reporting_pod(name: str, report: AgentReport, labels: dict[str, str]) -> dict:
    """A Pod named ``name`` with ``labels`` whose agent-report annotation holds ``report``."""
    meta = {
        "name": name,
        "namespace": NS,
        "labels": labels,
        "annotations": {REPORT_ANNOTATION: to_annotation(report)},
    }
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta}


def test_the_mismatch_rate_decays_to_unknown_after_a_window_without_checks() -> None:
    kube = FakeKube()
    kube.put({"kind": "ModelDeployment", **md(integrity={"windowSeconds": 300})})
    windows: dict = {}

    def run(at: dt.datetime) -> dict:
        asyncio.run(reconcile(kube, stored(kube), Config(), now=at, windows=windows))  # type: ignore[arg-type]
        return stored(kube)

    kube.put(agent_pod("d-0", checks=1000, mismatches=10, at=NOW))  # a burst
    body = run(NOW)
    assert condition(body, "KVIntegrityDegraded")["status"] == "True"
    assert body["status"]["decode"]["mismatchRate"] == 0.01
    del kube.objects[("Pod", NS, "d-0")]  # the pod goes away; no other checks

    body = run(NOW + dt.timedelta(seconds=200))  # within the window: the rate stands
    assert condition(body, "KVIntegrityDegraded")["status"] == "True"
    body = run(NOW + dt.timedelta(seconds=301))  # a whole window without checks: unknown
    integrity = condition(body, "KVIntegrityDegraded")
    assert (integrity["status"], integrity["reason"]) == ("Unknown", "NoRecentChecks")
    assert "decode" in integrity["message"] and "300s" in integrity["message"]
    assert "mismatchRate" not in body["status"]["decode"] and "mismatchRate" not in body["status"]
    assert body["status"]["prefill"]["mismatchRate"] == 0.0  # a pool that never checked keeps its 0

    restarted: dict = {}  # an operator restart keeps it unknown (the status says so)
    asyncio.run(
        reconcile(kube, stored(kube), Config(), now=NOW + dt.timedelta(seconds=320), windows=restarted)
    )  # type: ignore[arg-type]
    assert condition(stored(kube), "KVIntegrityDegraded")["status"] == "Unknown"

    later = NOW + dt.timedelta(seconds=330)
    kube.put(agent_pod("d-1", checks=5000, mismatches=0, at=later))  # traffic is back, clean
    body = run(later)
    assert condition(body, "KVIntegrityDegraded")["reason"] == "WithinThreshold"
    assert body["status"]["decode"]["mismatchRate"] == 0.0


def _run_controller(kube: FakeKube, kind: str, name: str, observed: bool) -> None:
    """Play the workload's controller: generation 1, one ready replica; LeaderWorkerSet with its
    conditions, and observedGeneration only when ``observed`` (a Deployment always has it)."""
    obj = kube.objects[(kind, NS, name)]
    obj["metadata"]["generation"] = 1
    status: dict = dict(COUNTS)
    if kind == "LeaderWorkerSet":
        status["conditions"] = conds(Available="True", Progressing="False", UpdateInProgress="False")
    if observed or kind != "LeaderWorkerSet":
        status["observedGeneration"] = 1
    obj["status"] = status


@pytest.mark.parametrize(
    "observed", [True, False], ids=["with-observedGeneration", "without-observedGeneration"]
)
def test_a_multi_node_format_change_completes_over_passes(observed: bool) -> None:
    from fake_kube import merge_patch

    kube = FakeKube()
    kube.put({"kind": "ModelDeployment", **md(prefill={"gpus": 0}, decode=MULTI)})
    cfg = Config(shift_settle_s=0.5)

    def run(t: int):  # noqa: ANN202
        return asyncio.run(reconcile(kube, stored(kube), cfg, now=NOW + dt.timedelta(seconds=t)))  # type: ignore[arg-type]

    run(0)
    for kind, name in [
        ("LeaderWorkerSet", "smollm-decode"),
        ("Deployment", "smollm-prefill"),
        ("Deployment", "smollm-router"),
    ]:
        _run_controller(kube, kind, name, observed)
    assert run(1).stage is None and condition(stored(kube), "Progressing")["reason"] == "RolloutComplete"
    body = stored(kube)
    body["spec"] = merge_patch(body["spec"], {"prefill": {"kvCacheFormat": "int8"}})
    body["metadata"]["generation"] = 2
    assert run(2).stage == "StartNewPair"
    _run_controller(kube, "LeaderWorkerSet", "smollm-decode-green", observed)
    _run_controller(kube, "Deployment", "smollm-prefill-green", observed)
    stages = [run(t).stage for t in range(3, 8)]
    assert stages[:3] == ["ShiftTraffic", "ShiftTraffic", "RemoveOldPair"] and stages[3:] == [None, None]
    assert ("LeaderWorkerSet", NS, "smollm-decode") not in kube.objects
    assert condition(stored(kube), "Progressing")["reason"] == "RolloutComplete"


def engine_pod(name: str, pool: str, generation: str, weights: str) -> dict:
    """An engine pod of format generation ``generation`` whose agent reports running ``weights`` for
    its phase (what the engine resolved ``auto`` to)."""
    formats = PhaseFormats(**{f"{pool}_weights": weights})
    report = AgentReport(pool=pool, ready=True, formats=formats, last_report_time=NOW)
    labels = {
        "pagoda.dev/model-deployment": "smollm",
        "pagoda.dev/pool": pool,
        "pagoda.dev/formats": generation,
    }
    return reporting_pod(name, report, labels)


def test_the_pool_status_shows_auto_weights_as_the_agents_resolved_them() -> None:
    kube = FakeKube()
    kube.put({"kind": "ModelDeployment", **md()})  # weightFormat auto in both pools
    generation = children.formats_generation(parse(stored(kube)["spec"]))

    def pools() -> tuple[str, str]:
        asyncio.run(reconcile(kube, stored(kube), Config(), now=NOW))  # type: ignore[arg-type]
        status = stored(kube)["status"]
        return status["prefill"]["formats"], status["decode"]["formats"]

    assert pools() == ("auto/bf16", "auto/int8")  # no agent has reported yet
    kube.put(engine_pod("d-old", "decode", "0123456789", "int4"))  # the other pair of a blue/green
    kube.put(engine_pod("d-bad", "decode", generation, "int3"))  # not a format: never shown
    assert pools() == ("auto/bf16", "auto/int8")
    kube.put(engine_pod("p-0", "prefill", generation, "stored"))  # a pre-quantized checkpoint
    kube.put(engine_pod("d-0", "decode", generation, "stored"))
    assert pools() == ("stored/bf16", "stored/int8")
    kube.put(engine_pod("d-1", "decode", generation, "int4"))  # agents that disagree: not resolved
    assert pools() == ("stored/bf16", "auto/int8")

    named = FakeKube()  # a named format is shown as named, whatever an agent reports
    named.put({"kind": "ModelDeployment", **md(decode={"weightFormat": "int4"})})
    gen = children.formats_generation(parse(named.objects[("ModelDeployment", NS, "smollm")]["spec"]))
    named.put(engine_pod("d-0", "decode", gen, "stored"))
    asyncio.run(reconcile(named, named.objects[("ModelDeployment", NS, "smollm")], Config(), now=NOW))  # type: ignore[arg-type]
    assert named.objects[("ModelDeployment", NS, "smollm")]["status"]["decode"]["formats"] == "int4/int8"
