"""Which LeaderWorkerSet the cluster runs: its published schema (OpenAPI v3, readable by every
authenticated client) says whether it has what the operator relies on.

- ``spec.rolloutStrategy.rollingUpdateConfiguration.maxSurge`` (LeaderWorkerSet v0.3.0, the minimum
  supported): without it the API server prunes the pools' maxSurge and a format change or rollout
  of a multi-node pool behaves unlike the spec says. A multi-node ModelDeployment is then refused
  with reason ``LeaderWorkerSetTooOld``.
- ``status.observedGeneration`` (newer releases): without it rollout progress is read from the
  LeaderWorkerSet's conditions (``rollout.only_current_pods``); both are supported.

The schema is read once per operator run (the first pass that needs it) and kept; a cluster that
does not publish it (or an emulator) counts as supported.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from .children import LWS_API_VERSION, LWS_KIND
from .kube import ApiError

Obj = dict[str, Any]

MIN_VERSION = "v0.3.0"
TOO_OLD = "LeaderWorkerSetTooOld"
OPENAPI_PATH = f"/openapi/v3/apis/{LWS_API_VERSION}"
CHECKED = "problem"  # key of the cache dict

log = logging.getLogger("pagoda.operator")


class Reader(Protocol):
    async def read(self, url: str) -> Obj | None: ...


def _schema_of(doc: Obj) -> Obj | None:
    for schema in ((doc.get("components") or {}).get("schemas") or {}).values():
        kinds = schema.get("x-kubernetes-group-version-kind") or []
        if any(k.get("kind") == LWS_KIND for k in kinds):
            return schema
    return None


def _at(schema: Obj | None, *keys: str) -> Obj | None:
    for key in keys:
        if not isinstance(schema, dict):
            return None
        schema = (schema.get("properties") or {}).get(key)
    return schema if isinstance(schema, dict) else None


def problem(doc: Obj | None) -> str | None:
    """Why the published LeaderWorkerSet schema is too old (None: fine, or nothing to judge by)."""
    schema = _schema_of(doc or {})
    if schema is None:
        return None
    if _at(schema, "spec", "rolloutStrategy", "rollingUpdateConfiguration", "maxSurge") is None:
        return (
            "the cluster's LeaderWorkerSet has no rolloutStrategy.rollingUpdateConfiguration.maxSurge: "
            f"Pagoda needs LeaderWorkerSet {MIN_VERSION} or newer "
            "(https://github.com/kubernetes-sigs/lws/releases); upgrade it, or set nodesPerReplica: 1"
        )
    return None


async def check(kube: Reader, cache: dict[str, Any] | None = None) -> str | None:
    """The installed LeaderWorkerSet's problem, read once into ``cache`` (every call without one)."""
    if cache is not None and CHECKED in cache:
        return cache[CHECKED]
    try:
        found = problem(await kube.read(OPENAPI_PATH))
    except ApiError as err:  # not published to this client: nothing to judge by
        log.info("cannot read the LeaderWorkerSet schema (%s); assuming a supported version", err.status)
        found = None
    if cache is not None:
        cache[CHECKED] = found
    return found
