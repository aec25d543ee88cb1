"""Order of a rollout that never pairs a prefill pod and a decode pod disagreeing on the KV handoff.

Weight-format and other pool-local changes roll both pools at once: pods of the two pools
only share the handoff (prefill KV format -> decode KV format), so they stay compatible.
A handoff change cannot be rolled pod by pod, so it goes in three level-based stages:

1. DrainPrefill: scale the prefill pool (old template) to zero and wait for its pods to go;
2. RollDecode: roll the decode pool to the new template and wait until no old pod remains;
3. then apply the new prefill template with its replicas.

While the prefill pool is drained, requests queue or fail at the router; the Progressing
condition says so. Each pass looks only at the live Deployments, so a restart of the
operator resumes at the right stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .children import HANDOFF_ANNOTATION

Obj = dict[str, Any]

APPLY = "apply"  # apply the desired Deployment
DRAIN = "drain"  # keep the live template, scale to zero (create at zero when absent)
HOLD = "hold"  # leave the live object as it is


@dataclass(frozen=True)
class Plan:
    """What to do with each pool Deployment in this pass."""

    prefill: str
    decode: str
    stage: str | None = None
    message: str = ""


def handoff_of(dep: Obj | None) -> str | None:
    """The handoff a live Deployment's pod template was built for."""
    if dep is None:
        return None
    annotations = dep.get("spec", {}).get("template", {}).get("metadata", {}).get("annotations") or {}
    return annotations.get(HANDOFF_ANNOTATION)


def has_pods(dep: Obj | None) -> bool:
    """Whether a Deployment may still run pods (wanted or not yet terminated)."""
    if dep is None:
        return False
    return (
        int(dep.get("spec", {}).get("replicas", 1) or 0) > 0
        or int(dep.get("status", {}).get("replicas", 0) or 0) > 0
    )


def only_current_pods(dep: Obj | None) -> bool:
    """Whether every pod of a Deployment runs its current template (no old pods left)."""
    if dep is None:
        return False
    status = dep.get("status") or {}
    generation = dep.get("metadata", {}).get("generation")
    observed = status.get("observedGeneration")
    if generation is not None and (observed is None or observed < generation):
        return False
    return int(status.get("replicas", 0) or 0) == int(status.get("updatedReplicas", 0) or 0)


def plan(handoff: str, live_prefill: Obj | None, live_decode: Obj | None) -> Plan:
    """Decide this pass's action per pool for the desired handoff."""
    if live_prefill is None and live_decode is None:
        return Plan(APPLY, APPLY)
    if handoff_of(live_prefill) == handoff and handoff_of(live_decode) == handoff:
        return Plan(APPLY, APPLY)
    if live_decode is None and handoff_of(live_prefill) == handoff:
        return Plan(APPLY, APPLY)
    old = handoff_of(live_decode) or handoff_of(live_prefill)
    if handoff_of(live_decode) == handoff and only_current_pods(live_decode):
        return Plan(
            APPLY,
            APPLY,
            "RestorePrefill",
            f"KV handoff {old} -> {handoff}: decode pool rolled, restoring prefill",
        )
    if has_pods(live_prefill):
        return Plan(
            DRAIN,
            HOLD,
            "DrainPrefill",
            f"KV handoff changes to {handoff}: prefill pool drains before the decode pool rolls, "
            "so no prefill pod hands pages to a decode pod expecting another format",
        )
    return Plan(
        DRAIN,
        APPLY,
        "RollDecode",
        f"KV handoff changes to {handoff}: decode pool rolling while the prefill pool is drained",
    )
