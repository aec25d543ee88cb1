"""The Helm chart rendered with Helm's own engine (helm-python-sdk); every object schema-checked."""

from __future__ import annotations

import json
import pathlib
import re

import helm_python
import jsonschema
import kubernetes_validate
import pytest
import yaml
from op_schema import CHART, admit

SCHEMAS = pathlib.Path(__file__).parent / "schemas"
K8S_VERSION = "1.33"
METRICS = (
    "pagoda_kv_pages_used",
    "pagoda_kv_pages_total",
    "pagoda_kv_capacity_tokens",
    "pagoda_generation_tokens_total",
    "pagoda_time_to_first_token_seconds",
    "pagoda_inter_token_latency_seconds",
    "pagoda_integrity_checks_total",
    "pagoda_integrity_mismatches_total",
)
# The continuous quality probe's gauges (engine pods export them when probeInterval > 0): alerted on,
# not yet on the dashboard.
QUALITY_METRICS = ("pagoda_quality_kl", "pagoda_quality_top1")


@pytest.fixture(scope="module")
def chart() -> helm_python.Chart:
    return helm_python.Chart.load(str(CHART))


def render(chart: helm_python.Chart, values: dict | None = None) -> list[dict]:
    out = chart.render(values or {}, name="pagoda", namespace="pagoda-system")
    docs = []
    for path, text in out.items():
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def validate(obj: dict) -> None:
    if obj["apiVersion"] == "monitoring.coreos.com/v1":
        name = {"ServiceMonitor": "servicemonitor", "PrometheusRule": "prometheusrule"}[obj["kind"]]
        schema = json.loads((SCHEMAS / f"{name}-monitoring-v1.json").read_text())
        jsonschema.validate(obj, schema)
    else:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


NON_DEFAULT = {
    "operator": {
        "image": {"repository": "registry.example/pagoda-operator", "tag": "1.2.3", "pullPolicy": "Always"},
        "watchNamespaces": ["team-a", "team-b"],
        "resyncSeconds": 5,
        "nodeSelector": {"role": "infra"},
        "tolerations": [{"key": "infra", "operator": "Exists", "effect": "NoSchedule"}],
        "podAnnotations": {"example.com/owner": "ml"},
    },
    "agent": {"reportIntervalSeconds": 30},
    "fp8": {"placement": "label", "nodeLabel": "example.com/fp8"},
    "autoscaling": {"provider": "keda", "prometheusAddress": "http://prom.obs.svc:9090"},
    "metrics": {
        "serviceMonitor": {"enabled": True, "interval": "15s", "labels": {"release": "prom"}},
        "prometheusRule": {"enabled": True, "labels": {"release": "prom"}, "highMismatchRate": 0.05},
    },
    "dashboard": {"enabled": True},
}


def test_default_render_is_valid(chart: helm_python.Chart) -> None:
    docs = render(chart)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == [
        "ClusterRole",  # agent (bound per ModelDeployment)
        "ClusterRole",  # ModelDeployments for the aggregated edit/admin roles
        "ClusterRole",  # ModelDeployments for the aggregated view role
        "ClusterRole",  # operator
        "ClusterRole",  # operator: its CRD
        "ClusterRoleBinding",
        "ClusterRoleBinding",
        "Deployment",
        "Service",  # the operator's metrics
        "ServiceAccount",
        "ValidatingAdmissionPolicy",  # an agent's own pod
        "ValidatingAdmissionPolicy",  # an agent's own Lease
        "ValidatingAdmissionPolicyBinding",
        "ValidatingAdmissionPolicyBinding",
    ]
    for doc in docs:
        validate(doc)
    dep = next(d for d in docs if d["kind"] == "Deployment")
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "pagoda/operator:0.1.0"
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["PAGODA_WATCH_NAMESPACES"] == "" and env["PAGODA_STALE_AFTER_S"] == "60"


