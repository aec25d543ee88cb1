"""Pod template pieces: the Pod Security "restricted" defaults, FP8 node placement, and the user's
strategic-merge overlay of the pod template."""

from __future__ import annotations

import copy
from typing import Any

from .config import Config

Obj = dict[str, Any]

# Lists of the pod template merged element by element on this key (as kubectl's strategic merge
# does for these fields); every other list in an overlay replaces the list it lands on.
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "env": "name",
    "ports": "containerPort",
    "imagePullSecrets": "name",
    "topologySpreadConstraints": "topologyKey",
    "hostAliases": "ip",
}


def strategic_merge(base: Any, overlay: Any, key: str | None = None) -> Any:
    """``overlay`` merged into ``base``: maps recursively, the lists of ``MERGE_KEYS`` by their key
    (an overlay element without the key is appended), other lists and scalars replaced, ``None``
    deletes a map key. Neither input is modified."""
    if isinstance(overlay, dict) and isinstance(base, dict):
        out = copy.deepcopy(base)
        for k, v in overlay.items():
            if v is None:
                out.pop(k, None)
            else:
                out[k] = strategic_merge(out.get(k), v, k)
        return out
    if isinstance(overlay, list) and isinstance(base, list) and key in MERGE_KEYS:
        field = MERGE_KEYS[key]
        out_list = copy.deepcopy(base)
        for item in overlay:
            at = next(
                (
                    i
                    for i, b in enumerate(out_list)
                    if isinstance(item, dict)
                    and isinstance(b, dict)
                    and field in item
                    and b.get(field) == item[field]
                ),
                None,
            )
            if at is None:
                out_list.append(copy.deepcopy(item))
            else:
                out_list[at] = strategic_merge(out_list[at], item)
        return out_list
    return copy.deepcopy(overlay)


def pod_security_context() -> Obj:
    """Pod Security "restricted" without a fixed uid (the image's non-root USER runs; OpenShift's
    restricted-v2 assigns its own uid and fsGroup). Set ``runAsUser``/``fsGroup`` in the overlay."""
    return {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}


def container_security_context() -> Obj:
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def _and_terms(user: Obj, alternatives: list[list[Obj]]) -> Obj:
    """User affinity with required node terms ANDed with one of ``alternatives``.

    Required node selector terms are ORed and the expressions inside one term ANDed, so each user
    term is combined with each alternative (a cross product)."""
    affinity = copy.deepcopy(user)
    node = affinity.setdefault("nodeAffinity", {})
    required = node.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.get("nodeSelectorTerms") or [{}]
    combined = []
    for term in terms:
        for exprs in alternatives:
            t = copy.deepcopy(term)
            t["matchExpressions"] = list(t.get("matchExpressions") or []) + copy.deepcopy(exprs)
            combined.append(t)
    required["nodeSelectorTerms"] = combined
    return affinity


CC_MAJOR = "nvidia.com/gpu.compute.major"
CC_MINOR = "nvidia.com/gpu.compute.minor"


def fp8_alternatives(cfg: Config) -> list[list[Obj]]:
    """Node expressions of FP8-capable GPUs (one list per alternative; empty: no constraint).

    computeCapability: NVIDIA GPU feature discovery's labels, compute capability >= 8.9 (Ada,
    Hopper, Blackwell and later): major > 8, or major 8 with minor > 8. label: nodes labelled
    ``<fp8_node_label>=true`` by the cluster admin.
    """
    if cfg.fp8_placement == "computeCapability":
        return [
            [{"key": CC_MAJOR, "operator": "Gt", "values": ["8"]}],
            [
                {"key": CC_MAJOR, "operator": "In", "values": ["8"]},
                {"key": CC_MINOR, "operator": "Gt", "values": ["8"]},
            ],
        ]
    if cfg.fp8_placement == "label":
        return [[{"key": cfg.fp8_node_label, "operator": "In", "values": ["true"]}]]
    return []


def fp8_affinity(user: Obj, cfg: Config) -> Obj:
    """The pool's affinity with the FP8 node requirement added (unchanged with placement none)."""
    alternatives = fp8_alternatives(cfg)
    return _and_terms(user, alternatives) if alternatives else copy.deepcopy(user)
