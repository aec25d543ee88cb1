"""An informer-style cache of the operator's children: reads of the watched kinds come from what
the watches delivered, not from a GET per child per pass.

Kubernetes controllers read their world from informers (a LIST, then a WATCH keeping it current)
rather than asking the API server for every object on every pass. Here kopf's watches of the
child kinds (handlers.py) feed ``WatchCache.observe``; the first read of a kind in a namespace
LISTs the operator's objects of that kind once (so an absent child is known absent, not asked
for), and every write updates the cache from the API server's answer. Between the LIST and the
events, the newer ``resourceVersion`` wins (etcd revisions; kept by arrival when not numeric).
A create refused as already existing (an object this operator does not own) reads that one
object from the API, as before.

Secrets are not watched (list/watch would stream every Secret of the watched namespaces into the
operator); a Secret read is kept ``secret_ttl_s`` (``Config.secret_cache_s``) once found, with its values blanked (the passes
only ask whether it exists, its uid, and which keys are set), and asked again at every pass while
absent, so a Secret created later is seen at once.
"""

from __future__ import annotations

import time
from typing import Any

from .children import MANAGED_BY, MD_LABEL

Obj = dict[str, Any]
Key = tuple[str, str, str]  # kind, namespace, name
MANAGED = {"app.kubernetes.io/managed-by": MANAGED_BY}
# The kinds kopf watches (handlers.py registers one event handler for each): every child kind
# the operator reconciles but Secrets. Deployments and LeaderWorkerSets included: the watch
# delivers their status (ready replicas) as the API server holds it. Every other kind is read
# from the API server as before.
CACHED_KINDS = (
    "Deployment",
    "Service",
    "ServiceAccount",
    "Role",
    "RoleBinding",
    "NetworkPolicy",
    "PodDisruptionBudget",
    "HorizontalPodAutoscaler",
    "LeaderWorkerSet",
    "InferencePool",
    "HTTPRoute",
)
# Kinds of optional CRDs: kopf watches them only when they are served at the operator's start
# (it resolves resources once), so they are cached only then (handlers.py drops the others).
OPTIONAL_KINDS = ("LeaderWorkerSet", "InferencePool", "HTTPRoute")
SECRET_TTL_S = 60.0  # how long a found Secret is answered from memory, by default


def _version(obj: Obj) -> int | None:
    rv = obj.get("metadata", {}).get("resourceVersion")
    return int(rv) if isinstance(rv, str) and rv.isdigit() else None


class WatchCache:
    """The latest state of the operator's children of the cached kinds, by kind, namespace, name."""

    def __init__(self, kinds: tuple[str, ...] = CACHED_KINDS) -> None:
        self.kinds = frozenset(kinds)
        self.objects: dict[Key, Obj] = {}
        self.gone: dict[Key, int | None] = {}  # deleted: the version of the deletion
        self.synced: set[tuple[str, str]] = set()  # (kind, namespace) listed once
        self.ask: set[Key] = set()  # objects the cache cannot answer for: read from the API

    def observe(self, kind: str, obj: Obj, deleted: bool = False) -> None:
        """One watch event (or a write's answer): keep it unless an event already seen is newer."""
        meta = obj.get("metadata", {})
        if kind not in self.kinds or not meta.get("name") or not meta.get("namespace"):
            return
        key = (kind, meta["namespace"], meta["name"])
        new = _version(obj)
        old = self.objects.get(key)
        seen = _version(old) if old is not None else self.gone.get(key)
        if new is not None and seen is not None and new < seen:
            return  # an older state arriving late (a LIST answer after a newer event)
        if deleted:
            self.objects.pop(key, None)
            self.gone[key] = new
        else:
            self.objects[key] = obj
            self.gone.pop(key, None)
        self.ask.discard(key)

    def follow(self, kind: str, obj: Obj, deleted: bool = False) -> str | None:
        """One watch event of any object of ``kind``: the ModelDeployment owning it (from its
        labels, or from the cached copy when an edit took the operator's labels away), or None
        when it is not the operator's. The cache keeps the operator's objects only."""
        meta = obj.get("metadata") or {}
        labels = meta.get("labels") or {}
        key = (kind, meta.get("namespace") or "", meta.get("name") or "")
        if labels.get(MD_LABEL) and MANAGED.items() <= labels.items():
            self.observe(kind, obj, deleted)
            return labels[MD_LABEL]
        was = self.objects.get(key)
        if was is None:
            return None
        self.forget(*key)  # no longer one of ours: read it from the API, which the pass repairs
        return (was["metadata"].get("labels") or {}).get(MD_LABEL)

    def forget(self, kind: str, namespace: str, name: str) -> None:
        """Not known (e.g. a foreign object met on create, which the LIST of the operator's own
        objects cannot show): reads of it go to the API until a watch event or a write tells."""
        key = (kind, namespace, name)
        self.objects.pop(key, None)
        self.gone.pop(key, None)
        self.ask.add(key)


