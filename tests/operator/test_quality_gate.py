"""The quality gate's pieces: the decision, the record's phases, the scorer task against in-test
score endpoints (internal proof checked), the conditions it sets, the spec and the pod flags."""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import json
import math

import pytest
from fake_kube import FakeKube
from op_schema import admit, example
from score_server import ScoreServer

from pagoda.operator import children, quality_gate
from pagoda.operator.config import Config
from pagoda.operator.reconcile import Outcome, _held
from pagoda.operator.rollout import QUALITY_GATE, Plan
from pagoda.operator.spec import QualityGate, parse
from pagoda.operator.status import quality_of
from pagoda.quality_probe import REFERENCE_CONFIGMAP_KEY, Comparison, ScoreResponse

NOW = dt.datetime(2026, 12, 2, 12, 0, tzinfo=dt.UTC)
META = {"name": "m", "namespace": "ns", "uid": "uid-m"}
TOKEN = "t" * 43
GATE = QualityGate()


def fig(kl: float = 0.001, top1: float = 0.99, greedy: float = 1.0) -> Comparison:
    return Comparison(kl, top1, greedy, greedy, 100, 6)


def test_the_verdict_names_every_figure_out_of_bounds() -> None:
    assert quality_gate.verdict(GATE, {"prefill": fig(), "decode": fig()}) == []
    bad = quality_gate.verdict(GATE, {"prefill": fig(), "decode": fig(kl=0.3, top1=0.5, greedy=0.1)})
    assert bad == [
        "decode: mean KL 0.3 > maxKL 0.02",
        "decode: top-1 agreement 0.5 < minTop1 0.9",
        "decode: greedy agreement 0.1 < minGreedyAgreement 0.5",
    ]
    assert quality_gate.verdict(GATE, {"decode": fig(kl=math.nan)})  # a NaN never passes
    edge = QualityGate(max_kl=0.001, min_top1=0.99, min_greedy_agreement=1.0)
    assert quality_gate.verdict(edge, {"decode": fig()}) == []  # the thresholds themselves pass


def test_a_record_runs_then_is_decided_or_times_out() -> None:
    rec = quality_gate.started("new", "old", GATE, NOW)
    assert rec["phase"] == "Running" and rec["thresholds"] == {
        "maxKL": 0.02,
        "minTop1": 0.9,
        "minGreedyAgreement": 0.5,
    }
    assert quality_gate.current({"quality": {"gate": rec}}, "new") == rec
    assert quality_gate.current({"quality": {"gate": rec}}, "other") is None
    assert not quality_gate.overdue(rec, GATE, NOW + dt.timedelta(seconds=600))
    assert quality_gate.overdue(rec, GATE, NOW + dt.timedelta(seconds=601))
    late = quality_gate.timed_out({**rec, "lastError": "no ready candidate decode pod"}, NOW)
    assert late["phase"] == "TimedOut" and "600s" in late["message"] and "no ready" in late["message"]
    passed = quality_gate.decided(rec, GATE, {"prefill": fig(), "decode": fig(kl=0.004)}, NOW)
    assert passed["phase"] == "Passed" and passed["meanKL"] == 0.004
    assert passed["pools"]["decode"] == fig(kl=0.004).to_status()
    failed = quality_gate.decided(rec, GATE, {"prefill": fig(), "decode": fig(kl=0.5)}, NOW)
    assert failed["phase"] == "Failed" and failed["message"] == "decode: mean KL 0.5 > maxKL 0.02"
    assert not quality_gate.overdue(failed, GATE, NOW + dt.timedelta(days=1))  # decided stays decided


def test_a_held_change_is_degraded_with_its_figures() -> None:
    rec = quality_gate.started("new", "old", GATE, NOW)
    failed = quality_gate.decided(rec, GATE, {"prefill": fig(), "decode": fig(kl=0.5)}, NOW)
    out = Outcome(stage=QUALITY_GATE, plan=Plan(stage=QUALITY_GATE), gate=failed)
    cond = _held(out)
    assert (cond.type, cond.status, cond.reason) == ("Degraded", True, "QualityGateFailed")
    assert "decode KL 0.5" in cond.message and "serving pair keeps serving" in cond.message
    out.gate = quality_gate.timed_out(rec, NOW)
    assert _held(out).reason == "QualityGateTimeout"
    out.gate = rec  # still scoring: not degraded
    assert _held(out) is None
    out.gate, out.stage = failed, "RemoveOldPair"  # a later change: the old record is history
    assert _held(out) is None


