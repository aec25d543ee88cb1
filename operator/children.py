"""Manifests of the objects one ModelDeployment owns: pools, router, services, agent RBAC,
network policies.

Everything here is a pure function of the ModelDeployment and the operator settings, so the
reconciler can compare what it builds with what the cluster holds. The agents take their whole
configuration from their command line (``agent_args``) and environment (``agent_env``), both in the
pod template, so every change an agent must see rolls its pods and nothing else does.

The one child that is not built here is the ``<md>-internal`` Secret: its data is random, so it is
created once by ``credentials.py``; the pods reference it by name, and its uid (which changes only
when the Secret is deleted and created anew) enters the pod templates so that a new Secret rolls
every pod.
"""

from __future__ import annotations

import copy
from typing import Any

from .config import Config
from .spec import API_VERSION, GROUP, KIND, PLURAL, Pool, Spec

PORT = 8000
KV_PORT = 9000  # decode pods receive KV pages from prefill pods here
MANAGED_BY = "pagoda-operator"
MD_LABEL = "pagoda.dev/model-deployment"
POOL_LABEL = "pagoda.dev/pool"
HANDOFF_ANNOTATION = "pagoda.dev/handoff"
INTERNAL_SECRET_ANNOTATION = "pagoda.dev/internal-secret-uid"
MODEL_MOUNT = "/mnt/models"
INTERNAL = "internal"  # component of the operator-generated Secret
INTERNAL_TOKEN_KEY = "internal-token"
TENANT_SECRET_KEY = "tenant-secret"
API_KEYS_DIR = "/etc/pagoda/api-keys"
API_KEYS_FILE = f"{API_KEYS_DIR}/keys"
API_KEYS_MODE = 0o440  # owner and group (fsGroup 1000) read, nobody else

Obj = dict[str, Any]


def selector(name: str, component: str) -> dict[str, str]:
    """Labels that select the pods of one component of one ModelDeployment."""
    return {MD_LABEL: name, POOL_LABEL: component}


def labels(name: str, component: str) -> dict[str, str]:
    """Full label set of a child object."""
    return {
        "app.kubernetes.io/name": "pagoda",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        **selector(name, component),
    }


def owner_reference(meta: Obj) -> Obj:
    """The ownerReference that makes a child go away with its ModelDeployment."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(meta: Obj, name: str, component: str) -> Obj:
    return {
        "name": name,
        "namespace": meta["namespace"],
        "labels": labels(meta["name"], component),
        "ownerReferences": [owner_reference(meta)],
    }


def child_name(md_name: str, component: str) -> str:
    """Name of a child: ``<md>-prefill``, ``-decode``, ``-router``, ``-agent``, ``-internal``."""
    return f"{md_name}-{component}"


def service_url(md_name: str, namespace: str, pool: str) -> str:
    """In-cluster URL of a pool's Service."""
    return f"http://{child_name(md_name, pool)}.{namespace}.svc:{PORT}"


def model_argument(source: str) -> str:
    """The --model value inside the pod: pvc:// sources become the mounted directory."""
    if source.startswith("pvc://"):
        _claim, _, path = source[len("pvc://") :].partition("/")
        return f"hf-dir://{MODEL_MOUNT}/{path}"
    return source


def agent_args(spec: Spec, role: str, md_name: str = "", namespace: str = "") -> list[str]:
    """Command line of ``pagoda serve`` for one role (prefill, decode or router)."""
    pool = spec.decode if role == "router" else spec.pool(role)
    args = [
        "serve",
        "--role",
        role,
        "--model",
        model_argument(spec.source),
        "--host",
        "0.0.0.0",
        "--port",
        str(PORT),
        "--prefill-weights",
        spec.prefill.weight_format,
        "--prefill-kv",
        spec.prefill.kv_cache_format,
        "--decode-weights",
        spec.decode.weight_format,
        "--decode-kv",
        spec.decode.kv_cache_format,
        "--integrity",
        spec.integrity.mode,
        "--kv-memory-fraction",
        str(pool.kv_memory_fraction),
        "--max-num-seqs",
        str(pool.max_concurrency),
        "--tensor-parallel",
        str(1 if role == "router" else pool.tensor_parallel),
        "--tenant-header",
        spec.routing.tenant_header,
    ]
    if not spec.routing.prefix_caching:
        args.append("--no-prefix-caching")
    if not spec.routing.session_affinity:
        args.append("--no-session-affinity")
    if role == "decode":
        args += ["--kv-port", str(KV_PORT)]
    if role == "router":
        if spec.routing.trust_tenant_header:
            args.append("--trust-tenant-header")
        args += [
            "--prefill-endpoints",
            service_url(md_name, namespace, "prefill"),
            "--decode-endpoints",
            service_url(md_name, namespace, "decode"),
        ]
    return args


