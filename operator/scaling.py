"""Children that scale and protect a pool: HorizontalPodAutoscaler or KEDA ScaledObject for an
autoscaled pool, and a PodDisruptionBudget per pool and for the router.

The autoscaler targets the pool's Deployment itself (its scale subresource): a ModelDeployment has
two independently scaled pools, which one CRD scale subresource cannot express.

Every metric query selects the pool by labels that do not change with a blue/green format change:
the namespace, the ModelDeployment (the ServiceMonitor's target label ``pagoda_dev_model_deployment``)
and the pool (the ``pool`` label every agent series carries). The scrape reaches only the pods the
pool's Service selects, i.e. the serving generation; a slot's workload name never enters a query.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from .config import Config
from .spec import Autoscaling, DisruptionBudget

Obj = dict[str, Any]

# HPA Pods metrics (served by prometheus-adapter rules: the chart's metrics.adapterRules) per target.
HPA_METRICS = {
    "waiting_requests": "pagoda_waiting_sequences",
    "kv_cache_usage": "pagoda_kv_cache_usage_ratio",
    "ttft_seconds": "pagoda_time_to_first_token_seconds_p90",
    "itl_seconds": "pagoda_inter_token_latency_seconds_p90",
}
# The Prometheus label the chart's ServiceMonitor copies from the pool Services' pagoda.dev/model-deployment.
MD_TARGET_LABEL = "pagoda_dev_model_deployment"
SCALE_DOWN_WINDOW_S = 300  # no scale-down before 5 minutes of lower load: pods load a model


def quantity(value: float) -> str:
    """A non-negative number as a Kubernetes quantity: "4", "500m", "1500m"."""
    milli = int((Decimal(str(value)) * 1000).to_integral_value())
    return str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"


def _target(name: str, kind: str, api_version: str) -> Obj:
    return {"apiVersion": api_version, "kind": kind, "name": name}


def hpa(
    metadata: Obj, deployment: str, auto: Autoscaling, kind: str = "Deployment", api_version: str = "apps/v1"
) -> Obj:
    """autoscaling/v2 HPA of one pool, one Pods metric per target (AverageValue per pod)."""
    metrics = [
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": HPA_METRICS[name]},
                "target": {"type": "AverageValue", "averageValue": quantity(value)},
            },
        }
        for name, value in auto.targets.items()
    ]
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": metadata,
        "spec": {
            "scaleTargetRef": _target(deployment, kind, api_version),
            "minReplicas": auto.min_replicas,
            "maxReplicas": auto.max_replicas,
            "metrics": metrics,
            "behavior": {"scaleDown": {"stabilizationWindowSeconds": SCALE_DOWN_WINDOW_S}},
        },
    }


def pool_selector(namespace: str, md_name: str, pool: str) -> str:
    """The PromQL label matchers of one pool's series: stable across format changes."""
    return f'namespace="{namespace}",{MD_TARGET_LABEL}="{md_name}",pool="{pool}"'


def _queries(namespace: str, md_name: str, pool: str) -> dict[str, tuple[str, str]]:
    """PromQL per target and KEDA's metricType: sums are divided per pod, ratios and quantiles not."""
    sel = pool_selector(namespace, md_name, pool)

    def p90(metric: str) -> str:
        return f"histogram_quantile(0.9, sum by (le) (rate({metric}_bucket{{{sel}}}[2m])))"

    return {
        "waiting_requests": (f"sum(pagoda_waiting_sequences{{{sel}}})", "AverageValue"),
        "kv_cache_usage": (
            f"sum(pagoda_kv_used_tokens{{{sel}}}) / clamp_min(sum(pagoda_kv_capacity_tokens{{{sel}}}), 1)",
            "Value",
        ),
        "ttft_seconds": (p90("pagoda_time_to_first_token_seconds"), "Value"),
        "itl_seconds": (p90("pagoda_inter_token_latency_seconds"), "Value"),
    }


def scaled_object(
    metadata: Obj,
    deployment: str,
    auto: Autoscaling,
    cfg: Config,
    kind: str = "Deployment",
    api_version: str = "apps/v1",
) -> Obj:
    """KEDA ScaledObject of one pool: Prometheus triggers over the pool's scrape (selected by the
    ModelDeployment and pool labels). ``ignoreNullValues: "false"``: an empty result (no series,
    e.g. a scrape that stopped) is an error, so KEDA keeps the current scale instead of reading 0."""
    labels = metadata.get("labels") or {}
    md_name = labels.get("pagoda.dev/model-deployment", "")
    pool = labels.get("pagoda.dev/pool", "")
    queries = _queries(metadata["namespace"], md_name, pool)
    triggers = [
        {
            "type": "prometheus",
            "name": name.replace("_", "-"),
            "metricType": queries[name][1],
            "metadata": {
                "serverAddress": cfg.prometheus_address,
                "query": queries[name][0],
                "threshold": str(value),
                "ignoreNullValues": "false",
            },
        }
        for name, value in auto.targets.items()
    ]
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": metadata,
        "spec": {
            "scaleTargetRef": _target(deployment, kind, api_version),
            "minReplicaCount": auto.min_replicas,
            "maxReplicaCount": auto.max_replicas,
            "advanced": {
                "horizontalPodAutoscalerConfig": {
                    "behavior": {"scaleDown": {"stabilizationWindowSeconds": SCALE_DOWN_WINDOW_S}}
                }
            },
            "triggers": triggers,
        },
    }


def autoscaler(
    metadata: Obj,
    deployment: str,
    auto: Autoscaling,
    cfg: Config,
    kind: str = "Deployment",
    api_version: str = "apps/v1",
) -> Obj:
    """The pool's HPA, or its ScaledObject when the operator runs with PAGODA_AUTOSCALER=keda. The
    target is the pool's Deployment, or its LeaderWorkerSet (whose scale subresource counts groups
    and selects the leaders, so per-pod targets are per replica)."""
    if cfg.autoscaler == "keda":
        return scaled_object(metadata, deployment, auto, cfg, kind, api_version)
    return hpa(metadata, deployment, auto, kind, api_version)


def disruption_budget(metadata: Obj, selector: dict[str, str], budget: DisruptionBudget) -> Obj:
    """policy/v1 PodDisruptionBudget: voluntary evictions (drains, upgrades) take at most
    ``maxUnavailable`` pods of the pool at once."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata,
        "spec": {
            "maxUnavailable": budget.max_unavailable,
            "selector": {"matchLabels": dict(selector)},
            # Pods not ready yet (a pool that never came up) may be evicted: they serve nothing.
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }
