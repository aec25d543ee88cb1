"""The operator against kmock with controllers played as the real ones behave: the API server sets
``metadata.generation``, the Deployment controller ``observedGeneration``, LeaderWorkerSet with or
without ``observedGeneration`` (releases before and after it had one), pods carry their template's
labels, Prometheus scrapes what the pool Services select (the chart's ServiceMonitor: target label
``pagoda_dev_model_deployment``) and KEDA reads an empty query result as 0. Foreign objects with a
child's name are left as they are."""

from __future__ import annotations

import dataclasses
import pathlib
import re
from collections.abc import Callable, Iterator
from typing import Any

import kmock
import pytest
from op_cluster import DEP_PATH, EVENT_PATH, LWS_PATH, MD_PATH, PDB_PATH, POD_PATH, SVC_PATH, VERBS, Cluster
from op_schema import example
from test_operator_kmock import condition, create_md, update_spec

from pagoda.operator.config import Config

NS = "default"
MD = MD_PATH.format(ns=NS) + "/smollm"
DEPS = DEP_PATH.format(ns=NS)
LWSS = LWS_PATH.format(ns=NS)
SVCS = SVC_PATH.format(ns=NS)
PODS = POD_PATH.format(ns=NS)
SO_RESOURCE = "keda.sh/v1alpha1/scaledobjects"
SOS = f"/apis/keda.sh/v1alpha1/namespaces/{NS}/scaledobjects"
MULTI = {"gpus": 0, "tensorParallel": 2, "nodesPerReplica": 2}
AUTO = {"minReplicas": 1, "maxReplicas": 4, "targets": {"waitingRequests": 4, "kvCacheUsage": 0.8}}
WAIT = 300  # seconds a step may take on a loaded machine (the passes run on the operator's timer)
MATCHER = re.compile(r'([a-z_]+)="([^"]*)"')


def wait(cluster: Cluster, check: Callable[[], Any], what: str) -> Any:
    return cluster.wait_for(check, timeout=WAIT, what=what)


# --- the controllers ------------------------------------------------------------------------


def generation(cluster: Cluster, path: str) -> int:
    """What the API server does on create: ``metadata.generation`` 1 (kmock leaves it out)."""
    obj = cluster.get(path)
    gen = obj["metadata"].get("generation")
    if gen is None:
        cluster.patch(path, {"metadata": {"generation": 1}})
        gen = 1
    return gen


def template_labels(obj: dict) -> dict:
    spec = obj["spec"]
    template = (
        spec["leaderWorkerTemplate"]["leaderTemplate"] if "leaderWorkerTemplate" in spec else spec["template"]
    )
    return template["metadata"]["labels"]


def run_deployment(cluster: Cluster, name: str) -> None:
    """The Deployment controller: one ready pod on the current template, observedGeneration set."""
    path = f"{DEPS}/{name}"
    gen = generation(cluster, path)
    dep = cluster.get(path)
    replicas = dep["spec"].get("replicas", 1)
    add_pods(cluster, name, template_labels(dep), replicas)
    status = {"observedGeneration": gen, "replicas": replicas, "updatedReplicas": replicas}
    cluster.patch(
        f"{path}/status", {"status": {**status, "readyReplicas": replicas, "availableReplicas": replicas}}
    )


def run_lws(cluster: Cluster, name: str, observed: bool, ready: bool = True) -> None:
    """The LeaderWorkerSet controller: groups ready (or still starting), with its conditions; an
    older release sets no observedGeneration."""
    path = f"{LWSS}/{name}"
    gen = generation(cluster, path)
    n = 1 if ready else 0
    conditions = [
        {"type": "Available", "status": "True" if ready else "False", "reason": "AllGroupsReady"},
        {"type": "Progressing", "status": "False" if ready else "True", "reason": "GroupsProgressing"},
        {"type": "UpdateInProgress", "status": "False", "reason": "UpdatesDone"},
    ]
    status: dict = {"replicas": 1, "updatedReplicas": 1, "readyReplicas": n, "conditions": conditions}
    if observed:
        status["observedGeneration"] = gen
    cluster.patch(f"{path}/status", {"status": status})
    if ready:
        add_pods(cluster, name, template_labels(cluster.get(path)), 1)


