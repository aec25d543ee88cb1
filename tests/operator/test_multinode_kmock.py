"""Multi-node pools with the real kopf operator against kmock: the LeaderWorkerSet, switching a
pool between a Deployment and a LeaderWorkerSet, readiness counted in whole groups, and a cluster
without the LeaderWorkerSet CRD."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import kmock
import pytest
from op_cluster import (
    DEP_PATH,
    LWS_PATH,
    LWS_RESOURCE,
    MD_PATH,
    POD_PATH,
    RESOURCES,
    SVC_PATH,
    VERBS,
    Cluster,
)
from op_schema import example
from test_operator_kmock import condition, create_md, set_ready, update_spec

from pagoda.operator.config import Config

NS = "default"
MD = MD_PATH.format(ns=NS) + "/smollm"
LWSS = LWS_PATH.format(ns=NS)
DEPS = DEP_PATH.format(ns=NS)
WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"
MULTI = {"gpus": 0, "tensorParallel": 2, "nodesPerReplica": 2}  # gloo over two CPU hosts


def lws(cluster: Cluster, name: str = "smollm-decode") -> dict | None:
    return cluster.get(f"{LWSS}/{name}")


def selector(cluster: Cluster, name: str) -> dict:
    return cluster.get(f"{SVC_PATH.format(ns=NS)}/{name}")["spec"]["selector"]


def add_group_pod(cluster: Cluster, group: int, worker: int, ready: bool) -> None:
    """A pod as the LWS controller makes it (its labels), with its readiness."""
    name = f"smollm-decode-{group}" + (f"-{worker}" if worker else "")
    labels = {
        "pagoda.dev/model-deployment": "smollm",
        "pagoda.dev/pool": "decode",
        "leaderworkerset.sigs.k8s.io/name": "smollm-decode",
        "leaderworkerset.sigs.k8s.io/group-index": str(group),
        WORKER_INDEX: str(worker),
    }
    status = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    cluster.create(
        POD_PATH.format(ns=NS),
        {"metadata": {"name": name, "namespace": NS, "labels": labels}, "status": status},
    )


def test_a_multi_node_pool_is_a_leader_worker_set_and_counts_ready_groups(cluster: Cluster) -> None:
    create_md(cluster, example(prefill={"gpus": 0}, decode={**MULTI, "replicas": 2}))
    group = cluster.wait_for(lambda: lws(cluster), what="LeaderWorkerSet")
    cluster.wait_for(lambda: cluster.get(f"{DEPS}/smollm-router"), what="router")  # applied last
    assert cluster.get(f"{DEPS}/smollm-decode") is None
    assert group["spec"]["replicas"] == 2
    template = group["spec"]["leaderWorkerTemplate"]
    assert (template["size"], template["restartPolicy"]) == (2, "RecreateGroupOnPodRestart")
    assert group["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    for svc in ("smollm-decode", "smollm-decode-pods"):
        assert selector(cluster, svc)[WORKER_INDEX] == "0"
    assert WORKER_INDEX not in selector(cluster, "smollm-prefill")

    # Group 0 whole, group 1's worker not ready: the LWS controller counts one ready replica.
    for index, worker, ready in ((0, 0, True), (0, 1, True), (1, 0, True), (1, 1, False)):
        add_group_pod(cluster, index, worker, ready)
    cluster.patch(
        f"{LWSS}/smollm-decode/status",
        {"status": {"replicas": 2, "updatedReplicas": 2, "readyReplicas": 1}},
    )
    set_ready(cluster, "prefill", 1)
    set_ready(cluster, "router", 1)
    md = cluster.wait_for(
        lambda: (
            (m := cluster.get(MD))
            and m["status"]["decode"].get("incompleteGroups") == 1
            and m["status"]["decode"]["readyReplicas"] == 1
            and condition(m, "Ready")["reason"] != "PoolsNotReady"
            and m
        ),
        what="the incomplete group",
    )
    decode = md["status"]["decode"]
    assert (decode["readyReplicas"], decode["ready"], decode["nodesPerReplica"]) == (1, "1/2", 2)
    ready = condition(md, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "GroupsIncomplete")
    assert (
        "decode 1/2 (groups of 2 pods; pods ready in incomplete groups: smollm-decode-1 1/2)"
        in (ready["message"])
    )
    assert "smollm-decode-1" not in md["status"]["agents"]  # no report is expected of a worker

    cluster.patch(
        f"{POD_PATH.format(ns=NS)}/smollm-decode-1-1",
        {"status": {"conditions": [{"type": "Ready", "status": "True"}]}},
    )
    cluster.patch(f"{LWSS}/smollm-decode/status", {"status": {"readyReplicas": 2}})
    md = cluster.wait_for(
        lambda: (m := cluster.get(MD)) and condition(m, "Ready")["status"] == "True" and m, what="Ready"
    )
    assert md["status"]["decode"]["ready"] == "2/2" and md["status"]["decode"]["incompleteGroups"] == 0


def test_switching_a_pool_between_deployment_and_leader_worker_set(cluster: Cluster) -> None:
    create_md(cluster, example(prefill={"gpus": 0}, decode={"gpus": 0}))
    cluster.wait_for(lambda: cluster.get(f"{DEPS}/smollm-decode"), what="decode Deployment")

    update_spec(cluster, {"decode": MULTI})
    cluster.wait_for(lambda: lws(cluster), what="LeaderWorkerSet")
    cluster.wait_for(lambda: cluster.get(f"{DEPS}/smollm-decode") is None, what="the Deployment deleted")
    cluster.wait_for(lambda: selector(cluster, "smollm-decode-pods").get(WORKER_INDEX) == "0", what="leaders")

    update_spec(cluster, {"decode": {"tensorParallel": 1, "nodesPerReplica": 1}})
    dep = cluster.wait_for(lambda: cluster.get(f"{DEPS}/smollm-decode"), what="the Deployment back")
    cluster.wait_for(lambda: lws(cluster) is None, what="the LeaderWorkerSet deleted")
    assert WORKER_INDEX not in selector(cluster, "smollm-decode")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--nodes" not in args and args[args.index("--tensor-parallel") + 1] == "1"
    assert cluster.get(f"{DEPS}/smollm-prefill") is not None  # the other pool is left alone


@pytest.fixture
def cluster_without_lws(
    operator_config: Config, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Cluster]:
    """A cluster whose API server does not serve LeaderWorkerSets when the operator starts."""
    kubeconfig = tmp_path / "kubeconfig"
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    running = Cluster(operator_config, kubeconfig, without=(LWS_RESOURCE,))
    running.start()
    try:
        yield running
    finally:
        running.stop()


def test_without_the_leader_worker_set_crd_the_pool_is_degraded_until_it_is_installed(
    cluster_without_lws: Cluster,
) -> None:
    cluster = cluster_without_lws
    create_md(cluster, example(prefill={"gpus": 0}, decode=MULTI))
    md = cluster.wait_for(
        lambda: (m := cluster.get(MD)) and condition(m, "Degraded") and m, what="Degraded condition"
    )
    degraded = condition(md, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "LeaderWorkerSetMissing")
    assert "install LeaderWorkerSet" in degraded["message"] and "decode" in degraded["message"]
    assert condition(md, "Ready")["status"] == "False"
    assert condition(md, "Progressing")["reason"] == "Blocked"
    assert lws(cluster) is None and cluster.get(f"{DEPS}/smollm-router") is None  # nothing applied

    # Installed while the operator runs: it is not watched then, but the next timer pass goes on.
    cluster.emulator.resources[LWS_RESOURCE] = kmock.ResourceInfo(verbs=VERBS, **RESOURCES[LWS_RESOURCE])
    cluster.wait_for(lambda: lws(cluster), what="LeaderWorkerSet once the CRD is served")
    cluster.wait_for(
        lambda: condition(cluster.get(MD), "Degraded")["reason"] != "LeaderWorkerSetMissing",
        what="condition cleared",
    )


@pytest.mark.slow  # about 10 s: a blue/green sequence on the operator's timer
def test_a_format_change_of_a_multi_node_pool_is_blue_green(cluster: Cluster) -> None:
    """The new LeaderWorkerSet starts beside the serving one, which is deleted once traffic moved."""
    create_md(cluster, example(prefill={"gpus": 0}, decode=MULTI))
    blue = cluster.wait_for(lambda: lws(cluster), what="LeaderWorkerSet")
    cluster.wait_for(lambda: cluster.get(f"{DEPS}/smollm-router"), what="router")  # applied last
    cluster.patch(
        f"{LWSS}/smollm-decode/status", {"status": {"replicas": 1, "updatedReplicas": 1, "readyReplicas": 1}}
    )
    set_ready(cluster, "prefill", 1)
    set_ready(cluster, "router", 1)
    cluster.wait_for(lambda: condition(cluster.get(MD), "Ready")["status"] == "True", what="Ready")

    update_spec(cluster, {"prefill": {"kvCacheFormat": "int8"}})
    green = cluster.wait_for(lambda: lws(cluster, "smollm-decode-green"), what="green LeaderWorkerSet")
    cluster.wait_for(lambda: cluster.get(f"{DEPS}/smollm-prefill-green"), what="green prefill")
    leader = green["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
    assert leader["metadata"]["labels"]["pagoda.dev/slot"] == "green"
    assert lws(cluster)["metadata"]["uid"] == blue["metadata"]["uid"]  # the serving group stays
    old = selector(cluster, "smollm-decode-pods")["pagoda.dev/formats"]

    cluster.patch(
        f"{LWSS}/smollm-decode-green/status",
        {"status": {"replicas": 1, "updatedReplicas": 1, "readyReplicas": 1}},
    )
    cluster.patch(
        f"{DEPS}/smollm-prefill-green/status",
        {"status": {"replicas": 1, "updatedReplicas": 1, "readyReplicas": 1}},
    )
    cluster.wait_for(lambda: lws(cluster) is None, what="the old LeaderWorkerSet removed", timeout=120)
    moved = selector(cluster, "smollm-decode-pods")
    assert moved["pagoda.dev/formats"] != old and moved[WORKER_INDEX] == "0"


@pytest.mark.slow  # about 10 s: a blue/green sequence on the operator's timer
def test_a_format_change_that_also_goes_multi_node_keeps_the_old_pair_serving(cluster: Cluster) -> None:
    """Blue/green across kinds: the Services keep selecting the old Deployment's pods (no leader
    label) until traffic moves to the new LeaderWorkerSet's leaders."""
    create_md(cluster, example(prefill={"gpus": 0}, decode={"gpus": 0}))
    cluster.wait_for(lambda: cluster.get(f"{DEPS}/smollm-router"), what="children")
    for role in ("prefill", "decode", "router"):
        set_ready(cluster, role, 1)
    cluster.wait_for(lambda: condition(cluster.get(MD), "Ready")["status"] == "True", what="Ready")
    old = selector(cluster, "smollm-decode")

    update_spec(cluster, {"prefill": {"kvCacheFormat": "int8"}, "decode": MULTI})
    cluster.wait_for(lambda: lws(cluster, "smollm-decode-green"), what="green LeaderWorkerSet")
    cluster.wait_for(lambda: cluster.get(f"{DEPS}/smollm-prefill-green"), what="green prefill")
    cluster.wait_for(
        lambda: condition(cluster.get(MD), "Progressing")["reason"] == "StartNewPair", what="StartNewPair"
    )
    for svc in ("smollm-decode", "smollm-decode-pods"):
        assert selector(cluster, svc) == old  # still the serving Deployment's pods
    assert cluster.get(f"{DEPS}/smollm-decode") is not None

    ready = {"status": {"replicas": 1, "updatedReplicas": 1, "readyReplicas": 1}}
    cluster.patch(f"{LWSS}/smollm-decode-green/status", ready)
    cluster.patch(f"{DEPS}/smollm-prefill-green/status", ready)
    cluster.wait_for(
        lambda: cluster.get(f"{DEPS}/smollm-decode") is None, what="old decode removed", timeout=120
    )
    moved = selector(cluster, "smollm-decode-pods")
    assert moved[WORKER_INDEX] == "0" and moved["pagoda.dev/formats"] != old["pagoda.dev/formats"]
