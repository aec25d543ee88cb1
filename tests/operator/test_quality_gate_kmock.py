"""The quality gate in a blue/green format change: the real kopf operator on the kmock cluster, the
pairs' score endpoints in-test HTTP servers answering per the contract (pagoda/quality_probe.py)
and checking the internal proof made from the operator's ``<md>-internal`` token.

Where the score endpoints are is ``quality_gate.resolve_url`` (by role: the serving pair is the
reference, the new pair the candidate); these tests point it at their servers. Whole module: about
25 s on an idle machine, most of it the timeout case (the CRD's shortest gate timeout is 10 s).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import time
from collections.abc import Callable, Iterator

import pytest
from op_cluster import CM_PATH, EVENT_PATH, SECRET_PATH, Cluster
from score_server import ScoreServer
from test_operator_kmock import (
    CPU,
    DEPS,
    GENERATION,
    MD,
    NEW_GENERATION,
    NS,
    POOLS,
    chart_rules,
    condition,
    create_md,
    deployment,
    example,
    selects,
    set_ready,
    set_ready_named,
    settled,
    update_spec,
)

from pagoda.operator import quality_gate
from pagoda.operator.config import Config


@pytest.fixture
def operator_config(operator_config: Config) -> Config:
    """The kmock tests' short timers, plus a gate that retries and gives up quickly."""
    return dataclasses.replace(operator_config, quality_request_s=1.0, quality_retry_s=0.2)


def token(cluster: Cluster) -> str:
    secret = cluster.get(f"{SECRET_PATH.format(ns=NS)}/smollm-internal") or {}
    return base64.b64decode((secret.get("data") or {}).get("internal-token", "")).decode()


@pytest.fixture
def pairs(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., tuple[ScoreServer, ScoreServer]]]:
    """Start the reference's and the candidate's score servers and point the gate at them."""
    started: list[ScoreServer] = []

    def make(**candidate: object) -> tuple[ScoreServer, ScoreServer]:
        ref = ScoreServer(lambda: token(cluster)).__enter__()
        cand = ScoreServer(lambda: token(cluster), **candidate).__enter__()
        started.extend((ref, cand))
        servers = {"reference": ref, "candidate": cand}

        async def resolve(kube, cfg, target):
            return servers[target.role].url

        monkeypatch.setattr(quality_gate, "resolve_url", resolve)
        return ref, cand

    yield make
    for server in started:
        server.__exit__()


def serving_then_change(cluster: Cluster, timeout_s: int = 60, probe_set: str | None = None) -> None:
    """A gated ModelDeployment serving on the blue pair; then a KV format change whose green pair
    becomes ready."""
    gate: dict = {"qualityGate": {"timeout": timeout_s, "probeInterval": 600}}
    if probe_set:
        gate["qualityGate"]["probeSet"] = probe_set
    create_md(cluster, example(**CPU, rollout=gate))
    cluster.wait_for(lambda: deployment(cluster, "router"), what="children")
    for role in ("prefill", "decode", "router"):
        set_ready(cluster, role, 1)
    settled(cluster)
    cluster.wait_for(lambda: condition(cluster.get(MD), "Ready")["status"] == "True", what="Ready")
    update_spec(cluster, {"prefill": {"gpus": 0, "kvCacheFormat": "int8"}})
    for pool in POOLS:
        cluster.wait_for(lambda pool=pool: cluster.get(f"{DEPS}/smollm-{pool}-green"), what=f"green {pool}")
        set_ready_named(cluster, f"smollm-{pool}-green", 1)


def gate_of(cluster: Cluster) -> dict:
    return ((cluster.get(MD) or {}).get("status") or {}).get("quality", {}).get("gate") or {}


def reasons(cluster: Cluster) -> set[str]:
    return {e.get("reason") for e in cluster.get(EVENT_PATH.format(ns=NS))["items"]}


def still_on_the_old_pair(cluster: Cluster) -> None:
    time.sleep(1.5)  # several resync passes: nothing moves
    for pool in POOLS:
        assert selects(cluster, pool) == GENERATION
        assert deployment(cluster, pool)["spec"]["replicas"] == 1
    md = cluster.get(MD)
    assert condition(md, "Ready")["status"] == "True"  # the serving pair keeps serving
    assert condition(md, "Progressing")["status"] == "False"


