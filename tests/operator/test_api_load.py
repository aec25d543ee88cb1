"""API-server load: the calls one steady-state pass makes for a ModelDeployment of 100 pods, and
the pod and Lease writes an agent makes per minute. The budgets are documented in docs/operator.md (Load)."""

from __future__ import annotations

import asyncio
import collections
import datetime as dt
import json
from typing import Any

import pytest
from fake_kube import FakeKube, merge_patch
from op_schema import admit, example

from pagoda.agent_report import REPORT_ANNOTATION, AgentReport, to_annotation
from pagoda.node_agent.agent import reporter as reporter_mod
from pagoda.node_agent.agent.reporter import AgentReporter, ReporterConfig
from pagoda.node_agent.serving.api.metrics import EngineSnapshot
from pagoda.operator.config import Config
from pagoda.operator.reconcile import reconcile
from pagoda.operator.watch_cache import CACHED_KINDS, CachedKube, WatchCache

NS = "default"
PODS = 100
# A steady pass (nothing to change) of a ModelDeployment with two pools and a router, whatever its
# number of pods: these reads and no write at all. Every child comes from the watch cache
# (watch_cache.py) and the Secret from its minute of memory; left are the pod list, the agents'
# Lease list and the LeaderWorkerSet discovery (which the real client answers from memory for a
# minute once it says yes).
READS_PER_PASS = 3
UNCACHED_READS_PER_PASS = 37
PODS_LISTS_PER_PASS = 1
# An agent renews its Lease every interval (10 s) and writes its pod when its figures change, else
# once a heartbeat (300 s); without a Lease (refused) its pod report is the heartbeat, every 30 s.
LEASE_WRITES_PER_5_MIN = 30  # 6 per agent-minute
IDLE_POD_WRITES_PER_5_MIN = 1  # 0.2 per agent-minute
BUSY_POD_WRITES_PER_5_MIN = 30  # figures change every interval: 6 per agent-minute
NO_LEASE_IDLE_POD_WRITES_PER_5_MIN = 10  # 2 per agent-minute, as before the Lease


