"""Pure parts of the reconciler: format checks, rollout order, agent aggregation, window, apply."""

from __future__ import annotations

import datetime as dt

import pytest

from pagoda.agent_report import AgentReport
from pagoda.operator import apply, formats
from pagoda.operator.spec import parse
from pagoda.operator.status import incomplete_groups, pool_figures, reports_of, window

NOW = dt.datetime(2026, 11, 29, 12, 0, 0, tzinfo=dt.UTC)


def spec(**raw: object):
    return parse({"model": {"source": "builtin://smollm2-135m"}, **raw})


def test_format_check_explains_each_problem() -> None:
    assert formats.check(spec()) == []
    reasons = {
        p.reason
        for p in formats.check(
            spec(
                prefill={"weightFormat": "int4", "kvCacheFormat": "fp8_e4m3"},
                decode={"kvCacheFormat": "bf16"},
            )
        )
    }
    assert reasons == {"UnsupportedFormat", "IncompatibleHandoff"}
    assert formats.check(spec(decode={"weightFormat": "nf4"}))[0].reason == "UnknownFormat"
    assert formats.check(spec(decode={"gpus": 1, "tensorParallel": 2}))[0].reason == "InvalidParallelism"


@pytest.mark.parametrize("fmt", ["auto", "stored", "fp8", "bf16"])
def test_prefill_weights_other_than_int4_are_served(fmt: str) -> None:
    """auto prefill is fp8 on a dense or GGUF source and stored (its own INT4 layers, as an explicit
    stored prefill) on a pre-quantized one; only a named int4 prefill is refused."""
    assert formats.check(spec(prefill={"weightFormat": fmt}, decode={"weightFormat": fmt})) == []
    assert (
        spec().prefill.weight_format == spec().decode.weight_format == "auto"
    )  # an object without CRD defaults
    refused = formats.check(spec(decode={"weightFormat": "nf4"}))[0].message
    assert "'nf4' is not one of ('bf16', 'fp8', 'int4', 'stored', 'auto')" in refused


@pytest.mark.parametrize(
    ("pool", "why"),
    [
        ({"tensorParallel": 2, "nodesPerReplica": 4}, "must be between 1 and tensorParallel 2"),
        ({"tensorParallel": 6, "nodesPerReplica": 4}, "not a multiple of nodesPerReplica 4"),
        (
            {"tensorParallel": 8, "nodesPerReplica": 2, "gpus": 8},
            "does not match the 4 rank(s) each pod runs",
        ),
        ({"tensorParallel": 1, "gpus": 2}, "does not match the 1 rank(s)"),
    ],
)
def test_operator_refuses_parallel_layouts_the_agents_cannot_run(pool: dict, why: str) -> None:
    """The CEL rules again, for objects stored before them (or without CEL)."""
    problems = formats.check(spec(decode=pool))
    assert [p.reason for p in problems] == ["InvalidParallelism"]
    assert why in problems[0].message


def test_different_tensor_parallel_degrees_between_pools_are_served() -> None:
    """The KV handoff re-shards pages by head on arrival, so prefill TP 2 may feed decode TP 4."""
    both = spec(prefill={"tensorParallel": 2}, decode={"tensorParallel": 4, "nodesPerReplica": 2})
    assert formats.check(both) == []


def stamp(age_s: float) -> str:
    return (NOW - dt.timedelta(seconds=age_s)).strftime("%Y-%m-%dT%H:%M:%SZ")


def test_pool_figures_sum_fresh_agents_only() -> None:
    fresh = reports(
        {
            "d0": {
                "pool": "decode",
                "kvCapacityTokens": 10,
                "tokensPerSecond": 1.5,
                "ready": True,
                "integrity": {"checks": 4, "mismatches": 1, "pagesAudited": 30, "checksumMismatches": 1},
            },
            "d1": {
                "pool": "decode",
                "kvCapacityTokens": 20,
                "tokensPerSecond": 2.0,
                "integrity": {"checks": 6, "pagesAudited": 5},
            },
            "p0": {"pool": "prefill", "kvCapacityTokens": 99},
            "odd": {"pool": "decode", "kvCapacityTokens": "many", "integrity": None},  # a broken agent
        }
    )
    figures = pool_figures("decode", fresh, reports({"old": {"pool": "decode", "kvCapacityTokens": 1000}}))
    assert figures["kvCapacityTokens"] == 30 and figures["tokensPerSecond"] == 3.5
    assert figures["integrityChecks"] == 10 and figures["integrityMismatches"] == 1
    assert figures["integrityPagesAudited"] == 35 and figures["integrityChecksumMismatches"] == 1
    assert figures["readyAgents"] == 1 and figures["reportingAgents"] == 3 and figures["staleAgents"] == 1


