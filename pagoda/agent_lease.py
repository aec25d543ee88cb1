"""The agents' heartbeat as a ``coordination.k8s.io/v1`` Lease, one per agent pod.

Kubernetes moved node heartbeats from Node status writes to Lease objects so that a heartbeat is
a small write nobody else watches. Each agent here renews its own Lease (named as its pod, in its
namespace, owned by the pod so that the garbage collector removes it with the pod) every report
interval with a merge patch of ``spec.renewTime`` (the Lease has one writer, so no
read-modify-write), and writes its pod's report annotation only when the figures change or at a long
heartbeat. The operator reads liveness from ``spec.renewTime``; without a Lease (an agent of an
older release, or one the RBAC refuses) the pod report's own time counts, as before. Pure Python:
both the agent and the operator import it.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from pagoda.agent_report import parse_time

API_VERSION = "coordination.k8s.io/v1"
LEASES_PATH = "/apis/coordination.k8s.io/v1/namespaces/{ns}/leases"
MD_LABEL = "pagoda.dev/model-deployment"  # the same labels as the agent's pod
POOL_LABEL = "pagoda.dev/pool"
COMPONENT = "agent-lease"


def micro_time(when: dt.datetime) -> str:
    """A Lease's MicroTime: RFC 3339 with microseconds, in UTC."""
    return when.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def lease_body(
    name: str, namespace: str, md_name: str, pool: str, pod_uid: str, duration_s: int, now: dt.datetime
) -> dict[str, Any]:
    """A new Lease for the agent of pod ``name`` (owned by the pod when its uid is known)."""
    meta: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "labels": {MD_LABEL: md_name, POOL_LABEL: pool, "app.kubernetes.io/component": COMPONENT},
    }
    if pod_uid:
        meta["ownerReferences"] = [pod_owner(name, pod_uid)]
    return {
        "apiVersion": API_VERSION,
        "kind": "Lease",
        "metadata": meta,
        "spec": renewed({}, name, duration_s, now),
    }


def pod_owner(name: str, uid: str) -> dict[str, Any]:
    """The ownerReference of a Lease to its agent's pod (no ``blockOwnerDeletion``: an agent may
    not set it, and the Lease blocks nothing)."""
    return {"apiVersion": "v1", "kind": "Pod", "name": name, "uid": uid}


def renewed(spec: dict[str, Any], holder: str, duration_s: int, now: dt.datetime) -> dict[str, Any]:
    """The Lease spec renewed at ``now`` (``acquireTime`` kept once set)."""
    stamp = micro_time(now)
    return {
        **spec,
        "holderIdentity": holder,
        "leaseDurationSeconds": duration_s,
        "acquireTime": spec.get("acquireTime") or stamp,
        "renewTime": stamp,
    }


def renew_times(leases: list[dict[str, Any]]) -> dict[str, dt.datetime]:
    """Pod name -> the last renewal of its agent's Lease (Leases without a readable time left out)."""
    out: dict[str, dt.datetime] = {}
    for lease in leases:
        meta = lease.get("metadata") or {}
        when = parse_time((lease.get("spec") or {}).get("renewTime"))
        if isinstance(meta.get("name"), str) and when is not None:
            out[meta["name"]] = when
    return out
