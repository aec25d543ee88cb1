"""The agent reporter: this pod's report in its own Pod, its heartbeat in its own Lease.

On when ``PAGODA_MD_NAME`` and ``PAGODA_POD_NAME`` are set (the operator sets them); off otherwise.
Every interval the agent renews its Lease (``coordination.k8s.io/v1``, named as its pod, owned by
it: pagoda/agent_lease.py), the heartbeat the operator reads liveness from, and builds its report,
written into the Pod only when its figures changed, else once a heartbeat
(``PAGODA_REPORT_HEARTBEAT_S``, 300 s; 30 s while the Lease cannot be renewed, so that an operator
reading the pod report alone still sees the agent live). Each report is a JSON merge patch of this
Pod's ``pagoda.dev/agent-report`` annotation: an ``AgentReport`` (pagoda/agent_report.py, the shape
the operator reads) as compact JSON. The operator reads the pods of its ModelDeployment and keeps
only sums and the worst agents in the CR status, so the CR stays small whatever the number of
pods, and agents and operator never write the same object.
Credentials: the pod's ServiceAccount when in a cluster, else ``KUBECONFIG`` / ``~/.kube/config``
(server, token or client certificate, CA).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime as dt
import json
import logging
import os
import pathlib
import ssl
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httpx

from pagoda.agent_lease import LEASES_PATH, lease_body, micro_time, pod_owner
from pagoda.agent_report import (
    REPORT_ANNOTATION,
    AgentReport,
    IntegrityReport,
    PhaseFormats,
    QualityReport,
    to_annotation,
)
from pagoda.node_agent.serving.api.metrics import EngineSnapshot

log = logging.getLogger("pagoda.reporter")

SA_DIR = pathlib.Path("/var/run/secrets/kubernetes.io/serviceaccount")
API = "/api/v1/namespaces/{ns}/pods/{pod}"
FALLBACK_HEARTBEAT_S = 30.0  # the pod report's heartbeat while the Lease cannot be renewed
JSON = {"Content-Type": "application/json"}
MERGE = {"Content-Type": "application/merge-patch+json"}


@dataclass
class ReporterConfig:
    md_name: str
    namespace: str
    pod: str
    pool: str
    node: str = ""
    interval_s: float = 10.0
    # An unchanged report (same figures, only a newer time) is written at most this often: an idle
    # agent's liveness is its Lease, renewed every interval; its pod is written once a heartbeat.
    heartbeat_s: float = 300.0
    lease: bool = True  # renew a Lease every interval (PAGODA_AGENT_LEASE=0: the pod report alone)

    @classmethod
    def from_env(
        cls, pool: str, interval: float | None = None, env: dict[str, str] | None = None
    ) -> ReporterConfig | None:
        """The reporter's settings from the pod's environment, or None when not in a deployment."""
        env = dict(os.environ) if env is None else env
        name, pod = env.get("PAGODA_MD_NAME"), env.get("PAGODA_POD_NAME")
        if not name or not pod:
            return None
        ns = env.get("PAGODA_MD_NAMESPACE") or _sa_namespace() or "default"
        every = interval if interval is not None else float(env.get("PAGODA_REPORT_INTERVAL_S") or 10)
        heartbeat = max(every, float(env.get("PAGODA_REPORT_HEARTBEAT_S") or cls.heartbeat_s))
        lease = (env.get("PAGODA_AGENT_LEASE") or "1").strip().lower() not in ("0", "false", "no", "off")
        return cls(
            name,
            ns,
            pod,
            env.get("PAGODA_POOL") or pool,
            env.get("PAGODA_NODE_NAME", ""),
            every,
            heartbeat,
            lease,
        )

    @property
    def path(self) -> str:
        return API.format(ns=quote(self.namespace), pod=quote(self.pod))

    @property
    def leases_path(self) -> str:
        return LEASES_PATH.format(ns=quote(self.namespace))

    @property
    def lease_duration_s(self) -> int:
        """The Lease's ``leaseDurationSeconds``: three intervals without a renewal."""
        return max(1, round(3 * self.interval_s))


def _sa_namespace() -> str | None:
    with contextlib.suppress(OSError):
        return (SA_DIR / "namespace").read_text().strip()
    return None