class CountingKube(FakeKube):
    """FakeKube that counts every call by verb and kind."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter[tuple[str, str]] = collections.Counter()

    async def get(self, kind: str, namespace: str, name: str) -> Any:
        self.calls[("get", kind)] += 1
        return await super().get(kind, namespace, name)

    async def list(self, kind: str, namespace: str, labels: dict[str, str]) -> Any:
        self.calls[("list", kind)] += 1
        return await super().list(kind, namespace, labels)

    async def served(self, kind: str) -> bool:
        self.calls[("discovery", kind)] += 1
        return await super().served(kind)


def _pods(kube: FakeKube, now: dt.datetime) -> None:
    for i in range(PODS):
        pool = "decode" if i % 2 else "prefill"
        report = AgentReport(pool=pool, ready=True, kv_capacity_tokens=1000, last_report_time=now)
        meta = {
            "name": f"smollm-{pool}-{i}",
            "namespace": NS,
            "labels": {"pagoda.dev/model-deployment": "smollm", "pagoda.dev/pool": pool},
            "annotations": {REPORT_ANNOTATION: to_annotation(report)},
        }
        kube.put({"apiVersion": "v1", "kind": "Pod", "metadata": meta})


def _cluster(now: dt.datetime) -> CountingKube:
    kube = CountingKube()
    body = admit(example("smollm", prefill={"gpus": 0, "replicas": 50}, decode={"gpus": 0, "replicas": 50}))
    body["metadata"].update(namespace=NS, uid="uid-md", generation=1)
    kube.objects[("ModelDeployment", NS, "smollm")] = body
    _pods(kube, now)
    return kube


def _steady_pass(kube: CountingKube, client: Any, now: dt.datetime) -> None:
    windows: dict = {}

    def run(at: dt.datetime) -> None:
        md = kube.objects[("ModelDeployment", NS, "smollm")]
        asyncio.run(reconcile(client, md, Config(), now=at, windows=windows))

    run(now)  # creates the children
    run(now + dt.timedelta(seconds=1))  # settles the status
    kube.calls.clear()
    kube.writes.clear()
    run(now + dt.timedelta(seconds=2))


@pytest.mark.parametrize("cached", [True, False], ids=["watch-cache", "uncached"])
def test_a_steady_pass_at_100_pods_stays_within_its_read_budget_and_writes_nothing(cached: bool) -> None:
    now = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)
    kube = _cluster(now)
    _steady_pass(kube, CachedKube(kube, WatchCache()) if cached else kube, now)
    reads = sum(kube.calls.values())
    assert kube.writes == [], "a steady pass writes nothing"
    assert kube.calls[("list", "Pod")] == PODS_LISTS_PER_PASS  # one list, not one read per pod
    assert kube.calls[("list", "Lease")] == 1  # the agents' heartbeats, one list
    if cached:
        reads_of_children = [
            c for c in kube.calls if c[0] != "discovery" and c[1] in (*CACHED_KINDS, "Secret")
        ]
        assert not reads_of_children, sorted(kube.calls.items())
    assert reads == (READS_PER_PASS if cached else UNCACHED_READS_PER_PASS), sorted(kube.calls.items())


def test_the_watch_cache_follows_events_and_a_deleted_child_comes_back() -> None:
    now = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)
    kube = _cluster(now)
    cache = WatchCache()
    client = CachedKube(kube, cache)
    _steady_pass(kube, client, now)
    key = next(k for k in kube.objects if k[0] == "Service")
    gone = kube.objects.pop(key)
    cache.observe("Service", gone, deleted=True)  # the watch's DELETED event
    md = kube.objects[("ModelDeployment", NS, "smollm")]
    asyncio.run(reconcile(client, md, Config(), now=now + dt.timedelta(seconds=3), windows={}))
    assert key in kube.objects, "the deleted child was recreated"
    assert not [c for c in kube.calls if c[0] == "get" and c[1] == "Service"]

    def at(version: str) -> dict:
        return {
            **kube.objects[key],
            "metadata": {**kube.objects[key]["metadata"], "resourceVersion": version},
        }

    newest = at("7")
    cache.observe("Service", newest)
    cache.observe("Service", at("3"))  # an older state arriving late (a LIST answer) is ignored
    assert cache.objects[key] is newest


def test_a_child_whose_labels_were_edited_away_leaves_the_cache() -> None:
    cache = WatchCache()
    ours = {"metadata": {"namespace": NS, "name": "s", "labels": {"app.kubernetes.io/managed-by": "pagoda-operator",
                                                                   "pagoda.dev/model-deployment": "smollm"}}}  # fmt: skip
    assert cache.follow("Service", ours) == "smollm"
    edited = {
        "metadata": {"namespace": NS, "name": "s", "labels": {"app.kubernetes.io/managed-by": "someone"}}
    }
    assert cache.follow("Service", edited) == "smollm"  # its owner repairs it
    assert ("Service", NS, "s") not in cache.objects and ("Service", NS, "s") in cache.ask
    assert cache.follow("Service", {"metadata": {"namespace": NS, "name": "other"}}) is None


def test_a_foreign_object_met_on_create_is_read_from_the_api() -> None:
    from pagoda.operator.kube import ApiError

    class Foreign(CountingKube):
        async def create(self, obj: Any) -> Any:
            raise ApiError(409, '{"message": "already exists"}')

    kube = Foreign()
    cache = WatchCache()
    client = CachedKube(kube, cache)
    obj = {"kind": "Service", "metadata": {"namespace": NS, "name": "x"}}
    asyncio.run(client.get("Service", NS, "x"))  # lists once: known absent
    with pytest.raises(ApiError):
        asyncio.run(client.create(obj))
    kube.put({"apiVersion": "v1", **obj})
    assert asyncio.run(client.get("Service", NS, "x")) is not None  # read again, not "absent"


class _Resp:
    def __init__(self, status: int = 200, body: dict | None = None) -> None:
        self.status_code = status
        self.body = body or {}
        self.text = json.dumps(self.body)

    def json(self) -> dict:
        return self.body


class _Client:
    """The API as an agent sees it: its pod and its Lease (create, merge patch); with
    ``leases=False`` the Lease calls are refused (no RBAC for them: an older chart)."""

    def __init__(self, leases: bool = True) -> None:
        self.leases = leases
        self.pod_writes = 0
        self.lease_writes = 0
        self.lease: dict | None = None

    async def patch(self, url: str, content: str, **_: Any) -> _Resp:
        if "/leases/" not in url:
            self.pod_writes += 1
            return _Resp(body={"metadata": {"uid": "uid-pod"}})
        if not self.leases:
            return _Resp(403)
        if self.lease is None:
            return _Resp(404)
        self.lease_writes += 1
        self.lease = merge_patch(self.lease, json.loads(content))
        return _Resp(200, self.lease)

    async def post(self, _url: str, content: str, **_: Any) -> _Resp:
        if not self.leases:
            return _Resp(403)
        self.lease_writes += 1
        self.lease = json.loads(content)
        return _Resp(201, self.lease)


@pytest.mark.parametrize(
    ("busy", "leases", "pod_writes", "lease_writes"),
    [
        (False, True, IDLE_POD_WRITES_PER_5_MIN, LEASE_WRITES_PER_5_MIN),
        (True, True, BUSY_POD_WRITES_PER_5_MIN, LEASE_WRITES_PER_5_MIN),
        (False, False, NO_LEASE_IDLE_POD_WRITES_PER_5_MIN, 0),
    ],
    ids=["idle", "busy", "idle-without-lease"],
)
def test_agent_writes_per_five_minutes(
    monkeypatch: pytest.MonkeyPatch, busy: bool, leases: bool, pod_writes: int, lease_writes: int
) -> None:
    clock = [1000.0]
    monkeypatch.setattr(reporter_mod.time, "monotonic", lambda: clock[0])
    running = [0]

    def snapshot() -> EngineSnapshot:
        return EngineSnapshot(ready=True, running=running[0], model="m")

    cfg = ReporterConfig.from_env(
        "decode",
        env={"PAGODA_MD_NAME": "smollm", "PAGODA_MD_NAMESPACE": NS, "PAGODA_POD_NAME": "smollm-decode-0"},
    )
    assert cfg is not None and (cfg.interval_s, cfg.heartbeat_s) == (10.0, 300.0)  # the defaults
    rep = AgentReporter(cfg, snapshot, auth=reporter_mod.KubeAuth("https://api", {}))
    client = _Client(leases)

    async def minutes(n: int) -> None:
        for _ in range(6 * n):  # what the reporter's loop does every 10 s
            await rep.report_once(client, force=False)  # type: ignore[arg-type]
            await rep.renew_lease(client)  # type: ignore[arg-type]
            clock[0] += 10.0
            if busy:
                running[0] = (running[0] + 1) % 4  # the figures change every interval

    asyncio.run(minutes(5))  # the first minutes start with the first report and the Lease's creation
    client.pod_writes = client.lease_writes = 0
    asyncio.run(minutes(5))
    assert (client.pod_writes, client.lease_writes) == (pod_writes, lease_writes)
    if leases:  # the Lease names its pod as owner (garbage collection) and its holder
        lease = client.lease or {}
        assert lease["metadata"]["ownerReferences"] == [
            {"apiVersion": "v1", "kind": "Pod", "name": "smollm-decode-0", "uid": "uid-pod"}
        ]
        assert (
            lease["spec"]["holderIdentity"] == "smollm-decode-0"
            and lease["spec"]["leaseDurationSeconds"] == 30
        )


def test_api_discovery_is_asked_once_a_minute(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagoda.operator import kube as kube_mod

    clock = [100.0]
    monkeypatch.setattr(kube_mod.time, "monotonic", lambda: clock[0])
    calls: list[str] = []
    served = [True]

    class Info:
        server = "https://api"

    kube = kube_mod.Kube(Info())  # type: ignore[arg-type]

    async def call(method: str, url: str, *_: Any) -> dict:
        calls.append(url)
        return {"resources": [{"name": "leaderworkersets"}] if served[0] else []}

    monkeypatch.setattr(kube, "_call", call)

    async def passes() -> list[bool]:
        out = []
        for _ in range(7):  # a pass every 10 s
            out.append(await kube.served("LeaderWorkerSet"))
            clock[0] += 10.0
        return out

    assert asyncio.run(passes()) == [True] * 7
    assert calls == ["/apis/leaderworkerset.x-k8s.io/v1"] * 2  # at 0 s and at 60 s
    served[0] = False  # not installed: asked at every pass, so an install shows at the next one
    calls.clear()
    clock[0] += 60.0
    assert asyncio.run(passes()) == [False] * 7 and len(calls) == 7
