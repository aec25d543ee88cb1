"""Manifests of the objects one ModelDeployment owns: pools, router, services (ClusterIP and
headless per pool), agent RBAC, network policies, disruption budgets and autoscalers.

Everything here is a pure function of the ModelDeployment and the operator settings, so the
reconciler can compare what it builds with what the cluster holds. The agents take their whole
configuration from their command line (``agent_args``) and environment (``agent_env``), both in the
pod template, so every change an agent must see rolls its pods and nothing else does: replicas,
autoscaling, budgets and the operator's own settings live outside the pod templates, and each
role gets only the flags it reads (the router no formats, the engines no router flags).

The one child that is not built here is the ``<md>-internal`` Secret: its data is random, so it is
created once by ``credentials.py``; the pods reference it by name, and its uid (which changes only
when the Secret is deleted and created anew) enters the pod templates so that a new Secret rolls
every pod.
"""

from __future__ import annotations

import copy
import hashlib
from typing import Any

from . import gateway, podspec, scaling
from .config import Config
from .spec import API_VERSION, KIND, POOLS, Drain, Pool, Spec

PORT = 8000
KV_PORT = 9000  # decode pods receive KV pages from prefill pods here
MANAGED_BY = "pagoda-operator"
MD_LABEL = "pagoda.dev/model-deployment"
POOL_LABEL = "pagoda.dev/pool"
HANDOFF_ANNOTATION = "pagoda.dev/handoff"
FORMATS_LABEL = "pagoda.dev/formats"  # the pool pair's format generation; the pool Services select it
SLOT_LABEL = "pagoda.dev/slot"
BLUE, GREEN = "blue", "green"  # the two slots of a pool pair: <md>-<pool> and <md>-<pool>-green
INTERNAL_SECRET_ANNOTATION = "pagoda.dev/internal-secret-uid"
MODEL_MOUNT = "/mnt/models"
# The reference answer of the last passed quality gate (operator/quality_gate.py writes it).
QUALITY_REFERENCE = "quality-reference"
QUALITY_REFERENCE_DIR = "/etc/pagoda/quality"
QUALITY_REFERENCE_FILE = QUALITY_REFERENCE_DIR + "/reference.json"  # quality_probe.REFERENCE_CONFIGMAP_KEY
INTERNAL = "internal"  # component of the operator-generated Secret
INTERNAL_TOKEN_KEY = "internal-token"
TENANT_SECRET_KEY = "tenant-secret"
API_KEYS_DIR = "/etc/pagoda/api-keys"
API_KEYS_FILE = f"{API_KEYS_DIR}/keys"
# Readable by the pod's uid whatever it is: no fixed uid or fsGroup (Pod Security "restricted",
# OpenShift restricted-v2); only the router container runs in a router pod.
API_KEYS_MODE = 0o444
HEADLESS_LABEL = "pagoda.dev/headless"  # per-pod DNS Services; the ServiceMonitor skips them
PROBE_PERIOD_S = 10
DIST_PORT = 29500  # rank 0's torch.distributed rendezvous port, on the leader of a multi-node replica
LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
LWS_KIND = "LeaderWorkerSet"
LWS_PLURAL = "leaderworkersets"
WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"  # set by LWS on every pod; 0: the leader
GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"  # set by LWS: which replica a pod is of
LEADER = {WORKER_INDEX_LABEL: "0"}

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


def generation_of(formats: tuple[str, str, str, str]) -> str:
    """The generation of (prefill weights, prefill KV, decode weights, decode KV)."""
    return hashlib.sha256("/".join(formats).encode()).hexdigest()[:10]


def formats_generation(spec: Spec) -> str:
    """The pool pair's format generation: a format change makes a new pair beside the serving one."""
    p, d = spec.prefill, spec.decode
    return generation_of((p.weight_format, p.kv_cache_format, d.weight_format, d.kv_cache_format))


