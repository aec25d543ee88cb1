"""Which existing objects a ModelDeployment may change: only the children it made.

An object with a child's name is the ModelDeployment's when its controller ownerReference is the
ModelDeployment, or, with no controller at all, when it carries the operator's labels for it
(``app.kubernetes.io/managed-by: pagoda-operator`` and ``pagoda.dev/model-deployment: NAME``). Anything else (a Service another Deployment owns, an
object someone created by hand) is left untouched: no patch, no delete, no adoption. The pass
reports it instead, as controller-runtime does (reason ``AlreadyOwned``).
"""

from __future__ import annotations

from typing import Any

from .children import MANAGED_BY, MD_LABEL

Obj = dict[str, Any]

ALREADY_OWNED = "AlreadyOwned"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"


class AlreadyOwned(Exception):
    """A child's name is taken by an object this ModelDeployment does not own."""

    def __init__(self, key: str, why: str) -> None:
        super().__init__(f"{key} {why}")
        self.key = key
        self.why = why


def foreign(live: Obj, owner: Obj) -> str | None:
    """Why ``live`` is not ``owner``'s (a ModelDeployment's metadata) to change; None when it is."""
    meta = live.get("metadata") or {}
    controller = next((o for o in meta.get("ownerReferences") or [] if o.get("controller")), None)
    if controller is not None:  # ours by its controller reference (hand-edited labels are repaired)
        if controller.get("uid") == owner.get("uid"):
            return None
        return f"is controlled by {controller.get('kind', '?')}/{controller.get('name', '?')}"
    labels = meta.get("labels") or {}
    if labels.get(MANAGED_BY_LABEL) != MANAGED_BY or labels.get(MD_LABEL) != owner.get("name"):
        return f"lacks the labels {MANAGED_BY_LABEL}={MANAGED_BY}, {MD_LABEL}={owner.get('name')}"
    return None


def check(key: str, live: Obj | None, owner: Obj) -> None:
    """Raise ``AlreadyOwned`` when ``live`` exists and is not ``owner``'s."""
    if live is not None and (why := foreign(live, owner)) is not None:
        raise AlreadyOwned(key, why)


def message(refused: list[AlreadyOwned], md_name: str) -> str:
    """The condition message naming every refused object."""
    items = "; ".join(f"{r.key} {r.why}" for r in refused)
    return (
        f"left untouched, not owned by ModelDeployment {md_name}: {items}; "
        "delete or rename the object(s), or rename the ModelDeployment"
    )
