"""The operator installs or upgrades its own CRD at start (server-side apply), so that upgrading
the operator (``helm upgrade``) also moves the schema; Helm never upgrades a chart's crds/ folder."""

from __future__ import annotations

import logging
from typing import Any

from .kube import ApiError, Kube
from .schema import load_crd

log = logging.getLogger("pagoda.operator")

FIELD_MANAGER = "pagoda-operator"
CRD_URL = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}"


async def install(kube: Kube, crd: dict[str, Any] | None = None, crd_file: str = "") -> str | None:
    """Server-side apply the CRD; returns None when applied, else why not (logged, not raised:
    the operator keeps running on the CRD the cluster has)."""
    crd = crd or load_crd(crd_file)
    name = crd["metadata"]["name"]
    url = CRD_URL.format(name=name) + f"?fieldManager={FIELD_MANAGER}&force=true"
    try:
        await kube.apply(url, crd)
    except ApiError as err:
        why = f"cannot install the CRD {name}: {err.message}"
        log.warning(why)
        return why
    log.info("CRD %s applied", name)
    return None