def pool_deployment_name(md_name: str, pool: str, slot: str = BLUE) -> str:
    """Deployment of a pool in a slot: ``<md>-<pool>`` (blue) or ``<md>-<pool>-green``."""
    return f"{md_name}-{pool}" if slot == BLUE else f"{md_name}-{pool}-{slot}"


def child_name(md_name: str, component: str) -> str:
    """Name of a child: ``<md>-prefill``, ``-decode``, ``-router``, ``-agent``, ``-internal``."""
    return f"{md_name}-{component}"


def headless_name(md_name: str, pool: str) -> str:
    """Headless Service of a pool: one DNS A record per ready pod."""
    return f"{md_name}-{pool}-pods"


def pool_dns(md_name: str, namespace: str, pool: str, domain: str = "cluster.local") -> str:
    """``HOST:PORT`` the router resolves to find each ready pod of a pool."""
    return f"{headless_name(md_name, pool)}.{namespace}.svc.{domain}:{PORT}"


def model_argument(source: str) -> str:
    """The --model value inside the pod: pvc:// sources become the mounted directory."""
    if source.startswith("pvc://"):
        _claim, _, path = source[len("pvc://") :].partition("/")
        return f"hf-dir://{MODEL_MOUNT}/{path}"
    return source


def agent_args(
    spec: Spec, role: str, md_name: str = "", namespace: str = "", domain: str = "cluster.local"
) -> list[str]:
    """Command line of ``pagoda serve`` for one role (prefill, decode or router).

    Engines get all four formats (each knows the handoff and reports them) and the engine flags of
    their own pool; the router gets only what it reads: the model name, routing flags and where to
    find each pool's pods (the pools' headless Services, re-resolved by the router)."""
    head = ["serve", "--role", role, "--model", model_argument(spec.source), "--host", "0.0.0.0"]
    head += ["--port", str(PORT)]
    if role == "router":
        args = head + ["--tenant-header", spec.routing.tenant_header]
        if not spec.routing.prefix_caching:
            args.append("--no-prefix-caching")
        if not spec.routing.session_affinity:
            args.append("--no-session-affinity")
        if spec.routing.trust_tenant_header:
            args.append("--trust-tenant-header")
        args += [
            "--prefill-dns",
            pool_dns(md_name, namespace, "prefill", domain),
            "--decode-dns",
            pool_dns(md_name, namespace, "decode", domain),
            "--drain-timeout",
            str(spec.router.drain.timeout_s),
        ]
        return args
    pool = spec.pool(role)
    args = head + [
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
        str(pool.tensor_parallel),
        "--tenant-header",
        spec.routing.tenant_header,
    ]
    if not spec.routing.prefix_caching:
        args.append("--no-prefix-caching")
    if spec.trust_remote_code:  # a trust decision the spec makes (model.trustRemoteCode)
        args.append("--trust-remote-code")
    if pool.max_queue_time_s is not None:
        args += ["--max-queue-time", f"{pool.max_queue_time_s:g}"]
    if role == "decode":
        args += ["--kv-port", str(KV_PORT)]
    if pool.multi_node:  # the rendezvous host and this pod's index come from the LWS environment
        args += ["--nodes", str(pool.nodes_per_replica), "--dist-port", str(DIST_PORT)]
    args += ["--drain-timeout", str(pool.drain.timeout_s)]
    gate = spec.rollout.gate
    if gate is not None and gate.probe_interval_s > 0:  # against the reference the last gate accepted
        args += ["--quality-reference", QUALITY_REFERENCE_FILE]
        args += ["--quality-probe-interval", str(gate.probe_interval_s)]
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


def _resources(pool: Pool) -> Obj:
    """The pool's resources plus ``nvidia.com/gpu``: one per rank the pod runs (``gpus``, per pod)."""
    res = copy.deepcopy(pool.resources)
    if pool.gpus > 0:
        res.setdefault("limits", {})["nvidia.com/gpu"] = pool.gpus
        res.setdefault("requests", {})["nvidia.com/gpu"] = pool.gpus
    return res


