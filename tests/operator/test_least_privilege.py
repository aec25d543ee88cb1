"""Least privilege and the chart's ecosystem settings: no API token where nothing reports, the
agents' ClusterRole bound (not held) in cluster mode, ownerReferences pinned by the admission
policy, aggregated edit/view roles, ``global``, ``kubeVersion``, operator metrics, topology spread."""

from __future__ import annotations

import asyncio
import copy

import helm_python
import kubernetes_validate
import pytest
import yaml
from fake_kube import FakeKube
from op_schema import CHART, admit, example
from test_pod_security import AGENT, _admitted, _policy, live_pod, with_report

from pagoda.operator import children, metrics
from pagoda.operator.config import Config
from pagoda.operator.reconcile import reconcile
from pagoda.operator.spec import parse

K8S = "1.33"
META = {"name": "m", "namespace": "ns", "uid": "uid-m"}


def render(values: dict | None = None) -> list[dict]:
    chart = helm_python.Chart.load(str(CHART))
    out = chart.render(values or {}, name="pagoda", namespace="pagoda-system")
    return [d for path, text in out.items() if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]


def pod_specs(spec: dict, cfg: Config) -> dict[str, list[dict]]:
    """Per role, the pod specs of its workload (an LWS: leader, then workers)."""
    built = children.build(META, parse(admit(example("m", **spec))["spec"]), cfg)
    out: dict[str, list[dict]] = {}
    for obj in built.values():
        if obj["kind"] in ("Deployment", children.LWS_KIND):
            role = obj["metadata"]["labels"][children.POOL_LABEL]
            out[role] = [t["spec"] for t in children.pod_templates(obj)]
    return out


def test_only_the_reporting_pods_carry_a_token() -> None:
    specs = pod_specs(
        {"prefill": {"gpus": 0}, "decode": {"gpus": 0, "tensorParallel": 2, "nodesPerReplica": 2}}, Config()
    )
    (router,) = specs["router"]
    assert router["automountServiceAccountToken"] is False and "serviceAccountName" not in router
    (prefill,) = specs["prefill"]
    assert prefill["serviceAccountName"] == "m-pagoda-agent" and "automountServiceAccountToken" not in prefill
    leader, worker = specs["decode"]
    assert leader["serviceAccountName"] == "m-pagoda-agent"
    assert worker["automountServiceAccountToken"] is False and "serviceAccountName" not in worker


def test_cluster_mode_binds_the_charts_agent_cluster_role() -> None:
    cfg = Config(agent_cluster_role="pagoda-agent")
    rbac = children.agent_rbac(META, cfg)
    assert [(o["kind"], o["metadata"]["name"]) for o in rbac] == [
        ("ServiceAccount", "m-pagoda-agent"),
        ("RoleBinding", "m-pagoda-agent-pods"),
    ]
    assert rbac[1]["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": "pagoda-agent",
    }
    assert rbac[1]["subjects"] == [{"kind": "ServiceAccount", "name": "m-pagoda-agent", "namespace": "ns"}]
    # Without it (watchNamespaces): a Role of the operator's own, as before.
    assert [o["kind"] for o in children.agent_rbac(META, Config())] == [
        "ServiceAccount",
        "Role",
        "RoleBinding",
    ]


def test_an_earlier_operators_agent_role_is_removed_in_cluster_mode() -> None:
    kube = FakeKube()
    body = kube.put(
        {**admit(example("m", prefill={"gpus": 0}, decode={"gpus": 0})), "kind": "ModelDeployment"}
    )
    body["metadata"].update(namespace="ns", generation=1)
    kube.objects[("ModelDeployment", "ns", "m")] = body
    meta = body["metadata"]
    for legacy in children.agent_rbac(meta, Config()):
        kube.put(legacy)
    foreign = copy.deepcopy(children.agent_rbac(meta, Config())[1])
    foreign["metadata"].update(name="m-pagoda-agent", namespace="other")
    kube.put(foreign)
    asyncio.run(reconcile(kube, body, Config(agent_cluster_role="pagoda-agent")))  # type: ignore[arg-type]
    deleted = sorted((kind, name) for verb, kind, name in kube.writes if verb == "delete")
    assert deleted == [("Role", "m-pagoda-agent"), ("RoleBinding", "m-pagoda-agent")]
    assert ("RoleBinding", "ns", "m-pagoda-agent-pods") in kube.objects
    assert ("Role", "other", "m-pagoda-agent") in kube.objects  # not ours: left alone


def test_the_admission_policy_pins_owner_references() -> None:
    policy = _policy()
    mine = live_pod("m-decode-1")
    mine["metadata"]["ownerReferences"] = [
        {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "rs", "uid": "u"}
    ]
    assert _admitted(policy, AGENT, "m-decode-1", mine, with_report(mine))
    freed = with_report(mine)
    del freed["metadata"]["ownerReferences"]
    assert not _admitted(policy, AGENT, "m-decode-1", mine, freed)
    adopted = with_report(mine)
    adopted["metadata"]["ownerReferences"][0]["uid"] = "other"
    assert not _admitted(policy, AGENT, "m-decode-1", mine, adopted)


