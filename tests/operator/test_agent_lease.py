"""Agent liveness from Lease objects: the operator reads each agent's ``renewTime`` (and falls
back to the pod report's own time where an agent has no Lease)."""

from __future__ import annotations

import asyncio
import datetime as dt

from test_api_load import NS, _cluster

from pagoda.agent_lease import lease_body, renew_times
from pagoda.agent_report import AgentReport
from pagoda.operator.config import Config
from pagoda.operator.reconcile import reconcile
from pagoda.operator.status import alive_at, split

NOW = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)


def test_a_renewed_lease_keeps_an_agent_with_an_old_report_fresh() -> None:
    old = NOW - dt.timedelta(minutes=4)  # an idle agent writes its pod only once a heartbeat
    kube = _cluster(old)
    for key, pod in list(kube.objects.items()):
        if key[0] == "Pod" and pod["metadata"]["labels"]["pagoda.dev/pool"] == "decode":
            name = pod["metadata"]["name"]
            kube.put(lease_body(name, NS, "smollm", "decode", "uid-pod", 30, NOW - dt.timedelta(seconds=5)))
    md = kube.objects[("ModelDeployment", NS, "smollm")]
    asyncio.run(reconcile(kube, md, Config(), now=NOW, windows={}))
    status = kube.objects[("ModelDeployment", NS, "smollm")]["status"]
    assert (status["decode"]["reportingAgents"], status["decode"]["staleAgents"]) == (50, 0)
    assert status["prefill"]["staleAgents"] == 50  # no Lease: the 4-minute-old report counts
    lease = kube.objects[("Lease", NS, "smollm-decode-1")]
    assert lease["metadata"]["ownerReferences"][0] == {
        "apiVersion": "v1",
        "kind": "Pod",
        "name": "smollm-decode-1",
        "uid": "uid-pod",
    }


def test_the_later_of_report_and_lease_counts_and_never_the_future() -> None:
    report = AgentReport(pool="decode", ready=True, last_report_time=NOW - dt.timedelta(seconds=90))
    leases = [
        lease_body("a", NS, "md", "decode", "", 30, NOW - dt.timedelta(seconds=10)),
        lease_body("b", NS, "md", "decode", "", 30, NOW - dt.timedelta(minutes=5)),  # older than the report
        lease_body("c", NS, "md", "decode", "", 30, NOW + dt.timedelta(hours=1)),  # a skewed clock
        {"metadata": {"name": "d"}, "spec": {"renewTime": "not a time"}},
    ]
    assert "ownerReferences" not in leases[0]["metadata"]  # no pod uid known: no owner claimed
    renewed = renew_times(leases)
    assert set(renewed) == {"a", "b", "c"}
    reports = alive_at({p: report for p in "abcde"}, renewed, NOW)
    assert reports["a"].last_report_time == NOW - dt.timedelta(seconds=10)
    assert reports["b"].last_report_time == report.last_report_time
    assert reports["c"].last_report_time == NOW
    agents = split(reports, NOW, 60.0)
    assert sorted(agents.fresh) == ["a", "c"] and sorted(agents.stale) == ["b", "d", "e"]
    no_time = AgentReport(version=0, pool="decode")  # a pod without a readable report stays stale
    assert alive_at({"a": no_time}, renewed, NOW)["a"].last_report_time is None


def test_an_agent_renews_its_lease_on_the_emulator_and_the_operator_reads_it(cluster) -> None:
    """The reporter against the API emulator: it writes its pod's report, then creates and renews
    its Lease (owned by the pod); the operator's status counts it as a fresh agent."""
    from op_cluster import MD_PATH, POD_PATH
    from op_schema import admit, example

    from pagoda.node_agent.agent.reporter import AgentReporter, KubeAuth, ReporterConfig
    from pagoda.node_agent.serving.api.metrics import EngineSnapshot

    stored = admit(example(prefill={"gpus": 0}, decode={"gpus": 0}))
    stored["metadata"].update(uid="uid-1", generation=1, creationTimestamp="2026-11-29T12:00:00Z")
    cluster.create(MD_PATH.format(ns=NS), stored)
    labels = {"pagoda.dev/model-deployment": "smollm", "pagoda.dev/pool": "decode"}
    pod = cluster.create(
        POD_PATH.format(ns=NS), {"metadata": {"name": "d-0", "namespace": NS, "labels": labels}}
    )
    env = {"PAGODA_MD_NAME": "smollm", "PAGODA_MD_NAMESPACE": NS, "PAGODA_POD_NAME": "d-0"}
    cfg = ReporterConfig.from_env("decode", interval=0.2, env=env)
    assert cfg is not None

    async def run() -> AgentReporter:
        rep = AgentReporter(
            cfg, lambda: EngineSnapshot(ready=True), KubeAuth.from_kubeconfig(str(cluster.kubeconfig))
        )
        await rep.start()
        await asyncio.sleep(1.5)
        await rep.stop()
        return rep

    rep = asyncio.run(run())
    assert rep.failures == 0 and rep.sent == 1  # idle: one report, then only the Lease
    assert rep.lease_ok and rep.lease_writes >= 2  # created, then renewed
    lease = cluster.get(f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases/d-0")
    assert lease["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Pod", "name": "d-0", "uid": pod["metadata"]["uid"]}
    ]
    assert lease["metadata"]["labels"]["pagoda.dev/model-deployment"] == "smollm"
    assert lease["spec"]["holderIdentity"] == "d-0" and lease["spec"]["renewTime"].endswith("Z")
    md = f"{MD_PATH.format(ns=NS)}/smollm"
    cluster.wait_for(
        lambda: ((cluster.get(md) or {}).get("status") or {}).get("decode", {}).get("reportingAgents") == 1,
        what="the agent counted fresh",
    )
