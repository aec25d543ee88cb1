"""API-server load: the calls one steady-state pass makes for a ModelDeployment of 100 pods, and
the pod writes an agent makes per minute. The budgets are documented in docs/operator.md (Load)."""

from __future__ import annotations

import asyncio
import collections
import datetime as dt
from typing import Any

import pytest
from fake_kube import FakeKube
from op_schema import admit, example

from pagoda.agent_report import REPORT_ANNOTATION, AgentReport, to_annotation
from pagoda.node_agent.agent import reporter as reporter_mod
from pagoda.node_agent.agent.reporter import AgentReporter, ReporterConfig
from pagoda.node_agent.serving.api.metrics import EngineSnapshot
from pagoda.operator.config import Config
from pagoda.operator.reconcile import reconcile

NS = "default"
PODS = 100
# A steady pass (nothing to change) of a ModelDeployment with two pools and a router, whatever its
# number of pods: these reads, one of them the pod list, and no write at all.
READS_PER_PASS = 36
PODS_LISTS_PER_PASS = 1
# An agent whose figures do not change writes its pod once a heartbeat (30 s), not every 10 s.
IDLE_WRITES_PER_AGENT_MINUTE = 2
BUSY_WRITES_PER_AGENT_MINUTE = 6  # figures change every interval: one write per 10 s


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


def test_a_steady_pass_at_100_pods_stays_within_its_read_budget_and_writes_nothing() -> None:
    now = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)
    kube = CountingKube()
    body = admit(example("smollm", prefill={"gpus": 0, "replicas": 50}, decode={"gpus": 0, "replicas": 50}))
    body["metadata"].update(namespace=NS, uid="uid-md", generation=1)
    kube.objects[("ModelDeployment", NS, "smollm")] = body
    _pods(kube, now)
    windows: dict = {}

    def run(at: dt.datetime) -> None:
        md = kube.objects[("ModelDeployment", NS, "smollm")]
        asyncio.run(reconcile(kube, md, Config(), now=at, windows=windows))  # type: ignore[arg-type]

    run(now)  # creates the children
    run(now + dt.timedelta(seconds=1))  # settles the status
    kube.calls.clear()
    kube.writes.clear()
    run(now + dt.timedelta(seconds=2))
    reads = sum(kube.calls.values())
    assert kube.writes == [], "a steady pass writes nothing"
    assert kube.calls[("list", "Pod")] == PODS_LISTS_PER_PASS  # one list, not one read per pod
    assert reads == READS_PER_PASS, sorted(kube.calls.items())


class _Resp:
    status_code = 200
    text = ""


class _Client:
    def __init__(self) -> None:
        self.patches = 0

    async def patch(self, *_: Any, **__: Any) -> _Resp:
        self.patches += 1
        return _Resp()


@pytest.mark.parametrize("busy", [False, True])
def test_agent_pod_writes_per_minute(monkeypatch: pytest.MonkeyPatch, busy: bool) -> None:
    clock = [1000.0]
    monkeypatch.setattr(reporter_mod.time, "monotonic", lambda: clock[0])
    running = [0]

    def snapshot() -> EngineSnapshot:
        return EngineSnapshot(ready=True, running=running[0], model="m")

    cfg = ReporterConfig("smollm", NS, "smollm-decode-0", "decode", interval_s=10.0, heartbeat_s=30.0)
    rep = AgentReporter(cfg, snapshot, auth=reporter_mod.KubeAuth("https://api", {}))
    client = _Client()

    async def minute() -> None:
        for _ in range(6):  # one interval every 10 s
            await rep.report_once(client, force=False)  # type: ignore[arg-type]
            clock[0] += 10.0
            if busy:
                running[0] = (running[0] + 1) % 4  # the figures change every interval

    asyncio.run(minute())  # the first minute starts with the first report
    client.patches = 0
    asyncio.run(minute())
    expected = BUSY_WRITES_PER_AGENT_MINUTE if busy else IDLE_WRITES_PER_AGENT_MINUTE
    assert client.patches == expected


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