def test_non_default_render_is_valid(chart: helm_python.Chart) -> None:
    docs = render(chart, NON_DEFAULT)
    # By kind; of the two ServiceMonitors, the agents' (the operator's: test_least_privilege.py).
    operator_monitor = ("ServiceMonitor", "pagoda-operator")
    by_kind = {d["kind"]: d for d in docs if (d["kind"], d["metadata"]["name"]) != operator_monitor}
    assert {"ServiceMonitor", "ConfigMap", "PrometheusRule"} <= set(by_kind)
    for doc in docs:
        validate(doc)
    container = by_kind["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "registry.example/pagoda-operator:1.2.3"
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["PAGODA_WATCH_NAMESPACES"] == "team-a,team-b"
    assert env["PAGODA_FP8_PLACEMENT"] == "label" and env["PAGODA_REPORT_INTERVAL_S"] == "30"
    assert by_kind["ServiceMonitor"]["metadata"]["labels"]["release"] == "prom"
    dashboard = json.loads(by_kind["ConfigMap"]["data"]["pagoda.json"])
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    for metric in METRICS:
        assert metric in exprs
    assert {"KV cache usage", "Generated tokens/s", "KV integrity mismatch rate"} <= {
        p["title"] for p in dashboard["panels"]
    }


def monitor_target_label(docs: list[dict]) -> str:
    agents = next(
        d for d in docs if d["kind"] == "ServiceMonitor" and d["metadata"]["name"] == "pagoda-agents"
    )
    (label,) = agents["spec"]["targetLabels"]
    return label


def test_prometheus_rules_alert_on_integrity_and_stale_agents(chart: helm_python.Chart) -> None:
    rule = next(d for d in render(chart, NON_DEFAULT) if d["kind"] == "PrometheusRule")
    rules = {r.get("alert") or r["record"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    assert {"PagodaKVIntegrityDegraded", "PagodaHighMismatchRate", "PagodaStaleAgents"} <= set(rules)
    assert rules["PagodaHighMismatchRate"]["expr"].endswith("> 0.05")
    assert rules["PagodaKVIntegrityDegraded"]["expr"].endswith("> 0.0001")
    assert rules["PagodaQualityDrift"]["expr"].endswith("(pagoda_quality_kl) > 0.02")  # the gate's defaults
    assert rules["PagodaQualityTop1Low"]["expr"].endswith("(pagoda_quality_top1) < 0.9")
    exprs = " ".join(r["expr"] for r in rules.values())
    for metric in re.findall(r"pagoda_[a-z0-9_]+", exprs):
        if metric != "pagoda_dev_model_deployment":  # the ServiceMonitor's target label, not a metric
            assert metric in METRICS + QUALITY_METRICS, metric  # only metrics the agents export
    # Stale agents: only targets of the chart's ServiceMonitor (they carry its target label).
    assert rules["PagodaStaleAgents"]["expr"] == 'up{pagoda_dev_model_deployment!=""} == 0'
    assert monitor_target_label(render(chart, NON_DEFAULT)) == "pagoda.dev/model-deployment"
    monitor = next(
        d
        for d in render(chart, NON_DEFAULT)
        if d["kind"] == "ServiceMonitor" and d["metadata"]["name"] == "pagoda-agents"
    )
    # The headless per-pod Services select the same pods: the monitor skips them (no double scrape).
    assert monitor["spec"]["selector"]["matchExpressions"] == [
        {"key": "pagoda.dev/headless", "operator": "DoesNotExist"}
    ]
    assert "PrometheusRule" not in {d["kind"] for d in render(chart)}


def test_operator_config_from_chart_env_is_read_by_the_operator(chart: helm_python.Chart) -> None:
    from pagoda.operator.config import Config

    dep = next(d for d in render(chart, NON_DEFAULT) if d["kind"] == "Deployment")
    env = {e["name"]: e["value"] for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    cfg = Config.from_env(env)
    assert cfg.namespaces == ("team-a", "team-b") and cfg.fp8_node_label == "example.com/fp8"
    assert cfg.fp8_placement == "label" and cfg.autoscaler == "keda" and cfg.install_crd is True
    assert cfg.prometheus_address == "http://prom.obs.svc:9090" and cfg.status_max_agents == 16
    assert cfg.resync_s == 5 and cfg.report_interval_s == 30 and cfg.stale_after_s == 60


def test_rbac_is_least_privilege(chart: helm_python.Chart) -> None:
    roles = {d["metadata"]["name"]: d for d in render(chart) if d["kind"] == "ClusterRole"}
    agent = roles["pagoda-agent"]["rules"]
    assert agent == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"]},  # its own report
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create", "patch"]},
    ]
    crd = roles["pagoda-operator-crd"]["rules"]
    assert crd == [
        {
            "apiGroups": ["apiextensions.k8s.io"],
            "resources": ["customresourcedefinitions"],
            "resourceNames": ["modeldeployments.pagoda.dev"],
            "verbs": ["get", "patch"],  # read (never downgrade), server-side apply of the one CRD
        }
    ]
    operator = roles["pagoda-operator"]["rules"]
    verbs = {
        (g, r): set(rule["verbs"]) for rule in operator for g in rule["apiGroups"] for r in rule["resources"]
    }
    assert all("*" not in v for v in verbs.values())
    # delete only for what a spec can turn off; the rest goes by ownerReferences
    assert sorted(key for key, v in verbs.items() if "delete" in v) == [
        ("apps", "deployments"),  # the old pair of a format change
        ("autoscaling", "horizontalpodautoscalers"),
        ("gateway.networking.k8s.io", "httproutes"),  # spec.router.gateway dropped
        ("inference.networking.k8s.io", "inferencepools"),
        ("leaderworkerset.x-k8s.io", "leaderworkersets"),  # a pool back to one node, or the old pair
        ("networking.k8s.io", "networkpolicies"),
        ("policy", "poddisruptionbudgets"),
        ("rbac.authorization.k8s.io", "rolebindings"),  # an earlier operator's Role and binding
        ("rbac.authorization.k8s.io", "roles"),
    ]
    assert verbs[("leaderworkerset.x-k8s.io", "leaderworkersets")] == {
        "get",
        "list",
        "watch",
        "create",
        "patch",
        "delete",
    }
    # Cluster mode: the agents' pod patch is bound from the chart's ClusterRole, not held.
    assert verbs[("", "pods")] == {"list"} and verbs[("", "events")] == {"create"}
    assert verbs[("coordination.k8s.io", "leases")] == {"list"}  # the agents' heartbeats, read only
    bind = [rule for rule in operator if rule["resources"] == ["clusterroles"]]
    assert bind == [
        {
            "apiGroups": ["rbac.authorization.k8s.io"],
            "resources": ["clusterroles"],
            "resourceNames": ["pagoda-agent"],
            "verbs": ["bind"],
        }
    ]
    assert verbs[("pagoda.dev", "modeldeployments/finalizers")] == {"update"}
    assert verbs[("pagoda.dev", "modeldeployments")] == {"get", "list", "watch", "patch"}
    # ConfigMaps: the quality gate's probe set (get) and <md>-quality-reference (create, patch);
    # never list/watch (every ConfigMap of the namespaces) nor delete (the garbage collector does).
    assert verbs[("", "configmaps")] == {"get", "create", "patch"}
    # Secrets: read by name and create <md>-internal; never list/watch (every Secret's data) or rewrite.
    assert verbs[("", "secrets")] == {"get", "create"}


def test_chart_ships_the_crd(chart: helm_python.Chart) -> None:
    names = [c["name"] for c in chart.crds]
    assert names == ["crds/modeldeployment.yaml"]


@pytest.mark.parametrize(
    "values",
    [
        {"operator": {"replicas": 2}},
        {"operator": {"logFormat": "xml"}},
        {"operator": {"image": {"repository": ""}}},
        {"operator": {"watchNamespaces": ["Not_A_Namespace"]}},
        {"agent": {"reportIntervalSeconds": 0}},
        {"fp8": {"placement": "gpuProducts"}},
        {"autoscaling": {"provider": "custom"}},
        {"metrics": {"serviceMonitor": {"interval": "soon"}}},
        {"metrics": {"prometheusRule": {"highMismatchRate": 2}}},
        {"agentPolicy": {"enabled": "yes"}},
        {"unknownKey": True},
    ],
)
def test_values_schema_rejects_bad_values(chart: helm_python.Chart, values: dict) -> None:
    with pytest.raises(helm_python.HelmError):
        chart.render(values, name="pagoda", namespace="pagoda-system")


def test_chart_examples_are_valid_modeldeployments() -> None:
    for path in (CHART / "examples").glob("*.yaml"):
        stored = admit(yaml.safe_load(path.read_text()))
        assert stored["kind"] == "ModelDeployment"


def test_the_crd_helm_installs_defaults_weight_formats_to_auto(chart: helm_python.Chart) -> None:
    """The CRD as Helm loads it from the chart: a ModelDeployment naming no weight format gets auto
    in both pools (the engine then picks per source), one naming a format keeps it."""
    crd = yaml.safe_load(chart.crds[0]["data"])
    body = yaml.safe_load((CHART / "examples" / "cpu-trial.yaml").read_text())
    named = admit(body, crd)["spec"]
    for pool in ("prefill", "decode"):
        del body["spec"][pool]["weightFormat"]
    stored = admit(body, crd)["spec"]
    assert stored["prefill"]["weightFormat"] == stored["decode"]["weightFormat"] == "auto"
    assert (named["prefill"]["weightFormat"], named["decode"]["weightFormat"]) == ("bf16", "int4")