def test_the_chart_in_cluster_mode_grants_bind_not_pod_patch() -> None:
    docs = render()
    dep = next(d for d in docs if d["kind"] == "Deployment")
    env = {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["PAGODA_AGENT_CLUSTER_ROLE"] == "pagoda-agent"
    # With watchNamespaces there is no ClusterRole binding: Roles, and no variable.
    scoped = render({"operator": {"watchNamespaces": ["team-a"]}})
    dep = next(d for d in scoped if d["kind"] == "Deployment")
    names = {e["name"] for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert "PAGODA_AGENT_CLUSTER_ROLE" not in names
    role = next(d for d in scoped if d["kind"] == "Role")
    pods = next(r for r in role["rules"] if r["resources"] == ["pods"])
    assert pods["verbs"] == ["list", "patch"]


def test_aggregated_edit_and_view_roles() -> None:
    roles = {d["metadata"]["name"]: d for d in render() if d["kind"] == "ClusterRole"}
    edit, view = roles["pagoda-modeldeployments-edit"], roles["pagoda-modeldeployments-view"]
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-admin"] == "true"
    assert view["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    assert "delete" in edit["rules"][0]["verbs"] and set(view["rules"][0]["verbs"]) == {
        "get",
        "list",
        "watch",
    }
    assert view["rules"][0]["resources"] == ["modeldeployments", "modeldeployments/status"]
    for role in (edit, view):
        kubernetes_validate.validate(role, K8S, strict=True)
    off = render({"rbac": {"aggregateToDefaultRoles": False}})
    assert not any(d["metadata"]["name"].startswith("pagoda-modeldeployments") for d in off)


def test_the_chart_works_as_a_subchart_and_states_its_kube_version() -> None:
    render({"global": {"imageRegistry": "registry.example", "anything": {"nested": True}}})
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["kubeVersion"] == ">=1.30.0-0"  # the ValidatingAdmissionPolicy's API


def test_operator_metrics_service_monitor_and_topology_spread() -> None:
    spread = [
        {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway"}
    ]
    docs = render(
        {"metrics": {"serviceMonitor": {"enabled": True}}, "operator": {"topologySpreadConstraints": spread}}
    )
    dep = next(d for d in docs if d["kind"] == "Deployment")
    pod = dep["spec"]["template"]["spec"]
    assert pod["topologySpreadConstraints"] == spread
    container = pod["containers"][0]
    assert {"name": "metrics", "containerPort": 8081, "protocol": "TCP"} in container["ports"]
    assert {"name": "PAGODA_METRICS_PORT", "value": "8081"} in container["env"]
    svc = next(
        d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "pagoda-operator-metrics"
    )
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    monitor = next(
        d for d in docs if d["kind"] == "ServiceMonitor" and d["metadata"]["name"] == "pagoda-operator"
    )
    assert monitor["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    for doc in (dep, svc):
        kubernetes_validate.validate(doc, K8S, strict=True)
    off = render({"operator": {"metrics": {"enabled": False}}})
    assert not any(d["metadata"]["name"] == "pagoda-operator-metrics" for d in off)


def test_the_operator_counts_and_times_its_passes() -> None:
    def sample(name: str, **labels: str) -> float:
        return metrics.REGISTRY.get_sample_value(name, labels) or 0.0

    ok, err = sample("pagoda_operator_reconcile_total", trigger="t", result="ok"), 0.0

    async def run(fail: bool) -> None:
        async with metrics.timed("t"):
            if fail:
                raise RuntimeError("boom")

    asyncio.run(run(False))
    with pytest.raises(RuntimeError):
        asyncio.run(run(True))
    assert sample("pagoda_operator_reconcile_total", trigger="t", result="ok") == ok + 1
    assert sample("pagoda_operator_reconcile_total", trigger="t", result="error") == err + 1
    assert sample("pagoda_operator_reconcile_errors_total", trigger="t", error="RuntimeError") == 1
    assert sample("pagoda_operator_reconcile_seconds_count", trigger="t") == 2


def test_an_agent_may_write_only_its_own_lease() -> None:
    policy = next(d for d in render() if d["metadata"]["name"] == "pagoda-agent-own-lease")
    assert policy["kind"] == "ValidatingAdmissionPolicy"
    rules = policy["spec"]["matchConstraints"]["resourceRules"]
    assert rules == [
        {
            "apiGroups": ["coordination.k8s.io"],
            "apiVersions": ["v1"],
            "operations": ["CREATE", "UPDATE"],
            "resources": ["leases"],
        }
    ]
    mine = {"metadata": {"name": "m-decode-1"}, "spec": {"holderIdentity": "m-decode-1"}}
    theirs = {"metadata": {"name": "m-decode-2"}, "spec": {"holderIdentity": "m-decode-1"}}
    assert _admitted(policy, AGENT, "m-decode-1", mine, mine)
    assert not _admitted(policy, AGENT, "m-decode-1", theirs, theirs)  # keeping another agent alive
    assert not _admitted(policy, AGENT, None, mine, mine)  # a token not bound to a pod
    assert _admitted(policy, "system:serviceaccount:kube-system:leader", None, theirs, theirs)