def reports(raw: dict[str, dict]) -> dict[str, AgentReport]:
    return {pod: AgentReport.from_status(r) for pod, r in raw.items()}


def agent(checks: int, mismatches: int, pool: str = "decode") -> AgentReport:
    return AgentReport.from_status({"pool": pool, "integrity": {"checks": checks, "mismatches": mismatches}})


def test_window_rate_uses_the_snapshot_and_survives_restarts() -> None:
    snap = {"startTime": stamp(30), "counters": {"d0": {"checks": 1000, "mismatches": 10}}}
    rates, kept = window(snap, {"d0": agent(2000, 30), "d1": agent(1000, 0)}, NOW, 300, {})
    assert rates["decode"] == pytest.approx(20 / 2000)
    assert kept == snap  # the window is still open
    rates, _ = window(snap, {"d0": agent(500, 5)}, NOW, 300, {})  # d0 restarted: counters reset
    assert rates["decode"] == pytest.approx(5 / 500)
    rates, _ = window(snap, {"d0": agent(1000, 10)}, NOW, 300, {"decode": 0.25})
    assert rates["decode"] == 0.25  # no new checks: the previous rate stands


def test_window_rolls_over_when_old() -> None:
    snap = {
        "startTime": stamp(400),
        "counters": {"d0": {"checks": 1000, "mismatches": 10}, "gone": {"checks": 1, "mismatches": 0}},
    }
    rates, new = window(snap, {"d0": agent(3000, 10)}, NOW, 300, {})
    assert rates["decode"] == 0.0
    assert new == {"startTime": stamp(0), "counters": {"d0": {"checks": 3000, "mismatches": 10}}}


def test_quantities_compare_by_value() -> None:
    assert apply.contains({"cpu": "1", "memory": "1Gi"}, {"cpu": "1000m", "memory": "1024Mi"})
    assert not apply.contains({"cpu": "2"}, {"cpu": "1000m"})
    assert apply.contains({"a": [{"x": 1, "y": 2}]}, {"a": [{"x": 1}]})
    assert not apply.contains({"a": [{"x": 1}, {"x": 2}]}, {"a": [{"x": 1}]})


def test_removals_null_out_fields_no_longer_set() -> None:
    old = {"spec": {"nodeSelector": {"a": "1", "b": "2"}, "keep": 1}}
    new = {"spec": {"nodeSelector": {"a": "1"}, "keep": 1}}
    assert apply.removals(old, new) == {"spec": {"nodeSelector": {"a": "1", "b": None}, "keep": 1}}


def lws_pod(group: int, worker: int, ready: bool, created: str | None = None) -> dict:
    labels = {
        "pagoda.dev/pool": "decode",
        "leaderworkerset.sigs.k8s.io/name": "m-decode",
        "leaderworkerset.sigs.k8s.io/group-index": str(group),
        "leaderworkerset.sigs.k8s.io/worker-index": str(worker),
    }
    meta = {"name": f"m-decode-{group}" + (f"-{worker}" if worker else ""), "labels": labels}
    if created:
        meta["creationTimestamp"] = created
    return {"metadata": meta, "status": {"conditions": [{"type": "Ready", "status": str(ready)}]}}


def test_incomplete_groups_are_those_with_pods_not_all_ready() -> None:
    pods = [lws_pod(0, 0, True), lws_pod(0, 1, True), lws_pod(1, 0, True), lws_pod(2, 1, False)]
    pods.append(
        {**lws_pod(3, 0, False), "metadata": {"name": "other", "labels": {"pagoda.dev/pool": "decode"}}}
    )
    assert incomplete_groups(pods, "m-decode", 2) == [("m-decode-1", 1), ("m-decode-2", 0)]
    assert incomplete_groups(pods, "m-decode-green", 2) == []  # another set's pods do not count


def test_worker_pods_are_not_agents_their_leader_reports() -> None:
    """A worker serves no API and writes no report: an old one is not a stale agent."""
    pods = [lws_pod(0, 0, True, stamp(600)), lws_pod(0, 1, True, stamp(600))]
    assert list(reports_of(pods, NOW, 60)) == ["m-decode-0"]  # the leader, stale without a report
