"""Autoscaler metrics that exist: KEDA queries select the pool by stable labels (never a blue/green
slot's workload name), prometheus-adapter rules serve every HPA metric, and the GitOps production
overlay lets Prometheus scrape the pools it autoscales."""

from __future__ import annotations

import io
import re
import shutil
import subprocess

import helm_python
import pytest
import yaml
from op_schema import CHART, ROOT, admit, example

from pagoda.operator import children, render, scaling
from pagoda.operator.config import Config
from pagoda.operator.spec import parse

KEDA = Config(autoscaler="keda", prometheus_address="http://prom:9090")
AUTO = {"maxReplicas": 8, "targets": {"waitingRequests": 4, "kvCacheUsage": 0.8, "ttftSeconds": 2}}
MATCHER = re.compile(r'([a-z_]+)="([^"]*)"')


def scaled_objects(slot: str) -> dict[str, dict]:
    meta = {"name": "m", "namespace": "ns", "uid": "u"}
    spec = parse(admit(example("m", prefill={"autoscaling": AUTO}, decode={"autoscaling": AUTO}))["spec"])
    objs = children.scaling_children(meta, spec, KEDA, {"prefill": slot, "decode": slot})
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == "ScaledObject"}


@pytest.mark.parametrize("slot", [children.BLUE, children.GREEN])
def test_keda_queries_select_the_pool_by_stable_labels(slot: str) -> None:
    for pool in ("prefill", "decode"):
        so = scaled_objects(slot)[f"m-{pool}"]
        assert so["spec"]["scaleTargetRef"]["name"] == children.pool_deployment_name("m", pool, slot)
        for trigger in so["spec"]["triggers"]:
            query = trigger["metadata"]["query"]
            assert "-green" not in query and "service=" not in query
            matchers = set(MATCHER.findall(query))
            assert matchers == {("namespace", "ns"), (scaling.MD_TARGET_LABEL, "m"), ("pool", pool)}
            assert trigger["metadata"]["ignoreNullValues"] == "false"  # empty: an error, not 0


def test_the_chart_renders_adapter_rules_for_every_hpa_metric() -> None:
    chart = helm_python.Chart.load(str(CHART))
    values = {"metrics": {"adapterRules": {"enabled": True, "namespace": "monitoring"}}}
    docs = [
        d
        for path, text in chart.render(values, name="pagoda", namespace="pagoda-system").items()
        if path.endswith("adapter-rules.yaml")
        for d in yaml.safe_load_all(text)
        if d
    ]
    (cm,) = docs
    assert cm["kind"] == "ConfigMap" and cm["metadata"]["namespace"] == "monitoring"
    rules = yaml.safe_load(cm["data"]["config.yaml"])["rules"]
    assert {r["name"]["as"] for r in rules} == set(scaling.HPA_METRICS.values())
    exported = set(
        re.findall(r'"(pagoda_[a-z_0-9]+)"', (ROOT / "node_agent/serving/api/metrics.py").read_text())
    )
    for rule in rules:
        assert rule["resources"]["overrides"] == {
            "namespace": {"resource": "namespace"},
            "pod": {"resource": "pod"},
        }
        for series in re.findall(r"pagoda_[a-z_]+", rule["seriesQuery"] + rule["metricsQuery"]):
            assert re.sub(r"_bucket$", "", series) in exported, series  # series the agents export
    off = chart.render({}, name="pagoda", namespace="pagoda-system")
    assert not any(path.endswith("adapter-rules.yaml") and text.strip() for path, text in off.items())


@pytest.mark.skipif(
    shutil.which("kubectl") is None, reason="kubectl (for `kubectl kustomize`) is not installed"
)
def test_the_production_overlay_lets_prometheus_scrape_what_it_autoscales() -> None:
    built = subprocess.run(
        ["kubectl", "kustomize", str(ROOT / "examples" / "gitops" / "overlays" / "production")],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    out = io.StringIO()
    render.render(io.StringIO(built), None, Config(), out)
    objs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(out.getvalue()) if d}
    hpa = objs[("HorizontalPodAutoscaler", "smollm-decode")]
    metrics = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]}
    assert metrics and metrics <= set(scaling.HPA_METRICS.values())  # the adapter rules serve them
    policy = objs[("NetworkPolicy", "smollm-decode")]
    scrape = [
        rule
        for rule in policy["spec"]["ingress"]
        if any("namespaceSelector" in peer for peer in rule["from"])
        and rule["ports"] == [{"protocol": "TCP", "port": children.PORT}]
    ]
    (rule,) = scrape
    assert rule["from"][0]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}