def _volumes(spec: Spec, role: str, md_name: str = "") -> tuple[list[Obj], list[Obj]]:
    volumes: list[Obj] = []
    mounts: list[Obj] = []
    gate = spec.rollout.gate
    if role in ("prefill", "decode") and gate is not None and gate.probe_interval_s > 0:
        # Optional: the ConfigMap exists once a gated format change has passed; the kubelet
        # fills the directory in when it appears (the engine waits for the file meanwhile).
        cm = {"name": child_name(md_name, QUALITY_REFERENCE), "optional": True}
        volumes.append({"name": "quality-reference", "configMap": cm})
        mounts.append({"name": "quality-reference", "mountPath": QUALITY_REFERENCE_DIR, "readOnly": True})
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


def _drain_of(spec: Spec, role: str) -> Drain:
    return spec.router.drain if role == "router" else spec.pool(role).drain


def _container(
    meta: Obj, spec: Spec, role: str, cfg: Config, mounts: list[Obj], resources: Obj, worker: bool = False
) -> Obj:
    # /health answers 503 while the server drains: liveness tolerates the whole drain (preStop +
    # --drain-timeout + the cut requests' grace) so that it never kills a draining pod. A worker
    # pod of a multi-node replica serves only /health (200 while its ranks are in the group), so
    # that is its readiness too.
    drain = _drain_of(spec, role)
    live_failures = max(6, -(-(drain.pre_stop_s + drain.timeout_s + 10) // 10) + 1)
    probe = {
        "httpGet": {"path": "/health", "port": "http"},
        "periodSeconds": 10,
        "failureThreshold": live_failures,
    }
    ready_path = "/health" if worker else "/ready"
    ready = {"httpGet": {"path": ready_path, "port": "http"}, "periodSeconds": 5, "failureThreshold": 3}
    startup_s = 300 if role == "router" else spec.pool(role).startup_s
    container: Obj = {
        "name": "agent",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["pagoda"],
        "args": agent_args(spec, role, meta["name"], meta["namespace"], cfg.cluster_domain),
        "env": agent_env(meta, role, cfg, spec),
        "ports": [{"name": "http", "containerPort": PORT, "protocol": "TCP"}],
        "livenessProbe": probe,
        "readinessProbe": ready,
        "startupProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": PROBE_PERIOD_S,
            "failureThreshold": max(1, -(-startup_s // PROBE_PERIOD_S)),
        },
        # The pod leaves the Service endpoints while preStop sleeps; then SIGTERM makes the server
        # refuse new requests and finish the running ones within --drain-timeout.
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(_drain_of(spec, role).pre_stop_s)]}}},
        "resources": resources,
        "securityContext": podspec.container_security_context(),
    }
    if role == "decode":
        container["ports"].append({"name": "kv", "containerPort": KV_PORT, "protocol": "TCP"})
    if role in POOLS and spec.pool(role).multi_node:
        container["ports"].append({"name": "dist", "containerPort": DIST_PORT, "protocol": "TCP"})
    # Empty lists are left out, as the API server leaves them out: an empty list set here would
    # never be found on the live object, and every pass would patch it again.
    if mounts:
        container["volumeMounts"] = mounts
    return container


def autoscaled(spec: Spec, role: str) -> bool:
    """Whether an autoscaler owns the replicas of this role's Deployment."""
    return role != "router" and spec.pool(role).autoscaling is not None


