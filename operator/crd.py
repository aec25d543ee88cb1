"""The operator installs or upgrades its own CRD at start (server-side apply), so that upgrading
the operator (``helm upgrade``) also moves the schema; Helm never upgrades a chart's crds/ folder.

Upgrades only go forward: the CRD carries a revision annotation (``pagoda.dev/crd-revision``, an
integer raised with every schema change), and an operator whose CRD is older than the one the
cluster stores (a rollback) leaves it alone, so that it never prunes fields a newer operator added.
"""

from __future__ import annotations

import logging
from typing import Any

from .kube import ApiError, Kube
from .schema import load_crd

log = logging.getLogger("pagoda.operator")

FIELD_MANAGER = "pagoda-operator"
CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}"
CRD_URL = CRD_PATH  # kept for callers that format the apply URL themselves
REVISION_ANNOTATION = "pagoda.dev/crd-revision"


def revision(crd: dict[str, Any] | None) -> int | None:
    """The CRD's revision annotation as an integer; None when absent or not a number."""
    annotations = ((crd or {}).get("metadata") or {}).get("annotations") or {}
    value = str(annotations.get(REVISION_ANNOTATION, "")).strip()
    return int(value) if value.isdigit() else None


async def install(kube: Kube, crd: dict[str, Any] | None = None, crd_file: str = "") -> str | None:
    """Server-side apply the CRD unless the stored one is newer; returns None when applied, else
    why not (logged, not raised: the operator keeps running on the CRD the cluster has)."""
    crd = crd or load_crd(crd_file)
    name = crd["metadata"]["name"]
    path = CRD_PATH.format(name=name)
    ours = revision(crd)
    try:
        live = await kube.read(path)
    except ApiError as err:
        why = f"cannot read the CRD {name}: {err.message}; not applied"
        log.warning(why)
        return why
    theirs = revision(live)
    if theirs is not None and (ours is None or theirs > ours):
        why = (
            f"the cluster's CRD {name} is at revision {theirs}, newer than this operator's "
            f"{ours if ours is not None else '(none)'}: not downgraded"
        )
        log.warning(why)
        return why
    try:
        await kube.apply(path + f"?fieldManager={FIELD_MANAGER}&force=true", crd)
    except ApiError as err:
        why = f"cannot install the CRD {name}: {err.message}"
        log.warning(why)
        return why
    log.info("CRD %s applied (revision %s)", name, ours)
    return None
