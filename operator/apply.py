"""Create-or-repair of one child object, by comparison with what the cluster holds.

A child is in sync when every field the operator sets has the value it sets (fields the API
server adds or defaults are ignored). Fields the operator set on a previous pass and no longer
sets are removed via the ``pagoda.dev/last-applied`` annotation, as a three-way merge. A
Deployment's (or LeaderWorkerSet's) ``spec.replicas`` is never recorded there: when an autoscaler
takes a pool over, the operator stops setting it, and must not remove it either (the API server
would reset it to 1).
"""

from __future__ import annotations

import json
import re
from decimal import Decimal, InvalidOperation
from typing import Any

from . import ownership
from .kube import ApiError, Kube

Obj = dict[str, Any]

LAST_APPLIED = "pagoda.dev/last-applied"

_SUFFIX = {
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
}
_QUANTITY = re.compile(r"^([+-]?[0-9.]+)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][+-]?[0-9]+)?$")


def quantity(value: Any) -> Decimal | None:
    """A Kubernetes resource quantity ("500m", "2Gi", 1) as a number, or None if it is not one."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return Decimal(str(value))
    match = _QUANTITY.match(str(value))
    if not match:
        return None
    number, suffix = match.group(1), match.group(2) or ""
    try:
        if suffix[:1] in ("e", "E"):
            return Decimal(number + suffix)
        return Decimal(number) * Decimal(_SUFFIX[suffix])
    except (InvalidOperation, KeyError):
        return None


def _same(a: Any, b: Any) -> bool:
    if a == b:
        return True
    if isinstance(a, str | int | float) and isinstance(b, str | int | float):
        qa, qb = quantity(a), quantity(b)
        return qa is not None and qa == qb
    return False


def contains(actual: Any, desired: Any) -> bool:
    """Whether ``actual`` holds everything ``desired`` sets (extra keys in actual are fine)."""
    if isinstance(desired, dict):
        return isinstance(actual, dict) and all(
            k in actual and contains(actual[k], v) for k, v in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(actual, list)
            and len(actual) == len(desired)
            and all(contains(a, d) for a, d in zip(actual, desired, strict=True))
        )
    return _same(actual, desired)


def removals(old: Any, new: Any) -> Any:
    """A merge patch turning ``old`` into ``new``: ``new`` plus nulls for keys dropped since ``old``."""
    if not isinstance(new, dict):
        return new
    out: Obj = {}
    if isinstance(old, dict):
        for key in old:
            if key not in new:
                out[key] = None
    for key, value in new.items():
        out[key] = removals(old.get(key) if isinstance(old, dict) else None, value)
    return out


def _unowned_removed(obj: Obj) -> Obj:
    """``obj`` without the fields a removal must never touch (a Deployment's replicas)."""
    out = json.loads(json.dumps(obj))
    if out.get("kind") in ("Deployment", "LeaderWorkerSet") and isinstance(out.get("spec"), dict):
        out["spec"].pop("replicas", None)
    return out


def _stamped(desired: Obj) -> Obj:
    stamped = json.loads(json.dumps(desired))
    annotations = stamped["metadata"].setdefault("annotations", {})
    recorded = _unowned_removed(desired)
    annotations[LAST_APPLIED] = json.dumps(recorded, sort_keys=True, separators=(",", ":"))
    return stamped


def _last_applied(live: Obj) -> Obj | None:
    raw = (live.get("metadata", {}).get("annotations") or {}).get(LAST_APPLIED)
    try:
        last = json.loads(raw) if raw else None
    except ValueError:
        return None
    return _unowned_removed(last) if isinstance(last, dict) else None


def in_sync(desired: Obj, live: Obj) -> bool:
    """Whether the live object needs no patch."""
    return contains(live, _stamped(desired))


async def ensure(kube: Kube, desired: Obj, live: Obj | None, owner: Obj | None = None) -> str:
    """Bring one child to the desired state; returns "created", "patched" or "unchanged".

    With ``owner`` (the ModelDeployment's metadata) an existing object that is not its child is
    never patched: ``ownership.AlreadyOwned`` is raised instead."""
    meta = desired["metadata"]
    key = f"{desired['kind']}/{meta['name']}"
    if live is None:
        try:
            await kube.create(_stamped(desired))
            return "created"
        except ApiError as err:
            if err.status != 409:
                raise
            live = await kube.get(desired["kind"], meta["namespace"], meta["name"])
            if live is None:
                raise
    if owner is not None:
        ownership.check(key, live, owner)
    if in_sync(desired, live):
        return "unchanged"
    patch = removals(_last_applied(live), _stamped(desired))
    for key in ("apiVersion", "kind"):
        patch.pop(key, None)
    await kube.patch(desired["kind"], meta["namespace"], meta["name"], patch)
    return "patched"