def _pod_template(
    meta: Obj, spec: Spec, role: str, cfg: Config, internal_uid: str | None, slot: str, worker: bool = False
) -> Obj:
    """The pod template of a role (for a multi-node pool: of its leader, or of its workers)."""
    name = meta["name"]
    volumes, mounts = _volumes(spec, role, name)
    drain = _drain_of(spec, role)
    pod_spec: Obj = {
        "serviceAccountName": child_name(name, AGENT),
        "securityContext": podspec.pod_security_context(),
        "terminationGracePeriodSeconds": drain.grace_s,
    }
    if not reports(role, worker):
        # The router (which parses untrusted input) and the workers of a multi-node replica never
        # report: no ServiceAccount of the agents, and no API token in the pod at all.
        pod_spec = {"automountServiceAccountToken": False, **pod_spec}
        del pod_spec["serviceAccountName"]
    if volumes:
        pod_spec["volumes"] = volumes
    annotations: Obj = {}
    if role == "router":
        overlay = spec.router.pod_template
        pod_spec["containers"] = [
            _container(meta, spec, role, cfg, mounts, {"requests": {"cpu": "250m", "memory": "512Mi"}})
        ]
    else:
        pool = spec.pool(role)
        overlay = pool.pod_template
        annotations[HANDOFF_ANNOTATION] = spec.handoff
        pod_spec["containers"] = [_container(meta, spec, role, cfg, mounts, _resources(pool), worker)]
        if pool.node_selector:
            pod_spec["nodeSelector"] = dict(pool.node_selector)
        tolerations = list(pool.tolerations)
        if pool.gpus > 0:
            tolerations.append({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"})
        if tolerations:
            pod_spec["tolerations"] = tolerations
        affinity = (
            podspec.fp8_affinity(pool.affinity, cfg) if pool.uses_fp8 and pool.gpus > 0 else pool.affinity
        )
        if affinity:
            pod_spec["affinity"] = affinity
    if internal_uid:
        annotations[INTERNAL_SECRET_ANNOTATION] = internal_uid
    pod_labels = _pod_labels(name, spec, role, slot)
    template: Obj = {"metadata": {"labels": pod_labels}, "spec": pod_spec}
    if annotations:
        template["metadata"]["annotations"] = annotations
    if overlay:
        template = podspec.strategic_merge(template, overlay)
        template["metadata"]["labels"].update(pod_labels)  # the selector labels stay ours
    return template


def reports(role: str, worker: bool = False) -> bool:
    """Whether the pods of a role write an agent report (need the agents' ServiceAccount): the
    engine pods and the leaders of multi-node replicas; not the router, not the workers."""
    return role in POOLS and not worker


def _pod_labels(name: str, spec: Spec, role: str, slot: str) -> dict[str, str]:
    pod_labels = labels(name, role)
    if role != "router":
        pod_labels[FORMATS_LABEL] = formats_generation(spec)
        if slot != BLUE:
            pod_labels[SLOT_LABEL] = slot
    return pod_labels


def workload_kind(spec: Spec, role: str) -> str:
    """The kind that runs a role: a LeaderWorkerSet for a multi-node pool, else a Deployment."""
    return LWS_KIND if role in POOLS and spec.pool(role).multi_node else "Deployment"


def workload(
    meta: Obj, spec: Spec, role: str, cfg: Config, internal_uid: str | None = None, slot: str = BLUE
) -> Obj:
    """The Deployment or LeaderWorkerSet that runs a role (``workload_kind``)."""
    if workload_kind(spec, role) == LWS_KIND:
        return leader_worker_set(meta, spec, role, cfg, internal_uid, slot)
    return deployment(meta, spec, role, cfg, internal_uid, slot)


def deployment(
    meta: Obj, spec: Spec, role: str, cfg: Config, internal_uid: str | None = None, slot: str = BLUE
) -> Obj:
    """Deployment ``<md>-<role>`` of node-agent pods for a pool or the router (a pool's green slot:
    ``<md>-<pool>-green``, during a format change).

    ``internal_uid`` is the uid of the live ``<md>-internal`` Secret: a new Secret rolls the pods.
    Pool pods carry their format generation (``pagoda.dev/formats``), which the pool Services select.
    An autoscaled pool's Deployment carries no ``replicas``: the autoscaler owns them (the
    operator creates it at ``minReplicas`` and never reverts a scale).
    """
    name = meta["name"]
    if role == "router":
        replicas: int | None = spec.router.replicas
        rolling = spec.router.rolling_update
    else:
        pool = spec.pool(role)
        replicas = None if pool.autoscaling is not None else pool.replicas
        rolling = pool.rolling_update
    match = selector(name, role)
    if role != "router" and slot != BLUE:  # blue keeps the selector Deployments always had (immutable)
        match[SLOT_LABEL] = slot
    dep_spec: Obj = {
        "selector": {"matchLabels": match},
        "strategy": {
            "type": "RollingUpdate",
            "rollingUpdate": {"maxSurge": rolling.max_surge, "maxUnavailable": rolling.max_unavailable},
        },
        "progressDeadlineSeconds": spec.rollout.progress_deadline_s,
        "template": _pod_template(meta, spec, role, cfg, internal_uid, slot),
    }
    if replicas is not None:
        dep_spec = {"replicas": replicas, **dep_spec}
    dep_name = child_name(name, role) if role == "router" else pool_deployment_name(name, role, slot)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(meta, dep_name, role),
        "spec": dep_spec,
    }


def leader_worker_set(
    meta: Obj, spec: Spec, role: str, cfg: Config, internal_uid: str | None = None, slot: str = BLUE
) -> Obj:
    """LeaderWorkerSet ``<md>-<pool>`` (or ``-green``) of a multi-node pool: ``replicas`` groups of
    ``nodesPerReplica`` pods. The leader (worker index 0) runs rank 0, the scheduler and the API;
    the workers run the other ranks and serve only ``/health``. Every pod gets the same command
    line; LWS injects ``LWS_LEADER_ADDRESS`` and ``LWS_WORKER_INDEX``. A pod or container restart
    recreates the whole group (``RecreateGroupOnPodRestart``), as a replica cannot lose a rank.
    Like a Deployment, an autoscaled pool's LeaderWorkerSet carries no ``replicas``."""
    pool = spec.pool(role)
    rolling = pool.rolling_update
    lws_spec: Obj = {
        "leaderWorkerTemplate": {
            "size": pool.nodes_per_replica,
            "restartPolicy": "RecreateGroupOnPodRestart",
            "leaderTemplate": _pod_template(meta, spec, role, cfg, internal_uid, slot),
            "workerTemplate": _pod_template(meta, spec, role, cfg, internal_uid, slot, worker=True),
        },
        "rolloutStrategy": {
            "type": "RollingUpdate",
            "rollingUpdateConfiguration": {
                "maxSurge": rolling.max_surge,
                "maxUnavailable": rolling.max_unavailable,
            },
        },
    }
    if pool.autoscaling is None:
        lws_spec = {"replicas": pool.replicas, **lws_spec}
    return {
        "apiVersion": LWS_API_VERSION,
        "kind": LWS_KIND,
        "metadata": _metadata(meta, pool_deployment_name(meta["name"], role, slot), role),
        "spec": lws_spec,
    }


def pod_templates(obj: Obj) -> list[Obj]:
    """The pod templates of a live or desired workload (a Deployment's one; an LWS's leader's and
    workers'), leader first."""
    spec = obj.get("spec") or {}
    if obj.get("kind") == LWS_KIND:
        lwt = spec.get("leaderWorkerTemplate") or {}
        return [t for t in (lwt.get("leaderTemplate"), lwt.get("workerTemplate")) if isinstance(t, dict)]
    return [spec["template"]] if isinstance(spec.get("template"), dict) else []


def template_label_patch(kind: str, labels_: dict[str, str]) -> Obj:
    """A merge patch adding labels to every pod template of a workload of ``kind``."""
    tpl = {"metadata": {"labels": labels_}}
    if kind == LWS_KIND:
        return {"spec": {"leaderWorkerTemplate": {"leaderTemplate": tpl, "workerTemplate": tpl}}}
    return {"spec": {"template": tpl}}


Kinds = dict[str, str]  # pool -> kind of the workload its Services select (default: the spec's)


def _serving_kind(spec: Spec, role: str, kinds: Kinds | None) -> str:
    return (kinds or {}).get(role) or workload_kind(spec, role)


def _service_selector(
    meta: Obj, spec: Spec, role: str, formats: str | None, kinds: Kinds | None
) -> dict[str, str]:
    """A Service's pods: the role's, of the serving generation; of a multi-node pool, only leaders
    (workers serve no API)."""
    out = {**selector(meta["name"], role), **({FORMATS_LABEL: formats} if formats else {})}
    if role in POOLS and _serving_kind(spec, role, kinds) == LWS_KIND:
        out.update(LEADER)
    return out


def service(meta: Obj, spec: Spec, role: str, formats: str | None = None, kinds: Kinds | None = None) -> Obj:
    """Service ``<md>-<role>``; the router's type and port come from the spec. A pool's Services
    select the serving format generation ``formats`` (none: every pod of the pool) and, when the
    serving workload is a LeaderWorkerSet (``kinds``; by default the spec's kind), its leaders only."""
    svc_spec: Obj = {
        "type": "ClusterIP",
        "selector": _service_selector(meta, spec, role, formats, kinds),
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


def headless_service(
    meta: Obj, spec: Spec, role: str, formats: str | None = None, kinds: Kinds | None = None
) -> Obj:
    """Headless Service ``<md>-<pool>-pods``: DNS returns one A record per ready pod of the pool (per
    ready leader of a multi-node pool), so the router sees (and routes, marks down, pins sessions
    to) each replica, not one Service IP."""
    metadata = _metadata(meta, headless_name(meta["name"], role), role)
    metadata["labels"][HEADLESS_LABEL] = "true"
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata,
        "spec": {
            "clusterIP": "None",
            # publishNotReadyAddresses stays unset (false): only ready pods are in DNS. Set to its
            # default it would be dropped by the API server and patched again on every pass.
            "selector": _service_selector(meta, spec, role, formats, kinds),
            "ports": [{"name": "http", "port": PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def scaling_children(
    meta: Obj, spec: Spec, cfg: Config, slots: dict[str, str] | None = None, kinds: Kinds | None = None
) -> list[Obj]:
    """PodDisruptionBudgets (pools and router, unless disabled; over both slots of a pool) and
    autoscalers of autoscaled pools, on the workload of the serving slot (``slots``, ``kinds``)."""
    objs: list[Obj] = []
    name = meta["name"]
    for role in ("prefill", "decode", "router"):
        budget = spec.router.disruption_budget if role == "router" else spec.pool(role).disruption_budget
        if budget.enabled:
            md = _metadata(meta, child_name(name, role), role)
            objs.append(scaling.disruption_budget(md, selector(name, role), budget))
    for role in ("prefill", "decode"):
        auto = spec.pool(role).autoscaling
        if auto is not None:
            md = _metadata(meta, child_name(name, role), role)
            target = pool_deployment_name(name, role, (slots or {}).get(role, BLUE))
            kind = _serving_kind(spec, role, kinds)
            api = LWS_API_VERSION if kind == LWS_KIND else "apps/v1"
            objs.append(scaling.autoscaler(md, target, auto, cfg, kind=kind, api_version=api))
    return objs


def optional_children(meta: Obj, cfg: Config) -> list[tuple[str, str]]:
    """(kind, name) of every child a spec may turn off: deleted when not desired (if ours). Only
    the autoscaler kind the operator runs with is looked at (the other may not be served)."""
    name = meta["name"]
    out = [("NetworkPolicy", child_name(name, role)) for role in ("decode", "prefill")]
    out += [("PodDisruptionBudget", child_name(name, role)) for role in ("prefill", "decode", "router")]
    kind = "ScaledObject" if cfg.autoscaler == "keda" else "HorizontalPodAutoscaler"
    out += [(kind, child_name(name, role)) for role in ("prefill", "decode")]
    out += [(gateway.POOL_KIND, name), (gateway.ROUTE_KIND, name)]  # spec.router.gateway removed
    if cfg.agent_cluster_role:  # an older operator's Role and its binding: the ClusterRole replaces them
        out += [("RoleBinding", child_name(name, AGENT)), ("Role", child_name(name, AGENT))]
    return out


AGENT = "pagoda-agent"  # the agents' ServiceAccount is <md>-pagoda-agent (the chart's admission policy keys on it)


def agent_binding_name(md_name: str) -> str:
    """The RoleBinding of the agents to the chart's agent ClusterRole (cluster mode)."""
    return f"{child_name(md_name, AGENT)}-pods"


def agent_rbac(meta: Obj, cfg: Config | None = None) -> list[Obj]:
    """ServiceAccount, Role and RoleBinding letting the agents patch pods and renew Leases in this
    namespace: each agent writes its report into its own Pod's annotation and its heartbeat into
    its own Lease. RBAC cannot name a pod not created yet;
    the chart's ValidatingAdmissionPolicy narrows it to the agent's own pod and that annotation.

    With ``cfg.agent_cluster_role`` (the chart's cluster mode) the RoleBinding binds that ClusterRole
    instead of a Role of our own, so the operator needs ``bind`` on that one ClusterRole rather than
    holding ``pods patch`` everywhere; it is named apart (a binding's roleRef cannot change)."""
    name = child_name(meta["name"], AGENT)
    sa = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _metadata(meta, name, "agent")}
    if cfg is not None and cfg.agent_cluster_role:
        binding = agent_binding_name(meta["name"])
        return [
            sa,
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "RoleBinding",
                "metadata": _metadata(meta, binding, "agent"),
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "ClusterRole",
                    "name": cfg.agent_cluster_role,
                },
                "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": meta["namespace"]}],
            },
        ]
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _metadata(meta, name, "agent")},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": _metadata(meta, name, "agent"),
            "rules": [
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"]},
                {
                    "apiGroups": ["coordination.k8s.io"],
                    "resources": ["leases"],
                    "verbs": ["create", "patch"],
                },
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


def network_policies(meta: Obj, spec: Spec, kinds: Kinds | None = None) -> list[Obj]:
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
    for role, ingress in rules.items():
        if LWS_KIND in (workload_kind(spec, role), _serving_kind(spec, role, kinds)):
            # The ranks of a replica: the rendezvous port, then NCCL/gloo connections on ports
            # they pick themselves, so any port from the pool's own pods.
            ingress.append({"from": [_peer(name, role)]})
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


def build(
    meta: Obj,
    spec: Spec,
    cfg: Config,
    internal_uid: str | None = None,
    slots: dict[str, str] | None = None,
    serving: dict[str, str | None] | None = None,
    scale_slots: dict[str, str] | None = None,
    serving_kinds: Kinds | None = None,
) -> dict[str, Obj]:
    """All children keyed by ``Kind/name``, in the order they should be applied (the network
    policies before the pods they fence, the Deployments before their autoscalers).

    ``slots`` names the slot each pool's desired Deployment goes into (blue by default) and
    ``serving`` the format generation each pool's Services select (the spec's by default; None:
    no generation in the selector, as Services made before generations had). The reconciler sets
    both during a format change (``rollout.plan``), and ``serving_kinds``: the kind of the workload
    each pool's Services and autoscaler point at while the old pair still serves (the spec's kind
    by default), so that a format change that also crosses ``nodesPerReplica`` 1 keeps the old
    pair's selectors until its traffic moves."""
    slots = slots or {}
    generation = formats_generation(spec)
    objs = agent_rbac(meta, cfg) + network_policies(meta, spec, serving_kinds)
    for role in ("decode", "prefill", "router"):
        objs.append(workload(meta, spec, role, cfg, internal_uid, slots.get(role, BLUE)))
        if role == "router":
            objs.append(service(meta, spec, role))
            continue
        formats = serving[role] if serving is not None and role in serving else generation
        objs.append(service(meta, spec, role, formats, serving_kinds))
        objs.append(headless_service(meta, spec, role, formats, serving_kinds))
    objs += scaling_children(meta, spec, cfg, scale_slots or slots, serving_kinds)
    objs += gateway.gateway_children(
        meta, spec, _metadata(meta, meta["name"], "router"), selector(meta["name"], "router"), PORT
    )
    return {f"{o['kind']}/{o['metadata']['name']}": o for o in objs}