def add_pods(cluster: Cluster, owner: str, labels: dict, count: int) -> None:
    for i in range(count):
        name = f"{owner}-pod-{i}"
        if cluster.get(f"{PODS}/{name}") is None:
            pod = {"metadata": {"name": name, "namespace": NS, "labels": labels}}
            cluster.create(PODS, pod)


def collect_garbage(cluster: Cluster) -> None:
    """The garbage collector: pods of a workload that is gone go too."""
    workloads = {d["metadata"]["name"] for d in cluster.get(DEPS)["items"]}
    workloads |= {d["metadata"]["name"] for d in (cluster.get(LWSS) or {"items": []})["items"]}
    for pod in cluster.get(PODS)["items"]:
        if pod["metadata"]["name"].rsplit("-pod-", 1)[0] not in workloads:
            cluster.delete(f"{PODS}/{pod['metadata']['name']}")


def scraped(cluster: Cluster) -> list[dict[str, str]]:
    """Prometheus through the chart's ServiceMonitor: a target per pod of each non-headless pool or
    router Service, with the target label and the agent's own ``pool`` label."""
    out = []
    pods = cluster.get(PODS)["items"]
    for svc in cluster.get(SVCS)["items"]:
        labels = svc["metadata"].get("labels") or {}
        if labels.get("app.kubernetes.io/managed-by") != "pagoda-operator" or "pagoda.dev/headless" in labels:
            continue
        selector = svc["spec"]["selector"]
        for pod in pods:
            if selector.items() <= (pod["metadata"].get("labels") or {}).items():
                out.append(
                    {
                        "namespace": NS,
                        "service": svc["metadata"]["name"],
                        "pod": pod["metadata"]["name"],
                        "pagoda_dev_model_deployment": labels["pagoda.dev/model-deployment"],
                        "pool": pod["metadata"]["labels"]["pagoda.dev/pool"],
                    }
                )
    return out


def keda_reads(query: str, series: list[dict[str, str]]) -> list[str]:
    """The pods whose series a trigger's query selects (none: KEDA would read 0 and scale in)."""
    matchers = MATCHER.findall(query)
    return sorted(s["pod"] for s in series if all(s.get(k) == v for k, v in matchers))


# --- autoscaling across format changes ------------------------------------------------------


@pytest.fixture
def keda_cluster(
    operator_config: Config, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Cluster]:
    kubeconfig = tmp_path / "kubeconfig"
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    cfg = dataclasses.replace(operator_config, autoscaler="keda")
    running = Cluster(cfg, kubeconfig)
    running.start()
    running.emulator.resources[SO_RESOURCE] = kmock.ResourceInfo(
        verbs=VERBS, kind="ScaledObject", namespaced=True
    )
    try:
        yield running
    finally:
        running.stop()


def assert_autoscaling_reads_the_serving_pods(cluster: Cluster) -> None:
    so = wait(cluster, lambda: cluster.get(f"{SOS}/smollm-decode"), what="ScaledObject")
    target = so["spec"]["scaleTargetRef"]["name"]
    assert cluster.get(f"{DEPS}/{target}") is not None, target  # the workload it scales exists
    series = scraped(cluster)
    for trigger in so["spec"]["triggers"]:
        pods = keda_reads(trigger["metadata"]["query"], series)
        assert pods, f"{trigger['name']}: the query selects no series: {trigger['metadata']['query']}"
        assert all(p.startswith(f"{target}-pod-") for p in pods), (target, pods)  # the scaled pool's


