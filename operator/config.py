"""Operator settings, read from the environment (the Helm chart sets them)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

FP8_PLACEMENTS = ("computeCapability", "label", "none")
AUTOSCALERS = ("hpa", "keda")


def _flag(value: str | None, default: bool) -> bool:
    if value is None or value == "":
        return default
    return value.strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Config:
    """What the operator needs beyond the ModelDeployment itself."""

    resync_s: float = 10.0
    stale_after_s: float = 60.0
    report_interval_s: int = 10
    # FP8 placement: "computeCapability" (GPU feature discovery's compute capability >= 8.9),
    # "label" (nodes carrying fp8_node_label=true) or "none".
    fp8_placement: str = "computeCapability"
    fp8_node_label: str = "pagoda.dev/fp8"
    namespaces: tuple[str, ...] = field(default_factory=tuple)
    autoscaler: str = "hpa"  # or "keda": ScaledObjects instead of HPAs
    prometheus_address: str = "http://prometheus-operated.monitoring.svc:9090"  # KEDA's query endpoint
    cluster_domain: str = "cluster.local"
    status_max_agents: int = 16  # per-agent entries kept in the CR status, worst first
    install_crd: bool = True  # server-side apply the CRD at start
    shift_settle_s: float = 15.0  # format change: between moving the two pools' Services, and before removal
    crd_file: str = ""  # empty: crds/modeldeployment.yaml next to the package, else /app/crds
    # The chart's agent ClusterRole (cluster mode): bound per ModelDeployment instead of a Role.
    agent_cluster_role: str = ""
    metrics_port: int = 0  # the operator's Prometheus metrics port; 0: not served
    # How long a Secret found by a pass is answered from memory (Secrets are not watched).
    secret_cache_s: float = 60.0
    # The quality gate: a template of the score endpoint's base URL (fields namespace, md, pool,
    # slot, generation, role, port); empty: a ready pod's IP. Per-request timeout, retry pause.
    quality_score_url: str = ""
    quality_request_s: float = 120.0
    quality_retry_s: float = 10.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Config:
        """Build the settings from PAGODA_* variables; unset ones keep their defaults."""
        env = os.environ if env is None else env
        namespaces = env.get("PAGODA_WATCH_NAMESPACES", "")
        placement = env.get("PAGODA_FP8_PLACEMENT") or cls.fp8_placement
        if placement not in FP8_PLACEMENTS:
            raise ValueError(f"PAGODA_FP8_PLACEMENT {placement!r} is not one of {FP8_PLACEMENTS}")
        autoscaler = env.get("PAGODA_AUTOSCALER") or cls.autoscaler
        if autoscaler not in AUTOSCALERS:
            raise ValueError(f"PAGODA_AUTOSCALER {autoscaler!r} is not one of {AUTOSCALERS}")
        score_url = env.get("PAGODA_QUALITY_SCORE_URL", cls.quality_score_url).strip()
        try:
            score_url.format(namespace="", md="", pool="", slot="", generation="", role="", port=0)
        except (KeyError, IndexError, ValueError) as err:
            raise ValueError(
                f"PAGODA_QUALITY_SCORE_URL {score_url!r}: only the fields namespace, md, pool, slot, "
                f"generation, role and port ({err!r})"
            ) from None
        max_agents = int(env.get("PAGODA_STATUS_MAX_AGENTS", cls.status_max_agents))
        if not 0 <= max_agents <= 256:
            raise ValueError("PAGODA_STATUS_MAX_AGENTS must be within 0-256")
        return cls(
            resync_s=float(env.get("PAGODA_RESYNC_S", cls.resync_s)),
            stale_after_s=float(env.get("PAGODA_STALE_AFTER_S", cls.stale_after_s)),
            report_interval_s=int(env.get("PAGODA_REPORT_INTERVAL_S", cls.report_interval_s)),
            fp8_placement=placement,
            fp8_node_label=env.get("PAGODA_FP8_NODE_LABEL") or cls.fp8_node_label,
            namespaces=tuple(n.strip() for n in namespaces.split(",") if n.strip()),
            autoscaler=autoscaler,
            prometheus_address=env.get("PAGODA_PROMETHEUS_ADDRESS") or cls.prometheus_address,
            cluster_domain=env.get("PAGODA_CLUSTER_DOMAIN") or cls.cluster_domain,
            status_max_agents=max_agents,
            install_crd=_flag(env.get("PAGODA_INSTALL_CRD"), cls.install_crd),
            crd_file=env.get("PAGODA_CRD_FILE", cls.crd_file),
            shift_settle_s=float(env.get("PAGODA_SHIFT_SETTLE_S", cls.shift_settle_s)),
            agent_cluster_role=env.get("PAGODA_AGENT_CLUSTER_ROLE", cls.agent_cluster_role).strip(),
            metrics_port=int(env.get("PAGODA_METRICS_PORT") or cls.metrics_port),
            secret_cache_s=float(env.get("PAGODA_SECRET_CACHE_S") or cls.secret_cache_s),
            quality_score_url=score_url,
            quality_request_s=float(env.get("PAGODA_QUALITY_REQUEST_S") or cls.quality_request_s),
            quality_retry_s=float(env.get("PAGODA_QUALITY_RETRY_S") or cls.quality_retry_s),
        )
