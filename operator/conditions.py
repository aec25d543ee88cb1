"""Kubernetes-style status conditions of a ModelDeployment."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from .status import format_time

Obj = dict[str, Any]

READY = "Ready"
PROGRESSING = "Progressing"
DEGRADED = "Degraded"
KV_INTEGRITY_DEGRADED = "KVIntegrityDegraded"
TYPES = (READY, PROGRESSING, DEGRADED, KV_INTEGRITY_DEGRADED)


@dataclass(frozen=True)
class Condition:
    type: str
    status: bool | None  # None: Unknown
    reason: str
    message: str


def merge(
    previous: list[Obj] | None, new: list[Condition], now: dt.datetime, generation: int | None
) -> list[Obj]:
    """Render conditions, keeping lastTransitionTime when a condition's status did not change."""
    before = {c.get("type"): c for c in previous or [] if isinstance(c, dict)}
    out: list[Obj] = []
    for cond in new:
        status = "Unknown" if cond.status is None else "True" if cond.status else "False"
        old = before.get(cond.type)
        since = old.get("lastTransitionTime") if old and old.get("status") == status else None
        item: Obj = {
            "type": cond.type,
            "status": status,
            "reason": cond.reason,
            "message": cond.message,
            "lastTransitionTime": since or format_time(now),
        }
        if generation is not None:
            item["observedGeneration"] = generation
        out.append(item)
    return out


def transitions(previous: list[Obj] | None, current: list[Obj]) -> list[Obj]:
    """Conditions whose status or reason changed since the previous list (for Events)."""
    before = {c.get("type"): c for c in previous or [] if isinstance(c, dict)}
    changed = []
    for cond in current:
        old = before.get(cond["type"])
        if old is None or old.get("status") != cond["status"] or old.get("reason") != cond["reason"]:
            changed.append(cond)
    return changed