def _kube(status_gate: dict) -> FakeKube:
    kube = FakeKube()
    kube.put({"apiVersion": "pagoda.dev/v1alpha1", "kind": "ModelDeployment", "metadata": dict(META)})
    kube.objects[("ModelDeployment", "ns", "m")]["status"] = {"quality": {"gate": status_gate}}
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "m-internal", "namespace": "ns"},
        "data": {children.INTERNAL_TOKEN_KEY: base64.b64encode(TOKEN.encode()).decode()},
    }
    kube.put(secret)
    return kube


async def _run(kube: FakeKube, servers: dict[str, ScoreServer], gate: QualityGate, record: dict) -> list:
    events: list[tuple[str, str, str]] = []
    passes: list[int] = []

    async def repass() -> None:
        passes.append(1)

    job = quality_gate.Job(
        kube,
        Config(quality_request_s=5, quality_retry_s=0.1),
        META,
        gate,
        {"prefill": ("blue", "green"), "decode": ("blue", "green")},
        record,
        asyncio.Lock(),
        lambda *e: events.append(e),
        repass,
    )
    await quality_gate.run(job)
    assert passes == [1]
    return events


@pytest.fixture
def endpoints(monkeypatch: pytest.MonkeyPatch):
    """Point the gate at in-test servers: the reference's and the candidate's, by role."""

    def install(servers: dict[str, ScoreServer]) -> None:
        async def resolve(kube, cfg, target):
            return servers[target.role].url

        monkeypatch.setattr(quality_gate, "resolve_url", resolve)

    return install


def test_an_honest_pair_passes_and_its_reference_is_kept(endpoints) -> None:
    rec = quality_gate.started("new", "old", GATE, dt.datetime.now(dt.UTC))
    kube = _kube(rec)
    with ScoreServer(lambda: TOKEN) as ref, ScoreServer(lambda: TOKEN, noise=0.02) as cand:
        endpoints({"reference": ref, "candidate": cand})
        events = asyncio.run(_run(kube, {}, GATE, rec))
        assert len(ref.requests) == 2 and len(cand.requests) == 2  # both pools, one request each
        assert "targets" in cand.requests[0]["texts"][0] and "text" in ref.requests[0]["texts"][0]
    gate = kube.objects[("ModelDeployment", "ns", "m")]["status"]["quality"]["gate"]
    assert gate["phase"] == "Passed" and 0 < gate["meanKL"] < 0.02 and gate["top1"] == 1.0
    assert set(gate["pools"]) == {"prefill", "decode"}
    assert [e[:2] for e in events] == [("Normal", "QualityGatePassed")]
    cm = kube.objects[("ConfigMap", "ns", "m-quality-reference")]
    assert cm["metadata"]["ownerReferences"][0]["uid"] == "uid-m"
    kept = ScoreResponse.from_json(json.loads(cm["data"][REFERENCE_CONFIGMAP_KEY]))
    assert kept.texts and kept.greedy  # the reference's own answer, as engines read it back


def test_a_drifted_pair_fails_with_its_kl(endpoints) -> None:
    rec = quality_gate.started("new", "old", GATE, dt.datetime.now(dt.UTC))
    kube = _kube(rec)
    with ScoreServer(lambda: TOKEN) as ref, ScoreServer(lambda: TOKEN, shift=2.0) as cand:
        endpoints({"reference": ref, "candidate": cand})
        events = asyncio.run(_run(kube, {}, GATE, rec))
    gate = kube.objects[("ModelDeployment", "ns", "m")]["status"]["quality"]["gate"]
    assert gate["phase"] == "Failed" and gate["meanKL"] > 0.5 and gate["top1"] < 0.1
    assert "mean KL" in gate["message"] and events[0][:2] == ("Warning", "QualityGateFailed")
    assert ("ConfigMap", "ns", "m-quality-reference") not in kube.objects