@dataclass
class KubeAuth:
    server: str
    headers: dict[str, str]
    verify: Any = True
    cert: Any = None

    @classmethod
    def discover(cls) -> KubeAuth:
        """In-cluster ServiceAccount first, then the kubeconfig's current context."""
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
        token_file = SA_DIR / "token"
        if host and port and token_file.exists():
            ca = SA_DIR / "ca.crt"
            return cls(
                f"https://{host}:{port}",
                {"Authorization": f"Bearer {token_file.read_text().strip()}"},
                str(ca) if ca.exists() else True,
            )
        return cls.from_kubeconfig(os.environ.get("KUBECONFIG") or str(pathlib.Path.home() / ".kube/config"))

    @classmethod
    def from_kubeconfig(cls, path: str) -> KubeAuth:
        import yaml

        cfg = yaml.safe_load(pathlib.Path(path.split(os.pathsep)[0]).read_text())
        ctx_name = cfg.get("current-context")
        ctx = next(
            (c["context"] for c in cfg.get("contexts", []) if c["name"] == ctx_name),
            (cfg.get("contexts") or [{"context": {}}])[0]["context"],
        )
        cluster = next(c["cluster"] for c in cfg["clusters"] if c["name"] == ctx.get("cluster", c["name"]))
        user = next((u["user"] for u in cfg.get("users", []) if u["name"] == ctx.get("user")), {})
        headers = {"Authorization": f"Bearer {user['token']}"} if user.get("token") else {}
        verify: Any = True
        if cluster.get("insecure-skip-tls-verify"):
            verify = False
        elif cluster.get("certificate-authority"):
            verify = cluster["certificate-authority"]
        elif cluster.get("certificate-authority-data"):
            verify = _data_file(cluster["certificate-authority-data"])
        cert = None
        crt = user.get("client-certificate") or (
            _data_file(user["client-certificate-data"]) if user.get("client-certificate-data") else None
        )
        key = user.get("client-key") or (
            _data_file(user["client-key-data"]) if user.get("client-key-data") else None
        )
        if crt and key:
            cert = (crt, key)
        return cls(cluster["server"].rstrip("/"), headers, verify, cert)


def _data_file(b64: str) -> str:
    f = tempfile.NamedTemporaryFile("wb", suffix=".pem", delete=False)  # noqa: SIM115
    f.write(base64.b64decode(b64))
    f.close()
    return f.name


def build_report(
    cfg: ReporterConfig,
    snap: EngineSnapshot,
    tokens_per_s: float,
    when: dt.datetime,
    quality: QualityReport | None = None,
) -> AgentReport:
    """This pod's report from an engine snapshot (counters cumulative since the engine started) and
    the last continuous quality probe's figures (None when the pool runs none)."""
    return AgentReport(
        pool=cfg.pool,
        node=cfg.node,
        ready=snap.ready,
        model=snap.model,
        formats=PhaseFormats.from_formats(snap.formats),
        weight_bytes=snap.weight_bytes,
        kv_capacity_tokens=snap.kv_capacity_tokens,
        kv_used_tokens=snap.kv_used_tokens,
        tokens_per_second=round(tokens_per_s, 3),
        running_requests=snap.running,
        waiting_requests=snap.waiting,
        integrity=IntegrityReport.from_counters(snap.integrity_mode, snap.integrity),
        # No ``weights`` split: Prometheus scrapes it (pagoda_weight_part_bytes and
        # pagoda_weight_format_bytes); the report keeps the total the status sums.
        last_report_time=when.replace(microsecond=0),
        quality=quality,
    )