def agent_env(meta: Obj, role: str, cfg: Config, spec: Spec | None = None) -> list[Obj]:
    """Environment of an agent container: the reporter's settings, the shared internal secrets
    (by reference to ``<md>-internal``) and, on the router, the path of the API keys file."""

    def field(path: str) -> Obj:
        return {"fieldRef": {"apiVersion": "v1", "fieldPath": path}}

    def internal(key: str) -> Obj:
        return {"secretKeyRef": {"name": child_name(meta["name"], INTERNAL), "key": key}}

    env = [
        {"name": "PAGODA_MD_NAME", "value": meta["name"]},
        {"name": "PAGODA_MD_NAMESPACE", "value": meta["namespace"]},
        {"name": "PAGODA_POOL", "value": role},
        {"name": "PAGODA_POD_NAME", "valueFrom": field("metadata.name")},
        {"name": "PAGODA_NODE_NAME", "valueFrom": field("spec.nodeName")},
        {"name": "PAGODA_REPORT_INTERVAL_S", "value": str(cfg.report_interval_s)},
        {"name": "PAGODA_INTERNAL_TOKEN", "valueFrom": internal(INTERNAL_TOKEN_KEY)},
        {"name": "PAGODA_TENANT_SECRET", "valueFrom": internal(TENANT_SECRET_KEY)},
    ]
    if role == "router" and spec is not None and spec.auth.api_keys_secret is not None:
        env.append({"name": "PAGODA_API_KEYS_FILE", "value": API_KEYS_FILE})
    return env


def _fp8_affinity(user: Obj, cfg: Config) -> Obj:
    """User affinity with an extra required node term for FP8-capable GPU products.

    Required node selector terms are ORed, the expressions inside one term ANDed, so the FP8
    expression is added to every user term (or forms the only term).
    """
    affinity = copy.deepcopy(user)
    expr = {"key": cfg.fp8_node_label, "operator": "In", "values": list(cfg.fp8_products)}
    node = affinity.setdefault("nodeAffinity", {})
    required = node.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.get("nodeSelectorTerms") or [{}]
    for term in terms:
        term.setdefault("matchExpressions", []).append(expr)
    required["nodeSelectorTerms"] = terms
    return affinity


def _resources(pool: Pool) -> Obj:
    res = copy.deepcopy(pool.resources)
    if pool.gpus > 0:
        res.setdefault("limits", {})["nvidia.com/gpu"] = pool.gpus
        res.setdefault("requests", {})["nvidia.com/gpu"] = pool.gpus
    return res


def _volumes(spec: Spec, role: str) -> tuple[list[Obj], list[Obj]]:
    volumes: list[Obj] = []
    mounts: list[Obj] = []
    if spec.source.startswith("pvc://"):
        claim = spec.source[len("pvc://") :].partition("/")[0]
        volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True})
    ref = spec.auth.api_keys_secret
    if role == "router" and ref is not None:
        # Only the one key, as a file in a directory mount (not subPath): the kubelet swaps the
        # directory's contents when the Secret changes, so the router sees new keys without a restart.
        secret = {
            "secretName": ref.name,
            "items": [{"key": ref.key, "path": API_KEYS_FILE.rsplit("/", 1)[1]}],
            "defaultMode": API_KEYS_MODE,
        }
        volumes.append({"name": "api-keys", "secret": secret})
        mounts.append({"name": "api-keys", "mountPath": API_KEYS_DIR, "readOnly": True})
    return volumes, mounts


def _container(meta: Obj, spec: Spec, role: str, cfg: Config, mounts: list[Obj], resources: Obj) -> Obj:
    probe = {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10, "failureThreshold": 6}
    ready = {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 5, "failureThreshold": 3}
    container: Obj = {
        "name": "agent",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["pagoda"],
        "args": agent_args(spec, role, meta["name"], meta["namespace"]),
        "env": agent_env(meta, role, cfg, spec),
        "ports": [{"name": "http", "containerPort": PORT, "protocol": "TCP"}],
        "livenessProbe": probe,
        "readinessProbe": ready,
        "startupProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 10,
            "failureThreshold": 90,
        },
        "resources": resources,
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }
    if role == "decode":
        container["ports"].append({"name": "kv", "containerPort": KV_PORT, "protocol": "TCP"})
    # Empty lists are left out, as the API server leaves them out: an empty list set here would
    # never be found on the live object, and every pass would patch it again.
    if mounts:
        container["volumeMounts"] = mounts
    return container