def test_a_wrong_token_is_refused_and_the_gate_never_decides(endpoints) -> None:
    gate = QualityGate(timeout_s=1)
    rec = quality_gate.started("new", "old", gate, dt.datetime.now(dt.UTC))
    kube = _kube(rec)
    with ScoreServer(lambda: "another-token-of-enough-length") as ref, ScoreServer(lambda: TOKEN) as cand:
        endpoints({"reference": ref, "candidate": cand})
        assert asyncio.run(_run(kube, {}, gate, rec)) == []
        assert ref.refused and not ref.requests and not cand.requests
    live = kube.objects[("ModelDeployment", "ns", "m")]["status"]["quality"]["gate"]
    assert live["phase"] == "Running" and "403" in live["lastError"]  # the pass times it out


def test_a_decision_is_not_written_over_a_record_the_pass_moved_on(endpoints) -> None:
    rec = quality_gate.started("new", "old", GATE, dt.datetime.now(dt.UTC))
    kube = _kube(quality_gate.timed_out(rec, NOW))
    with ScoreServer(lambda: TOKEN) as ref, ScoreServer(lambda: TOKEN) as cand:
        endpoints({"reference": ref, "candidate": cand})
        assert asyncio.run(_run(kube, {}, GATE, rec)) == []
    assert kube.objects[("ModelDeployment", "ns", "m")]["status"]["quality"]["gate"]["phase"] == "TimedOut"


def test_a_probe_set_comes_from_its_configmap() -> None:
    kube = FakeKube()
    probes = {"texts": ["one text to score"], "prompts": ["a prompt"], "max_new_tokens": 4}
    kube.put(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "p", "namespace": "ns"},
            "data": {"probes.json": json.dumps(probes)},
        }
    )
    got = asyncio.run(quality_gate.probe_set(kube, "ns", "p"))
    assert (got.texts, got.prompts, got.max_new_tokens) == (["one text to score"], ["a prompt"], 4)
    with pytest.raises(quality_gate.ProbeError, match="has no probes.json"):
        asyncio.run(quality_gate.probe_set(kube, "ns", "missing"))
    assert asyncio.run(quality_gate.probe_set(kube, "ns", None)).texts  # the built-in set


def test_the_gate_is_opt_in_and_continuous_probes_get_the_reference() -> None:
    assert parse(admit(example())["spec"]).rollout.gate is None
    off = {"rollout": {"qualityGate": {"enabled": False}}}
    assert parse(admit(example(**off))["spec"]).rollout.gate is None
    on = parse(admit(example(rollout={"qualityGate": {}}))["spec"]).rollout.gate
    assert on == QualityGate()  # the CRD's defaults and the code's agree
    spec = parse(admit(example(rollout={"qualityGate": {"probeInterval": 300}}))["spec"])
    built = children.build(META, spec, Config())
    for pool in ("prefill", "decode"):
        pod = built[f"Deployment/m-{pool}"]["spec"]["template"]["spec"]
        args = pod["containers"][0]["args"]
        assert args[args.index("--quality-reference") + 1] == "/etc/pagoda/quality/reference.json"
        assert args[args.index("--quality-probe-interval") + 1] == "300"
        (vol,) = [v for v in pod["volumes"] if v["name"] == "quality-reference"]
        assert vol["configMap"] == {"name": "m-quality-reference", "optional": True}
    router = built["Deployment/m-router"]["spec"]["template"]["spec"]
    assert "--quality-reference" not in router["containers"][0]["args"]
    plain = children.build(META, parse(admit(example(rollout={"qualityGate": {}}))["spec"]), Config())
    assert (
        "--quality-reference"
        not in plain["Deployment/m-decode"]["spec"]["template"]["spec"]["containers"][0]["args"]
    )