def _blanked(secret: Obj) -> Obj:
    """A Secret as the passes need it: metadata and which keys are set, never the values."""
    return {**secret, "data": {k: ("x" if v else "") for k, v in (secret.get("data") or {}).items()}}


class CachedKube:
    """A Kube whose reads of the cached kinds come from a WatchCache; everything else is passed on."""

    def __init__(self, kube: Any, cache: WatchCache, secret_ttl_s: float = SECRET_TTL_S) -> None:
        self.kube = kube
        self.cache = cache
        self.secret_ttl_s = secret_ttl_s
        self.secrets: dict[tuple[str, str], tuple[float, Obj]] = {}  # found Secrets, blanked

    async def _secret(self, namespace: str, name: str) -> Obj | None:
        key, now = (namespace, name), time.monotonic()
        kept = self.secrets.get(key)
        if kept is not None and now - kept[0] < self.secret_ttl_s:
            return kept[1]
        live = await self.kube.get("Secret", namespace, name)
        if live is None:
            self.secrets.pop(key, None)
            return None
        self.secrets[key] = (now, _blanked(live))
        return self.secrets[key][1]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.kube, name)

    async def _sync(self, kind: str, namespace: str) -> None:
        if (kind, namespace) in self.cache.synced:
            return
        for obj in await self.kube.list(kind, namespace, MANAGED):
            self.cache.observe(kind, obj)
        self.cache.synced.add((kind, namespace))

    async def get(self, kind: str, namespace: str, name: str) -> Obj | None:
        if kind == "Secret":
            return await self._secret(namespace, name)
        if kind not in self.cache.kinds or (kind, namespace, name) in self.cache.ask:
            return await self.kube.get(kind, namespace, name)
        await self._sync(kind, namespace)
        hit = self.cache.objects.get((kind, namespace, name))
        if hit is None and (kind, namespace) not in self.cache.synced:
            return await self.kube.get(kind, namespace, name)
        return hit

    async def list(self, kind: str, namespace: str, labels: dict[str, str]) -> list[Obj]:
        if kind not in self.cache.kinds or not MANAGED.items() <= labels.items():
            return await self.kube.list(kind, namespace, labels)
        await self._sync(kind, namespace)
        return [
            o
            for (k, ns, _), o in self.cache.objects.items()
            if k == kind and ns == namespace and labels.items() <= (o["metadata"].get("labels") or {}).items()
        ]

    async def create(self, obj: Obj) -> Obj:
        from .kube import ApiError

        meta = obj["metadata"]
        try:
            out = await self.kube.create(obj)
        except ApiError as err:
            if err.status == 409:  # exists but not in the cache: a foreign object, read it directly
                self.cache.forget(obj["kind"], meta["namespace"], meta["name"])
            raise
        self.cache.observe(obj["kind"], out or obj)
        if obj["kind"] == "Secret" and out:
            self.secrets[(meta["namespace"], meta["name"])] = (time.monotonic(), _blanked(out))
        return out

    async def patch(
        self, kind: str, namespace: str, name: str, patch: Obj, subresource: str | None = None
    ) -> Obj:
        out = await self.kube.patch(kind, namespace, name, patch, subresource)
        if out and subresource is None:
            self.cache.observe(kind, out)
        else:
            self.cache.forget(kind, namespace, name)
        return out

    async def apply(self, url: str, obj: Obj) -> Obj:
        out = await self.kube.apply(url, obj)
        if out and obj.get("kind") in self.cache.kinds:
            self.cache.observe(obj["kind"], out)
        return out

    async def delete(self, kind: str, namespace: str, name: str, uid: str | None = None) -> bool:
        gone = await self.kube.delete(kind, namespace, name, uid)
        if kind in self.cache.kinds:
            self.cache.objects.pop((kind, namespace, name), None)
        if kind == "Secret":
            self.secrets.pop((namespace, name), None)
        return gone