def deployment(meta: Obj, spec: Spec, role: str, cfg: Config, internal_uid: str | None = None) -> Obj:
    """Deployment ``<md>-<role>`` of node-agent pods for a pool or the router.

    ``internal_uid`` is the uid of the live ``<md>-internal`` Secret: a new Secret rolls the pods.
    """
    name = meta["name"]
    volumes, mounts = _volumes(spec, role)
    pod_spec: Obj = {
        "serviceAccountName": child_name(name, "agent"),
        "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "fsGroup": 1000},
    }
    if volumes:
        pod_spec["volumes"] = volumes
    if role == "router":
        replicas = spec.router.replicas
        pod_spec["containers"] = [
            _container(meta, spec, role, cfg, mounts, {"requests": {"cpu": "250m", "memory": "512Mi"}})
        ]
    else:
        pool = spec.pool(role)
        replicas = pool.replicas
        pod_spec["containers"] = [_container(meta, spec, role, cfg, mounts, _resources(pool))]
        if pool.node_selector:
            pod_spec["nodeSelector"] = dict(pool.node_selector)
        tolerations = list(pool.tolerations)
        if pool.gpus > 0:
            tolerations.append({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"})
        if tolerations:
            pod_spec["tolerations"] = tolerations
        affinity = _fp8_affinity(pool.affinity, cfg) if pool.uses_fp8 and pool.gpus > 0 else pool.affinity
        if affinity:
            pod_spec["affinity"] = affinity
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(meta, child_name(name, role), role),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector(name, role)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {
                    "labels": labels(name, role),
                    "annotations": {
                        HANDOFF_ANNOTATION: spec.handoff,
                        **({INTERNAL_SECRET_ANNOTATION: internal_uid} if internal_uid else {}),
                    },
                },
                "spec": pod_spec,
            },
        },
    }


def service(meta: Obj, spec: Spec, role: str) -> Obj:
    """Service ``<md>-<role>``; the router's type and port come from the spec."""
    svc_spec: Obj = {
        "type": "ClusterIP",
        "selector": selector(meta["name"], role),
        "ports": [{"name": "http", "port": PORT, "targetPort": "http", "protocol": "TCP"}],
    }
    if role == "router":
        svc_spec["type"] = spec.router.service_type
        svc_spec["ports"][0]["port"] = spec.router.port
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(meta, child_name(meta["name"], role), role),
        "spec": svc_spec,
    }


def agent_rbac(meta: Obj) -> list[Obj]:
    """ServiceAccount, Role and RoleBinding letting the agents get and patch this object's status only."""
    name = child_name(meta["name"], "agent")
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _metadata(meta, name, "agent")},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": _metadata(meta, name, "agent"),
            "rules": [
                {
                    "apiGroups": [GROUP],
                    "resources": [f"{PLURAL}/status"],
                    "resourceNames": [meta["name"]],
                    "verbs": ["get", "patch"],
                }
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": _metadata(meta, name, "agent"),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": meta["namespace"]}],
        },
    ]


def _peer(md_name: str, component: str) -> Obj:
    return {"podSelector": {"matchLabels": selector(md_name, component)}}


def _tcp(port: int) -> Obj:
    return {"protocol": "TCP", "port": port}


def network_policies(meta: Obj, spec: Spec) -> list[Obj]:
    """Ingress fences of the pools (none when ``spec.networkPolicy.enabled`` is false).

    Decode pods: the router on http (its ``/internal/decode`` calls), prefill pods on kv (the KV
    pages). Prefill pods: the router on http. The ``metricsFrom`` peers may reach http on both
    pools (Prometheus scraping ``/metrics``). The router is not selected: clients reach it as before.
    Egress is not restricted (the agents patch their status on the API server).
    """
    if not spec.network_policy.enabled:
        return []
    name = meta["name"]
    peers = [copy.deepcopy(p) for p in spec.network_policy.metrics_from]
    metrics = [{"from": peers, "ports": [_tcp(PORT)]}] if peers else []
    rules = {
        "decode": [
            {"from": [_peer(name, "router")], "ports": [_tcp(PORT)]},
            {"from": [_peer(name, "prefill")], "ports": [_tcp(KV_PORT)]},
        ],
        "prefill": [{"from": [_peer(name, "router")], "ports": [_tcp(PORT)]}],
    }
    return [
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": _metadata(meta, child_name(name, role), role),
            "spec": {
                "podSelector": {"matchLabels": selector(name, role)},
                "policyTypes": ["Ingress"],
                "ingress": ingress + metrics,
            },
        }
        for role, ingress in rules.items()
    ]


def build(meta: Obj, spec: Spec, cfg: Config, internal_uid: str | None = None) -> dict[str, Obj]:
    """All children keyed by ``Kind/name``, in the order they should be applied (the network
    policies before the pods they fence)."""
    objs = agent_rbac(meta) + network_policies(meta, spec)
    for role in ("decode", "prefill", "router"):
        objs.append(deployment(meta, spec, role, cfg, internal_uid))
        objs.append(service(meta, spec, role))
    return {f"{o['kind']}/{o['metadata']['name']}": o for o in objs}