class AgentReporter:
    """An asyncio task that sends the report every ``interval_s`` (failures are logged and retried)."""

    def __init__(
        self,
        cfg: ReporterConfig,
        snapshot: Callable[[], EngineSnapshot],
        auth: KubeAuth | None = None,
        quality: Callable[[], QualityReport | None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.snapshot = snapshot
        self.quality = quality  # the continuous probe's last figures (quality_loop.py), when on
        self.auth = auth
        self.sent = 0
        self.failures = 0
        self._task: asyncio.Task | None = None
        self._prev: tuple[float, int] | None = None
        self._last: tuple[float, dict[str, Any]] | None = None  # (monotonic time, figures) last sent
        self.skipped = 0
        self.pod_uid = ""  # from the first report's answer: the Lease's ownerReference
        self._lease: dict[str, Any] | None = None  # the Lease as last written (its resourceVersion)
        self.lease_ok = False  # the last renewal went through
        self.lease_writes = 0

    async def start(self) -> None:
        self.auth = self.auth or KubeAuth.discover()
        self._task = asyncio.create_task(self._loop(), name="pagoda-agent-reporter")
        log.info("reporting to %s every %.1fs as %s", self.cfg.path, self.cfg.interval_s, self.cfg.pod)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def _rate(self, snap: EngineSnapshot) -> float:
        now = time.monotonic()
        prev, self._prev = self._prev, (now, snap.generation_tokens)
        if prev is None or now <= prev[0]:
            return 0.0
        return max(0, snap.generation_tokens - prev[1]) / (now - prev[0])

    async def report_once(self, client: httpx.AsyncClient, force: bool = True) -> bool:
        """Write this pod's report; unless ``force``, only when its figures changed or the
        heartbeat is due. Returns whether it wrote."""
        snap = self.snapshot()
        quality = self.quality() if self.quality is not None else None
        report = build_report(self.cfg, snap, self._rate(snap), dt.datetime.now(dt.UTC), quality)
        figures = {k: v for k, v in report.to_status().items() if k != "lastReportTime"}
        now = time.monotonic()
        if not force and self._last is not None:
            sent_at, sent = self._last
            # Half an interval of slack: a sleep may end a hair early, and the heartbeat falls
            # on a report of the interval grid either way.
            heartbeat = (
                self.cfg.heartbeat_s if self.lease_ok else min(self.cfg.heartbeat_s, FALLBACK_HEARTBEAT_S)
            )
            if sent == figures and now - sent_at < heartbeat - self.cfg.interval_s / 2:
                self.skipped += 1
                return False
        body = {"metadata": {"annotations": {REPORT_ANNOTATION: to_annotation(report)}}}
        assert self.auth is not None
        resp = await client.patch(
            self.auth.server + self.cfg.path,
            content=json.dumps(body),
            headers=MERGE,
        )
        if resp.status_code >= 300:
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:300]}")
        self.sent += 1
        self._last = (now, figures)
        self.pod_uid = self.pod_uid or _uid_of(resp)
        return True

    async def renew_lease(self, client: httpx.AsyncClient) -> bool:
        """Renew this agent's Lease: a merge patch of its ``renewTime`` (the Lease created when
        absent, owned by the pod once its uid is known). False when it failed."""
        if not self.cfg.lease:
            return False
        assert self.auth is not None
        cfg, now = self.cfg, dt.datetime.now(dt.UTC)
        url = self.auth.server + cfg.leases_path
        spec = {"holderIdentity": cfg.pod, "leaseDurationSeconds": cfg.lease_duration_s}
        patch: dict[str, Any] = {"spec": {**spec, "renewTime": micro_time(now)}}
        owned = ((self._lease or {}).get("metadata") or {}).get("ownerReferences")
        if self.pod_uid and not owned:  # the Lease was created before the pod's uid was known
            patch["metadata"] = {"ownerReferences": [pod_owner(cfg.pod, self.pod_uid)]}
        try:
            resp = await client.patch(f"{url}/{quote(cfg.pod)}", content=json.dumps(patch), headers=MERGE)
            if resp.status_code == 404:
                body = lease_body(
                    cfg.pod, cfg.namespace, cfg.md_name, cfg.pool, self.pod_uid, cfg.lease_duration_s, now
                )
                resp = await client.post(url, content=json.dumps(body), headers=JSON)
            return self._renewed(resp)
        except Exception as exc:  # the pod report's heartbeat stands in meanwhile
            if self.lease_ok or self.lease_writes == 0:
                log.warning("agent lease renewal failed: %s", exc)
            self._lease, self.lease_ok = None, False
            return False

    def _renewed(self, resp: httpx.Response) -> bool:
        if resp.status_code >= 300:
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:300]}")
        self._lease, self.lease_ok = resp.json(), True
        self.lease_writes += 1
        return True

    async def _loop(self) -> None:
        assert self.auth is not None
        verify = self.auth.verify
        if isinstance(verify, str) or self.auth.cert:
            ctx = ssl.create_default_context(cafile=verify if isinstance(verify, str) else None)
            if verify is False:
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
            if self.auth.cert:
                ctx.load_cert_chain(*self.auth.cert)
            verify = ctx
        async with httpx.AsyncClient(headers=self.auth.headers, verify=verify, timeout=10) as client:
            while True:
                try:
                    await self.report_once(client, force=False)
                except Exception as exc:  # keep reporting; the operator marks us stale meanwhile
                    self.failures += 1
                    log.warning("agent report failed: %s", exc)
                await self.renew_lease(client)
                await asyncio.sleep(self.cfg.interval_s)


def _uid_of(resp: Any) -> str:
    """The pod's uid from a pod write's answer ("" when the answer carries none)."""
    try:
        uid = resp.json()["metadata"]["uid"]
    except (AttributeError, KeyError, TypeError, ValueError):
        return ""
    return uid if isinstance(uid, str) else ""