def format_change(cluster: Cluster, prefill_kv: str, new: str, old: str) -> None:
    update_spec(cluster, {"prefill": {"gpus": 0, "kvCacheFormat": prefill_kv}})
    for pool in ("prefill", "decode"):
        wait(cluster, lambda pool=pool: cluster.get(f"{DEPS}/smollm-{pool}{new}"), what=f"new {pool}")
    wait(
        cluster,
        lambda: condition(cluster.get(MD), "Progressing")["reason"] == "StartNewPair",
        what="StartNewPair",
    )
    assert_autoscaling_reads_the_serving_pods(cluster)  # the old pair still serves and is scaled
    for pool in ("prefill", "decode"):
        run_deployment(cluster, f"smollm-{pool}{new}")
    for pool in ("prefill", "decode"):
        wait(
            cluster,
            lambda pool=pool: cluster.get(f"{DEPS}/smollm-{pool}{old}") is None,
            what="old pair removed",
        )
    collect_garbage(cluster)
    wait(
        cluster,
        lambda: condition(cluster.get(MD), "Progressing")["reason"] == "RolloutComplete",
        what="complete",
    )
    wait(
        cluster,
        lambda: (
            cluster.get(f"{SOS}/smollm-decode")["spec"]["scaleTargetRef"]["name"] == f"smollm-decode{new}"
        ),
        what="the ScaledObject on the new pair",
    )
    assert_autoscaling_reads_the_serving_pods(cluster)


@pytest.mark.slow  # about 20 s: two blue/green sequences on the operator's timer
def test_autoscaling_targets_existing_services_after_two_format_changes(keda_cluster: Cluster) -> None:
    cluster = keda_cluster
    create_md(cluster, example(prefill={"gpus": 0}, decode={"gpus": 0, "autoscaling": AUTO}))
    wait(cluster, lambda: cluster.get(f"{DEPS}/smollm-router"), what="children")
    for role in ("prefill", "decode", "router"):
        run_deployment(cluster, f"smollm-{role}")
    assert_autoscaling_reads_the_serving_pods(cluster)
    so = cluster.get(f"{SOS}/smollm-decode")
    assert all(t["metadata"]["ignoreNullValues"] == "false" for t in so["spec"]["triggers"])

    format_change(cluster, "int8", new="-green", old="")  # blue -> green
    format_change(cluster, "bf16", new="", old="-green")  # green -> blue again


# --- multi-node format changes on both LeaderWorkerSet behaviours ---------------------------


@pytest.mark.slow  # about 10 s: a blue/green sequence on the operator's timer
@pytest.mark.parametrize(
    "observed", [True, False], ids=["with-observedGeneration", "without-observedGeneration"]
)
def test_a_multi_node_format_change_completes(cluster: Cluster, observed: bool) -> None:
    create_md(cluster, example(prefill={"gpus": 0}, decode=MULTI))
    wait(cluster, lambda: cluster.get(f"{LWSS}/smollm-decode"), what="LeaderWorkerSet")
    wait(cluster, lambda: cluster.get(f"{DEPS}/smollm-router"), what="router")
    run_lws(cluster, "smollm-decode", observed)
    run_deployment(cluster, "smollm-prefill")
    run_deployment(cluster, "smollm-router")
    md = wait(
        cluster,
        lambda: (m := cluster.get(MD)) and condition(m, "Progressing")["reason"] == "RolloutComplete" and m,
        what="the first rollout complete",
    )
    assert condition(md, "Ready")["status"] == "True"

    update_spec(cluster, {"prefill": {"kvCacheFormat": "int8"}})
    wait(cluster, lambda: cluster.get(f"{LWSS}/smollm-decode-green"), what="green LeaderWorkerSet")
    wait(cluster, lambda: cluster.get(f"{DEPS}/smollm-prefill-green"), what="green prefill")
    run_lws(cluster, "smollm-decode-green", observed, ready=False)  # groups still starting
    run_deployment(cluster, "smollm-prefill-green")
    wait(
        cluster,
        lambda: condition(cluster.get(MD), "Progressing")["reason"] == "StartNewPair",
        what="StartNewPair",
    )
    assert cluster.get(f"{LWSS}/smollm-decode") is not None  # the serving pair stays while green starts

    run_lws(cluster, "smollm-decode-green", observed)
    wait(cluster, lambda: cluster.get(f"{LWSS}/smollm-decode") is None, what="old LeaderWorkerSet removed")
    md = wait(
        cluster,
        lambda: (m := cluster.get(MD)) and condition(m, "Progressing")["reason"] == "RolloutComplete" and m,
        what="the format change complete",
    )
    assert md["status"]["decode"]["ready"] == "1/1" and condition(md, "Ready")["status"] == "True"