@pytest.mark.parametrize(
    "gate",
    [{"maxKL": -1}, {"minTop1": 1.5}, {"minGreedyAgreement": -0.1}, {"timeout": 5}, {"probeInterval": 30}],
)
def test_out_of_range_gate_settings_are_refused(gate: dict) -> None:
    with pytest.raises(Exception):  # noqa: B017 (jsonschema's or CEL's ValidationError)
        admit(example(rollout={"qualityGate": gate}))


def test_continuous_figures_per_pool_come_from_fresh_reports_only() -> None:
    from pagoda.agent_report import AgentReport

    def report(quality: object) -> dict:
        return {"pool": "decode", "quality": quality}

    raw = {
        "a": report({"meanKL": 0.004, "top1": 0.97, "greedyPrefix": 0.9, "probes": 3, "failures": 1,
                     "lastProbeTime": "2026-12-02T12:00:00Z"}),
        "b": report({"meanKL": 0.011, "top1": 0.99, "greedyPrefix": 0.8, "probes": 1,
                     "lastProbeTime": "2026-12-02T12:05:00Z"}),
        "c": report({"meanKL": 0.5, "probes": 0, "failures": 2}),  # no probe succeeded yet: skipped
        "d": report({"meanKL": 9.0, "probes": 1}),  # not fresh: skipped
        "e": report(None),  # probes nothing
        "f": report("high"),  # malformed: no quality
    }  # fmt: skip
    pods = [{"metadata": {"name": n}} for n in raw]
    fresh = {n: AgentReport.from_status(r) for n, r in raw.items() if n != "d"}
    assert quality_of(pods, fresh) == {
        "decode": {"agents": 2, "failures": 1, "kl": 0.011, "top1": 0.97, "greedyPrefix": 0.8,
                   "at": "2026-12-02T12:05:00Z"}
    }  # fmt: skip


def test_a_gate_task_stopping_its_own_gate_is_not_cancelled() -> None:
    """The task's repass runs a pass that stops the ModelDeployment's gates: not itself, mid-pass."""

    async def main() -> tuple[bool, bool]:
        runner = quality_gate.GateRunner()
        finished = asyncio.Event()

        async def own() -> None:
            runner.stop("ns", "m")
            await asyncio.sleep(0.01)  # a cancelled task would stop here
            finished.set()

        other = asyncio.create_task(asyncio.sleep(10))
        runner.tasks[("ns", "m", "old")] = other
        runner.tasks[("ns", "m", "new")] = task = asyncio.create_task(own())
        await task
        await asyncio.sleep(0)
        return finished.is_set(), other.cancelled()

    assert asyncio.run(main()) == (True, True)


def test_the_score_url_template_is_checked_and_used() -> None:
    cfg = Config.from_env({"PAGODA_QUALITY_SCORE_URL": "http://{md}-{pool}-{slot}.{namespace}.svc:{port}"})
    target = quality_gate.Target("ns", "m", "decode", "green", "g1", "candidate")
    assert asyncio.run(quality_gate.pod_url(FakeKube(), cfg, target)) == "http://m-decode-green.ns.svc:8000"
    with pytest.raises(ValueError, match="PAGODA_QUALITY_SCORE_URL"):
        Config.from_env({"PAGODA_QUALITY_SCORE_URL": "http://{host}/"})


def test_without_a_template_a_ready_pod_of_the_generation_is_scored() -> None:
    kube = FakeKube()
    labels = {children.MD_LABEL: "m", children.POOL_LABEL: "decode", children.FORMATS_LABEL: "g1"}

    def pod(name: str, ip: str, ready: str, gen: str = "g1") -> dict:
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": "ns", "labels": {**labels, children.FORMATS_LABEL: gen}},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": ready}]},
        }

    kube.put(pod("a", "10.0.0.1", "False"))
    kube.put(pod("b", "10.0.0.2", "True", gen="g0"))
    target = quality_gate.Target("ns", "m", "decode", "green", "g1", "candidate")
    assert asyncio.run(quality_gate.pod_url(kube, Config(), target)) is None  # none ready of g1
    kube.put(pod("c", "10.0.0.3", "True"))
    assert asyncio.run(quality_gate.pod_url(kube, Config(), target)) == "http://10.0.0.3:8000"