def test_an_honest_change_passes_the_gate_and_shifts(cluster: Cluster, pairs) -> None:
    ref, cand = pairs(noise=0.02)
    probes = {
        "texts": ["A short text the pairs score."],
        "prompts": ["One prompt", "Another"],
        "max_new_tokens": 6,
    }
    cm = {"metadata": {"name": "probes", "namespace": NS}, "data": {"probes.json": json.dumps(probes)}}
    cluster.create(CM_PATH.format(ns=NS), cm)
    serving_then_change(cluster, probe_set="probes")
    cluster.wait_for(lambda: selects(cluster, "decode") == NEW_GENERATION, what="decode shifted")
    cluster.wait_for(lambda: selects(cluster, "prefill") == NEW_GENERATION, what="prefill shifted")
    gate = gate_of(cluster)
    assert gate["phase"] == "Passed" and gate["generation"] == NEW_GENERATION
    assert gate["reference"] == GENERATION and 0 < gate["meanKL"] < 0.02
    assert len(ref.requests) == len(cand.requests) == 2  # each pool of each pair scored once
    assert ref.requests[0]["prompts"] == ["One prompt", "Another"]  # the probeSet ConfigMap's
    assert ref.requests[0]["max_new_tokens"] == 6
    cm = cluster.get(f"{CM_PATH.format(ns=NS)}/smollm-quality-reference")
    assert cm is not None and "reference.json" in cm["data"]
    cluster.wait_for(lambda: "QualityGatePassed" in reasons(cluster), what="the pass Event")
    md = cluster.wait_for(
        lambda: (m := cluster.get(MD)) and condition(m, "Progressing")["reason"] == "RolloutComplete" and m,
        what="rollout complete",
    )
    assert md["status"]["quality"]["gate"]["phase"] == "Passed"  # kept as the last change's gate
    args = cluster.get(f"{DEPS}/smollm-decode-green")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--quality-probe-interval") + 1] == "600"
    # the chart's RBAC allows the gate's calls (ConfigMaps: the probe set, the reference; the
    # internal Secret's token); the other kinds' are test_operator_kmock's RBAC test's
    used = {
        (c.group, c.resource, c.verb)
        for c in cluster.emulator.calls
        if c.resource in ("configmaps", "secrets")
    }
    assert used - chart_rules() == set()
    assert {("", "configmaps", "get"), ("", "configmaps", "create"), ("", "secrets", "get")} <= used


def test_a_drifted_change_is_held_with_its_kl_while_the_old_pair_serves(cluster: Cluster, pairs) -> None:
    pairs(shift=2.0)
    serving_then_change(cluster)
    md = cluster.wait_for(
        lambda: (m := cluster.get(MD)) and condition(m, "Degraded")["reason"] == "QualityGateFailed" and m,
        what="QualityGateFailed",
    )
    gate = md["status"]["quality"]["gate"]
    assert gate["phase"] == "Failed" and gate["meanKL"] > 0.02 and gate["pools"]["decode"]["meanKL"] > 0.02
    assert "mean KL" in condition(md, "Degraded")["message"]
    assert "QualityGateFailed" in reasons(cluster)
    still_on_the_old_pair(cluster)
    assert cluster.get(f"{CM_PATH.format(ns=NS)}/smollm-quality-reference") is None


def test_a_gate_that_cannot_finish_stalls_without_shifting(cluster: Cluster, pairs) -> None:
    pairs(mode="hang")
    serving_then_change(cluster, timeout_s=10)
    cluster.wait_for(lambda: gate_of(cluster).get("phase") == "Running", what="the gate running")
    md = cluster.wait_for(
        lambda: (m := cluster.get(MD)) and condition(m, "Degraded")["reason"] == "QualityGateTimeout" and m,
        timeout=30,
        what="QualityGateTimeout",
    )
    assert md["status"]["quality"]["gate"]["phase"] == "TimedOut"
    assert "QualityGateTimeout" in reasons(cluster)
    still_on_the_old_pair(cluster)