# --- ownership --------------------------------------------------------------------------------


FOREIGN_SERVICE = {
    "apiVersion": "v1",
    "kind": "Service",
    "metadata": {
        "name": "smollm-router",
        "namespace": NS,
        "labels": {"app": "web"},
        "ownerReferences": [
            {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "name": "web",
                "uid": "uid-web",
                "controller": True,
            }
        ],
    },
    "spec": {
        "type": "LoadBalancer",
        "selector": {"app": "web"},
        "ports": [{"name": "https", "port": 443, "targetPort": 8443, "protocol": "TCP"}],
    },
}
HAND_MADE_PDB = {
    "apiVersion": "policy/v1",
    "kind": "PodDisruptionBudget",
    "metadata": {"name": "smollm-decode", "namespace": NS},
    "spec": {"maxUnavailable": 0, "selector": {"matchLabels": {"app": "web"}}},
}


def test_a_foreign_object_is_left_untouched_with_a_degraded_condition_naming_it(cluster: Cluster) -> None:
    svc_path, pdb_path = f"{SVCS}/smollm-router", f"{PDB_PATH.format(ns=NS)}/smollm-decode"
    cluster.create(SVCS, FOREIGN_SERVICE)
    cluster.create(PDB_PATH.format(ns=NS), HAND_MADE_PDB)
    before = {p: cluster.get(p) for p in (svc_path, pdb_path)}
    create_md(cluster, example(prefill={"gpus": 0}, decode={"gpus": 0}))
    md = wait(
        cluster,
        lambda: (
            (m := cluster.get(MD)) and (c := condition(m, "Degraded")) and c["reason"] == "AlreadyOwned" and m
        ),
        what="AlreadyOwned",
    )
    message = condition(md, "Degraded")["message"]
    assert "Service/smollm-router is controlled by Deployment/web" in message
    assert "PodDisruptionBudget/smollm-decode lacks the labels" in message
    assert (condition(md, "Ready")["status"], condition(md, "Ready")["reason"]) == ("False", "AlreadyOwned")
    wait(cluster, lambda: cluster.get(f"{DEPS}/smollm-router"), what="the other children applied")
    for path, obj in before.items():  # not patched, not adopted: what its owner made
        assert cluster.get(path) == obj
    warned = wait(  # kopf posts Events in the background
        cluster,
        lambda: [e for e in cluster.get(EVENT_PATH.format(ns=NS))["items"] if e["reason"] == "AlreadyOwned"],
        what="the AlreadyOwned Event",
    )
    assert warned[0]["type"] == "Warning" and "Service/smollm-router" in warned[0]["message"]

    cluster.delete(svc_path)  # its owner lets the name go: the operator's Service comes
    cluster.delete(pdb_path)
    svc = wait(cluster, lambda: cluster.get(svc_path), what="the router Service")
    assert svc["spec"]["type"] == "ClusterIP" and svc["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    wait(
        cluster,
        lambda: condition(cluster.get(MD), "Degraded")["reason"] != "AlreadyOwned",
        what="condition cleared",
    )