def test_the_reference_configmap_is_replaced_only_when_it_is_ours() -> None:
    kube = FakeKube()
    first = ScoreResponse({}, [], [[1, 2]])
    asyncio.run(quality_gate.store_reference(kube, META, first))
    asyncio.run(quality_gate.store_reference(kube, META, ScoreResponse({}, [], [[3]])))  # a later gate
    cm = kube.objects[("ConfigMap", "ns", "m-quality-reference")]
    assert json.loads(cm["data"][REFERENCE_CONFIGMAP_KEY])["greedy"] == [[3]]
    assert kube.writes == [
        ("create", "ConfigMap", "m-quality-reference"),
        ("patch", "ConfigMap", "m-quality-reference"),
    ]
    cm["metadata"] = {"name": "m-quality-reference", "namespace": "ns"}  # someone else's
    with pytest.raises(quality_gate.ProbeError, match="cannot be kept"):
        asyncio.run(quality_gate.store_reference(kube, META, first))


def _ready(kube: FakeKube, name: str) -> None:
    kube.objects[("Deployment", "ns", name)]["status"] = {
        "replicas": 1,
        "updatedReplicas": 1,
        "readyReplicas": 1,
    }


def test_reconcile_starts_resumes_and_times_out_a_gate() -> None:
    """Passes over an in-memory API: a ready new pair waits in QualityGate with a Running record; a
    new runner (an operator restart) resumes it with its startedAt; past the timeout it is TimedOut,
    Degraded, with an Event, and the Services never moved."""
    from pagoda.operator.reconcile import reconcile

    body = admit(
        example("m", prefill={"gpus": 0}, decode={"gpus": 0}, rollout={"qualityGate": {"timeout": 60}})
    )
    body["metadata"].update(namespace="ns", uid="uid-m", generation=1)
    kube = FakeKube()
    kube.put(body)
    cfg = Config(quality_retry_s=0.05)

    def md() -> dict:
        return kube.objects[("ModelDeployment", "ns", "m")]

    async def main() -> None:
        now = dt.datetime.now(dt.UTC)
        await reconcile(kube, md(), cfg, now=now)
        for name in ("m-prefill", "m-decode", "m-router"):
            _ready(kube, name)
        md()["spec"]["prefill"]["kvCacheFormat"] = "int8"
        await reconcile(kube, md(), cfg, now=now)  # StartNewPair
        _ready(kube, "m-prefill-green")
        _ready(kube, "m-decode-green")
        events: list[tuple[str, str, str]] = []
        runner = quality_gate.GateRunner()
        hooks = quality_gate.Hooks(runner, asyncio.Lock())
        out = await reconcile(kube, md(), cfg, now=now, hooks=hooks, emit=lambda *e: events.append(e))
        assert out.stage == "QualityGate"
        record = md()["status"]["quality"]["gate"]
        assert record["phase"] == "Running" and len(runner.tasks) == 1
        selector = kube.objects[("Service", "ns", "m-decode")]["spec"]["selector"]["pagoda.dev/formats"]
        assert selector == record["reference"] != record["generation"]
        await runner.close()
        restarted = quality_gate.GateRunner()
        later = now + dt.timedelta(seconds=30)
        await reconcile(kube, md(), cfg, now=later, hooks=quality_gate.Hooks(restarted, asyncio.Lock()))
        assert md()["status"]["quality"]["gate"]["startedAt"] == record["startedAt"] and restarted.tasks
        await restarted.close()
        late = now + dt.timedelta(seconds=61)
        await reconcile(kube, md(), cfg, now=late, hooks=hooks, emit=lambda *e: events.append(e))
        gate = md()["status"]["quality"]["gate"]
        assert gate["phase"] == "TimedOut" and not runner.tasks
        degraded = next(c for c in md()["status"]["conditions"] if c["type"] == "Degraded")
        assert degraded["reason"] == "QualityGateTimeout"
        assert ("Warning", "QualityGateTimeout") in [e[:2] for e in events]
        assert (
            kube.objects[("Service", "ns", "m-decode")]["spec"]["selector"]["pagoda.dev/formats"] == selector
        )

    asyncio.run(main())
