"""kopf handlers: every trigger (create, update, resume, timer, child change) runs the same pass."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

import kopf

from . import children, crd, metrics, quality_gate
from .config import Config
from .kube import Kube
from .reconcile import reconcile
from .spec import GROUP, PLURAL, VERSION
from .watch_cache import OPTIONAL_KINDS, CachedKube, WatchCache

MD = (GROUP, VERSION, PLURAL)


@dataclass
class Memo:
    """Operator-wide state shared by the handlers (kopf passes it as ``memo``)."""

    cfg: Config
    kube: Kube | CachedKube | None = None
    # What the child watches have delivered: the passes read children from it (watch_cache.py).
    cache: WatchCache = field(default_factory=WatchCache)
    locks: dict[tuple[str, str], asyncio.Lock] = field(default_factory=dict)
    # Mismatch-rate window snapshot (per-agent counter baselines) per ModelDeployment.
    windows: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    # The installed LeaderWorkerSet's version check, done once per run (lws_support).
    lws_checked: dict[str, Any] = field(default_factory=dict)
    # The ModelDeployments the watch has seen and not seen deleted: the resync loop's work list.
    known: set[tuple[str, str]] = field(default_factory=set)
    # The resync loop, in a dict: kopf hands each object a shallow copy of the memo, so only a
    # shared container holds one loop for all of them.
    tasks: dict[str, asyncio.Task] = field(default_factory=dict)
    # The quality gates being scored (their decisions are written into the objects' status).
    gates: quality_gate.GateRunner = field(default_factory=quality_gate.GateRunner)

    def lock(self, namespace: str, name: str) -> asyncio.Lock:
        return self.locks.setdefault((namespace, name), asyncio.Lock())


def _emitter(body: Any, logger: logging.Logger | logging.LoggerAdapter) -> Any:
    def emit(kind: str, reason: str, message: str) -> None:
        kopf.event(body, type=kind, reason=reason, message=message)
        logger.info("%s: %s", reason, message)

    return emit


async def _pass(memo: Memo, body: dict[str, Any], logger: Any, trigger: str = "change") -> None:
    if memo.kube is None:
        raise kopf.TemporaryError("not logged in yet", delay=1)
    meta = body["metadata"]
    lock = memo.lock(meta["namespace"], meta["name"])

    async def repass() -> None:  # a gate task's decision is written: act on it now
        await _pass(memo, {"metadata": {"namespace": meta["namespace"], "name": meta["name"]}}, log, "gate")

    async with lock:
        # Re-read under the lock: the body kopf hands over may predate the previous pass's writes.
        async with metrics.timed(trigger):
            fresh = await memo.kube.get("ModelDeployment", meta["namespace"], meta["name"])
            if fresh is None or fresh.get("metadata", {}).get("deletionTimestamp"):
                return
            await reconcile(
                memo.kube,
                fresh,
                memo.cfg,
                emit=_emitter(fresh, logger),
                windows=memo.windows,
                lws_checked=memo.lws_checked,
                hooks=quality_gate.Hooks(memo.gates, lock, repass),
            )


log = logging.getLogger("pagoda.operator")


async def _cache_served(kube: Kube, cache: WatchCache, logger: Any) -> None:
    """Drop from the cache the optional kinds not served at start: kopf does not watch those."""
    for kind in OPTIONAL_KINDS:
        try:
            served = await kube.served(kind)
        except Exception as err:  # undecided: read that kind from the API, never a stale cache
            logger.warning("cannot discover %s: %s", kind, err)
            served = False
        if not served:
            cache.kinds = cache.kinds - {kind}


async def resync_loop(memo: Memo, interval_s: float) -> None:
    """Every ``interval_s``, one pass of each known ModelDeployment (level-based repair and status).

    A kopf timer would do the same, but kopf puts a finalizer on every object a timer runs on, and
    a finalizer makes deletion wait for the operator; this loop needs none."""
    while True:
        await asyncio.sleep(interval_s)
        keys = sorted(memo.known)
        results = await asyncio.gather(
            *(_pass(memo, {"metadata": {"namespace": ns, "name": name}}, log, "resync") for ns, name in keys),
            return_exceptions=True,
        )
        for (ns, name), result in zip(keys, results, strict=True):
            if isinstance(result, Exception) and not isinstance(result, kopf.TemporaryError):
                log.warning("resync of %s/%s failed: %s", ns, name, result)


def register(registry: kopf.OperatorRegistry, cfg: Config) -> kopf.OperatorRegistry:
    """Add the operator's handlers to a registry, with the settings' timer interval."""

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.scanning.disabled = True
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
        # No handler needs a finalizer (no delete handler, no kopf timer), so kopf adds none and
        # removes this one from objects an older operator marked: a ModelDeployment (or its
        # namespace) deletes without the operator running; the garbage collector takes the children.
        settings.persistence.finalizer = f"{GROUP}/operator"
        settings.watching.server_timeout = 300
        settings.posting.level = logging.INFO
        settings.posting.loggers = False  # Events only for what reconcile() emits, never per log line

    @kopf.on.startup(registry=registry)
    def serve_metrics(logger: Any, **_: Any) -> None:
        """The operator's own metrics on PAGODA_METRICS_PORT (none when 0)."""
        if cfg.metrics_port:
            metrics.serve(cfg.metrics_port)
            logger.info("operator metrics on :%d/metrics", cfg.metrics_port)

    @kopf.on.startup(registry=registry)
    async def install_crd(settings: kopf.OperatorSettings, memo: Memo, logger: Any, **_: Any) -> None:
        """Server-side apply the CRD (PAGODA_INSTALL_CRD, --no-install-crd); failures are logged.
        Then keep in the watch cache only the optional kinds served now, the ones kopf watches."""
        info = kopf.login_with_service_account(
            settings=settings, logger=logger
        ) or kopf.login_with_kubeconfig(settings=settings, logger=logger)
        if info is None:
            logger.warning("no credentials to install the CRD with")
            return
        kube = Kube(info)
        try:
            if cfg.install_crd:
                await crd.install(kube, crd_file=cfg.crd_file)
            await _cache_served(kube, memo.cache, logger)
        finally:
            await kube.close()

    @kopf.on.login(registry=registry)
    def login(memo: Memo, **kwargs: Any) -> kopf.ConnectionInfo | None:
        info = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
        if info is not None:
            memo.kube = CachedKube(Kube(info), memo.cache, memo.cfg.secret_cache_s)
        return info

    @kopf.on.cleanup(registry=registry)
    async def close(memo: Memo, **_: Any) -> None:
        for task in memo.tasks.values():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await memo.gates.close()
        if memo.kube is not None:
            await memo.kube.close()

    @kopf.on.resume(*MD, registry=registry)
    @kopf.on.create(*MD, registry=registry)
    @kopf.on.update(*MD, registry=registry)
    async def converge(body: kopf.Body, memo: Memo, logger: Any, **_: Any) -> None:
        await _pass(memo, dict(body), logger)

    @kopf.on.event(*MD, registry=registry)
    async def track(body: kopf.Body, type: str | None, memo: Memo, **_: Any) -> None:
        """Keep the resync loop's list of ModelDeployments (an event handler needs no finalizer).
        The loop starts from here, so that it inherits the handler context kopf.event posts in."""
        if "resync" not in memo.tasks:
            memo.tasks["resync"] = asyncio.create_task(resync_loop(memo, cfg.resync_s), name="pagoda-resync")
        key = (body["metadata"]["namespace"], body["metadata"]["name"])
        if type == "DELETED":  # its children go with it through their ownerReferences
            memo.known.discard(key)
            memo.locks.pop(key, None)
            memo.windows.pop(key, None)
            memo.gates.stop(*key)
            log.info("ModelDeployment %s/%s deleted; the garbage collector removes its children", *key)
        else:
            memo.known.add(key)

    # Secrets are not watched: that would need list/watch on every Secret in the watched
    # namespaces. A deleted ``<md>-internal`` Secret comes back on a later resync pass.
    # LeaderWorkerSets and the Gateway kinds are watched when their CRDs are installed at start
    # (kopf resolves resources once); otherwise, or when installed later, they are read from the
    # API at every pass. The watched kinds feed the watch cache the passes read children from.
    for kind, (group, version, plural) in {
        "Deployment": ("apps", "v1", "deployments"),
        "Service": ("", "v1", "services"),
        "ServiceAccount": ("", "v1", "serviceaccounts"),
        "Role": ("rbac.authorization.k8s.io", "v1", "roles"),
        "RoleBinding": ("rbac.authorization.k8s.io", "v1", "rolebindings"),
        "InferencePool": ("inference.networking.k8s.io", "v1", "inferencepools"),
        "HTTPRoute": ("gateway.networking.k8s.io", "v1", "httproutes"),
        "NetworkPolicy": ("networking.k8s.io", "v1", "networkpolicies"),
        "PodDisruptionBudget": ("policy", "v1", "poddisruptionbudgets"),
        "HorizontalPodAutoscaler": ("autoscaling", "v2", "horizontalpodautoscalers"),
        "LeaderWorkerSet": ("leaderworkerset.x-k8s.io", "v1", children.LWS_PLURAL),
    }.items():

        @kopf.on.event(group, version, plural, registry=registry)
        async def child_changed(
            body: kopf.Body, type: str | None, memo: Memo, logger: Any, cached_kind: str = kind, **_: Any
        ) -> None:
            """Keep the watch cache; a child changed or went away: repair it now rather than at
            the next resync. Not filtered by label in kopf: an object whose labels were edited
            away from the operator's must leave the cache too (and be repaired)."""
            owner = memo.cache.follow(cached_kind, dict(body), deleted=type == "DELETED")
            if owner is None or type not in ("MODIFIED", "DELETED") or memo.kube is None:
                return
            md = {"metadata": {"namespace": body["metadata"]["namespace"], "name": owner}}
            try:
                await _pass(memo, md, logger, "child")
            except Exception as err:  # the resync loop retries; a child event must not crash the watcher
                logger.warning("repair of %s after a child change failed: %s", owner, err)

    return registry
