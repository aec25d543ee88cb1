"""Tensor-parallel pools: GPUs per pod, LeaderWorkerSet rendering of multi-node pools, their
Services, network policy, Pod Security and ``pagoda-operator render``."""

from __future__ import annotations

import io

import kubernetes_validate
import pytest
import yaml
from op_schema import admit, example
from pss import violations

from pagoda.operator import children, render
from pagoda.operator.config import Config
from pagoda.operator.spec import parse

META = {"name": "m", "namespace": "ns", "uid": "u-1"}
LWS = "LeaderWorkerSet"
MULTI = {"tensorParallel": 8, "nodesPerReplica": 2, "replicas": 3}  # 2 hosts x 4 ranks, 3 replicas


def build(cfg: Config | None = None, **spec: object) -> dict:
    return children.build(META, parse(admit(example("m", **spec))["spec"]), cfg or Config())


def container(template: dict) -> dict:
    return template["spec"]["containers"][0]


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def lws_templates(obj: dict) -> tuple[dict, dict]:
    lwt = obj["spec"]["leaderWorkerTemplate"]
    return lwt["leaderTemplate"], lwt["workerTemplate"]


def test_a_single_node_pool_requests_tensor_parallel_gpus() -> None:
    """One pod per replica: it requests one GPU per rank (gpus left out, derived), as a Deployment."""
    objs = build(decode={"tensorParallel": 4})
    assert f"{LWS}/m-decode" not in objs
    agent = container(objs["Deployment/m-decode"]["spec"]["template"])
    assert agent["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert agent["resources"]["requests"]["nvidia.com/gpu"] == 4
    assert flag(agent["args"], "--tensor-parallel") == "4"
    assert "--nodes" not in agent["args"] and "--dist-port" not in agent["args"]
    assert [p["name"] for p in agent["ports"]] == ["http", "kv"]  # no rendezvous port across pods
    prefill = container(objs["Deployment/m-prefill"]["spec"]["template"])
    assert prefill["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_a_multi_node_pool_is_a_leader_worker_set() -> None:
    objs = build(decode=MULTI)
    assert "Deployment/m-decode" not in objs and "Deployment/m-prefill" in objs
    lws = objs[f"{LWS}/m-decode"]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert lws["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    spec = lws["spec"]
    assert spec["replicas"] == 3  # groups
    assert spec["leaderWorkerTemplate"]["size"] == 2
    assert spec["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert spec["rolloutStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdateConfiguration": {"maxSurge": 1, "maxUnavailable": 0},
    }
    leader, worker = lws_templates(lws)
    for template in (leader, worker):
        agent = container(template)
        args = agent["args"]
        assert flag(args, "--tensor-parallel") == "8"  # ranks of the replica, all hosts together
        assert flag(args, "--nodes") == "2"
        assert flag(args, "--dist-port") == str(children.DIST_PORT)
        assert agent["resources"]["limits"]["nvidia.com/gpu"] == 4  # ranks per pod
        assert {"name": "dist", "containerPort": 29500, "protocol": "TCP"} in agent["ports"]
        names = {e["name"] for e in agent["env"]}
        assert not {n for n in names if n.startswith("LWS_")}  # the LWS controller injects them
        assert template["metadata"]["labels"][children.POOL_LABEL] == "decode"
        kubernetes_validate.validate(
            {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template},
            "1.33",
            strict=True,
        )
    assert container(leader)["args"] == container(worker)["args"]  # the same command on every host
    # The leader serves the API (readiness /ready); a worker serves only /health.
    assert container(leader)["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container(worker)["readinessProbe"]["httpGet"]["path"] == "/health"
    for probe in ("livenessProbe", "startupProbe"):
        assert container(worker)[probe] == container(leader)[probe]
        assert container(worker)[probe]["httpGet"]["path"] == "/health"


def test_services_of_a_multi_node_pool_select_only_leaders() -> None:
    objs = build(decode=MULTI)
    for svc in ("Service/m-decode", "Service/m-decode-pods"):
        assert objs[svc]["spec"]["selector"][children.WORKER_INDEX_LABEL] == "0"
    for svc in ("Service/m-prefill", "Service/m-prefill-pods"):  # a single-node pool: unchanged
        assert children.WORKER_INDEX_LABEL not in objs[svc]["spec"]["selector"]
    # The router still finds each replica through the headless Service (its leaders' A records).
    router = container(objs["Deployment/m-router"]["spec"]["template"])
    assert flag(router["args"], "--decode-dns") == "m-decode-pods.ns.svc.cluster.local:8000"


def test_the_budget_of_a_multi_node_pool_counts_pods() -> None:
    """One pod evicted at a time takes down at most one group (the group restarts as a whole)."""
    pdb = build(decode=MULTI)["PodDisruptionBudget/m-decode"]["spec"]
    assert pdb["maxUnavailable"] == 1
    assert pdb["selector"]["matchLabels"] == children.selector("m", "decode")


def test_an_autoscaled_multi_node_pool_scales_groups() -> None:
    auto = {"maxReplicas": 4, "targets": {"waitingRequests": 8}}
    objs = build(decode={**MULTI, "autoscaling": auto})
    assert "replicas" not in objs[f"{LWS}/m-decode"]["spec"]
    hpa = objs["HorizontalPodAutoscaler/m-decode"]
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": LWS,
        "name": "m-decode",
    }
    keda = build(Config(autoscaler="keda"), decode={**MULTI, "autoscaling": auto})
    assert keda["ScaledObject/m-decode"]["spec"]["scaleTargetRef"]["kind"] == LWS


def test_ranks_of_a_multi_node_pool_may_reach_each_other() -> None:
    """NCCL and gloo pick their own ports after the rendezvous: the pool's own pods, any port."""
    objs = build(decode=MULTI)
    decode = objs["NetworkPolicy/m-decode"]["spec"]["ingress"]
    assert {"from": [{"podSelector": {"matchLabels": children.selector("m", "decode")}}]} in decode
    prefill = objs["NetworkPolicy/m-prefill"]["spec"]["ingress"]
    assert all("ports" in rule for rule in prefill)  # a single-node pool admits no such peer
    kubernetes_validate.validate(objs["NetworkPolicy/m-decode"], "1.33", strict=True)


@pytest.mark.parametrize(
    "pool",
    [MULTI, {**MULTI, "gpus": 0}, {**MULTI, "podTemplate": {"metadata": {"labels": {"team": "ml"}}}}],
)
def test_both_templates_of_a_leader_worker_set_are_restricted(pool: dict) -> None:
    objs = build(decode=pool, prefill={"tensorParallel": 2, "nodesPerReplica": 2})
    for name in ("m-decode", "m-prefill"):
        for template in lws_templates(objs[f"{LWS}/{name}"]):
            assert violations(template["spec"]) == [], name


def test_different_tensor_parallel_degrees_between_pools_render() -> None:
    """Prefill TP 2 hands its KV pages to decode TP 4 (the decode leader re-shards them by head)."""
    body = example("m", prefill={"tensorParallel": 2}, decode={"tensorParallel": 4})
    admit(body)
    objs = build(prefill={"tensorParallel": 2}, decode={"tensorParallel": 4})
    for pool, tp in (("prefill", "2"), ("decode", "4")):
        agent = container(objs[f"Deployment/m-{pool}"]["spec"]["template"])
        assert flag(agent["args"], "--tensor-parallel") == tp
        assert agent["resources"]["limits"]["nvidia.com/gpu"] == int(tp)


def test_render_prints_a_leader_worker_set_pool() -> None:
    body = example("m", decode=MULTI)
    out = io.StringIO()
    render.render(io.StringIO(yaml.safe_dump(body)), "team", Config(), out)
    objs = {f"{o['kind']}/{o['metadata']['name']}": o for o in yaml.safe_load_all(out.getvalue()) if o}
    spec = parse(admit(body)["spec"])
    owner = {"name": "m", "namespace": "team", "uid": render.RENDER_UID}
    assert objs == children.build(owner, spec, Config())
    assert objs[f"{LWS}/m-decode"]["spec"]["leaderWorkerTemplate"]["size"] == 2


@pytest.mark.parametrize(
    ("pool", "why"),
    [
        # The CRD's CEL rules refuse them first, as admission would.
        ({"tensorParallel": 2, "nodesPerReplica": 4}, "spec.decode: nodesPerReplica must not exceed"),
        ({"tensorParallel": 6, "nodesPerReplica": 4}, "must be a multiple of nodesPerReplica"),
        ({"tensorParallel": 8, "nodesPerReplica": 2, "gpus": 8}, "gpus is per pod"),
    ],
)
def test_render_refuses_layouts_the_agents_cannot_run(pool: dict, why: str) -> None:
    with pytest.raises(render.RenderError, match=why):
        render.render_objects(example("m", decode=pool), None, Config())
