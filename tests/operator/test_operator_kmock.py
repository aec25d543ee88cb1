"""The real kopf operator against the kmock emulator: children, repair, rollout order, status."""

from __future__ import annotations

import base64
import copy
import datetime as dt
import json
import logging
import re
import time

import helm_python
import pytest
import yaml
from fake_kube import merge_patch
from op_cluster import (
    CM_PATH,
    DEP_PATH,
    EVENT_PATH,
    HPA_PATH,
    LWS_PATH,
    MD_PATH,
    NETPOL_PATH,
    PDB_PATH,
    POD_PATH,
    SECRET_PATH,
    SVC_PATH,
    Cluster,
)
from op_schema import CHART, admit, example

from pagoda.operator.children import generation_of
from pagoda.operator.config import Config

NS = "default"
MD = MD_PATH.format(ns=NS) + "/smollm"
DEPS = DEP_PATH.format(ns=NS)
POOLS = ("prefill", "decode")
CPU = {"prefill": {"gpus": 0}, "decode": {"gpus": 0}}
GENERATION = generation_of(("auto", "bf16", "auto", "int8"))  # the default formats


def create_md(cluster: Cluster, body: dict) -> dict:
    """Store a ModelDeployment as the API server would (defaults, uid, generation)."""
    stored = admit(body)
    stored["metadata"].update(
        uid="uid-1", generation=1, resourceVersion="1", creationTimestamp="2026-11-29T12:00:00Z"
    )
    return cluster.create(MD_PATH.format(ns=NS), stored)


def update_spec(cluster: Cluster, spec_patch: dict) -> None:
    current = cluster.get(MD)
    assert current is not None
    admit({**current, "spec": merge_patch(current["spec"], spec_patch)})  # would the API server accept it?
    cluster.patch(MD, {"spec": spec_patch, "metadata": {"generation": current["metadata"]["generation"] + 1}})


def deployment(cluster: Cluster, role: str) -> dict | None:
    return cluster.get(f"{DEPS}/smollm-{role}")


def args_of(dep: dict) -> list[str]:
    return dep["spec"]["template"]["spec"]["containers"][0]["args"]


def flag(dep: dict, name: str) -> str:
    args = args_of(dep)
    return args[args.index(name) + 1]


def condition(md: dict | None, kind: str) -> dict | None:
    for cond in ((md or {}).get("status") or {}).get("conditions") or []:
        if cond["type"] == kind:
            return cond
    return None


def set_ready(
    cluster: Cluster, role: str, replicas: int, updated: int | None = None, total: int | None = None
) -> None:
    """Play the Deployment controller: report replica counts in the Deployment status."""
    status = {
        "replicas": replicas if total is None else total,
        "updatedReplicas": replicas if updated is None else updated,
        "readyReplicas": replicas,
        "availableReplicas": replicas,
    }
    cluster.patch(f"{DEPS}/smollm-{role}/status", {"status": status})


def add_pod(cluster: Cluster, name: str, pool: str) -> None:
    """A pool pod as the Deployment makes it (of the default formats' generation)."""
    labels = {
        "pagoda.dev/model-deployment": "smollm",
        "pagoda.dev/pool": pool,
        "pagoda.dev/formats": GENERATION,
    }
    cluster.create(POD_PATH.format(ns=NS), {"metadata": {"name": name, "namespace": NS, "labels": labels}})


def report(pool: str, *, age_s: float = 0, checks: int = 0, mismatches: int = 0, kv_cap: int = 1000) -> dict:
    """An agent report in the contract's shape."""
    when = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=age_s)
    return {
        "pool": pool,
        "node": "node-a",
        "ready": True,
        "formats": {
            "prefillWeights": "fp8",
            "prefillKv": "bf16",
            "decodeWeights": "int4",
            "decodeKv": "int8",
        },
        "weightBytes": 100,
        "kvCapacityTokens": kv_cap,
        "kvUsedTokens": 10,
        "tokensPerSecond": 50.5,
        "runningRequests": 2,
        "waitingRequests": 1,
        "integrity": {
            "mode": "enforce",
            "checks": checks,
            "pagesChecked": checks * 4,
            "mismatches": mismatches,
            "requestsAborted": mismatches,
        },
        "lastReportTime": when.strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def agent_patch(cluster: Cluster, pod: str, body: dict) -> None:
    """What an agent's reporter sends: a merge patch of its own Pod's report annotation."""
    text = json.dumps(body, separators=(",", ":"))
    cluster.patch(
        f"{POD_PATH.format(ns=NS)}/{pod}", {"metadata": {"annotations": {"pagoda.dev/agent-report": text}}}
    )


def test_create_yields_children_with_args_owners_and_labels(cluster: Cluster) -> None:
    create_md(cluster, example(**CPU, routing={"prefixCaching": False}))
    router = cluster.wait_for(lambda: deployment(cluster, "router"), what="router deployment")
    prefill, decode = deployment(cluster, "prefill"), deployment(cluster, "decode")
    assert prefill and decode

    for role, dep in (("prefill", prefill), ("decode", decode), ("router", router)):
        owner = dep["metadata"]["ownerReferences"][0]
        assert owner == {
            "apiVersion": "pagoda.dev/v1alpha1",
            "kind": "ModelDeployment",
            "name": "smollm",
            "uid": "uid-1",
            "controller": True,
            "blockOwnerDeletion": True,
        }
        assert dep["metadata"]["labels"]["app.kubernetes.io/component"] == role
        assert dep["spec"]["selector"]["matchLabels"] == {
            "pagoda.dev/model-deployment": "smollm",
            "pagoda.dev/pool": role,
        }
        assert flag(dep, "--role") == role
        assert flag(dep, "--model") == "builtin://smollm2-135m"
        if role != "router":  # the router reads no formats
            assert (flag(dep, "--prefill-weights"), flag(dep, "--prefill-kv")) == ("auto", "bf16")
            assert (flag(dep, "--decode-weights"), flag(dep, "--decode-kv")) == ("auto", "int8")
            assert flag(dep, "--integrity") == "enforce"
        assert "--no-prefix-caching" in args_of(dep) and "--no-session-affinity" not in args_of(dep)
        env = {e["name"]: e for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env["PAGODA_MD_NAME"]["value"] == "smollm" and env["PAGODA_POOL"]["value"] == role
        assert env["PAGODA_POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        assert env["PAGODA_NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
        assert env["PAGODA_REPORT_INTERVAL_S"]["value"] == "5"
        assert "nvidia.com/gpu" not in str(dep["spec"]["template"]["spec"]["containers"][0]["resources"])
    # The router finds each pod of a pool through the pool's headless Service.
    assert flag(router, "--prefill-dns") == "smollm-prefill-pods.default.svc.cluster.local:8000"
    assert flag(router, "--decode-dns") == "smollm-decode-pods.default.svc.cluster.local:8000"
    assert "--prefill-dns" not in args_of(decode)
    for role in ("prefill", "decode"):
        headless = cluster.get(f"{SVC_PATH.format(ns=NS)}/smollm-{role}-pods")
        assert headless["spec"]["clusterIP"] == "None" and not headless["spec"].get(
            "publishNotReadyAddresses"
        )
        assert headless["spec"]["selector"] == {
            "pagoda.dev/model-deployment": "smollm",
            "pagoda.dev/pool": role,
            "pagoda.dev/formats": GENERATION,  # the serving format generation
        }
    for role, dep in (("prefill", prefill), ("decode", decode), ("router", router)):
        pdb = cluster.get(f"{PDB_PATH.format(ns=NS)}/smollm-{role}")
        assert pdb["spec"]["maxUnavailable"] == 1
        assert pdb["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
        # Graceful drain: preStop sleep, --drain-timeout, and a grace period covering both.
        pod = dep["spec"]["template"]["spec"]
        container = pod["containers"][0]
        assert container["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]
        assert flag(dep, "--drain-timeout") == "30" and pod["terminationGracePeriodSeconds"] == 45
        assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}

    for role in ("prefill", "decode", "router"):
        svc = cluster.get(f"{SVC_PATH.format(ns=NS)}/smollm-{role}")
        generation = {"pagoda.dev/formats": GENERATION} if role != "router" else {}
        assert svc["spec"]["selector"] == {
            "pagoda.dev/model-deployment": "smollm",
            "pagoda.dev/pool": role,
            **generation,
        }
        assert svc["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    for dep in (prefill, decode):
        assert dep["spec"]["template"]["metadata"]["annotations"]["pagoda.dev/handoff"] == "bf16->int8"
    # The agents take everything from args and env: no ConfigMap, so none that nobody reads.
    assert cluster.get(CM_PATH.format(ns=NS))["items"] == []
    # The agents write their reports into their own pods (the chart's admission policy keeps each
    # to its own pod and annotation); they write nothing to the ModelDeployment.
    role = cluster.get(f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/roles/smollm-pagoda-agent")
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"]},  # its report
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create", "patch"]},
    ]
    # Only the pods that report hold a token: the router (untrusted input, no report) has none.
    assert prefill["spec"]["template"]["spec"]["serviceAccountName"] == "smollm-pagoda-agent"
    assert router["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    assert "serviceAccountName" not in router["spec"]["template"]["spec"]

    md = cluster.wait_for(lambda: condition(cluster.get(MD), "Ready") and cluster.get(MD), what="status")
    assert md["status"]["observedGeneration"] == 1
    assert condition(md, "Ready")["status"] == "False"  # nothing is ready yet
    for role in ("prefill", "decode", "router"):
        set_ready(cluster, role, 1)
    md = cluster.wait_for(
        lambda: (c := condition(cluster.get(MD), "Ready")) and c["status"] == "True" and cluster.get(MD),
        what="Ready",
    )
    assert condition(md, "Ready")["reason"] == "AllPoolsReady"
    assert md["status"]["decode"]["ready"] == "1/1" and md["status"]["decode"]["formats"] == "auto/int8"
    events = cluster.wait_for(lambda: cluster.get(EVENT_PATH.format(ns=NS))["items"], what="events")
    reasons = {e["reason"] for e in events}
    assert "Created" in reasons


def test_update_rolls_out_and_rerun_changes_nothing(cluster: Cluster) -> None:
    create_md(cluster, example(**CPU))
    cluster.wait_for(lambda: deployment(cluster, "router"), what="children")
    update_spec(
        cluster,
        {"decode": {"gpus": 0, "replicas": 3, "maxConcurrency": 128}, "integrity": {"mode": "audit"}},
    )  # no format change: rolled in place (a format change is blue/green, tested below)
    decode = cluster.wait_for(
        lambda: (d := deployment(cluster, "decode")) and d["spec"]["replicas"] == 3 and d,
        what="decode scaled",
    )
    assert flag(decode, "--max-num-seqs") == "128" and flag(decode, "--integrity") == "audit"
    prefill = cluster.wait_for(
        lambda: (d := deployment(cluster, "prefill")) and flag(d, "--integrity") == "audit" and d
    )
    assert prefill["spec"]["replicas"] == 1
    md = cluster.wait_for(lambda: (m := cluster.get(MD)) and m["status"].get("observedGeneration") == 2 and m)
    assert md["status"]["decode"]["desiredReplicas"] == 3

    # Level-based and idempotent: further passes write nothing to the children.
    versions = {
        role: len(cluster.emulator.objects["apps/v1/deployments", NS, f"smollm-{role}"].history)
        for role in ("prefill", "decode", "router")
    }
    time.sleep(2.5)  # several timer passes
    after = {
        role: len(cluster.emulator.objects["apps/v1/deployments", NS, f"smollm-{role}"].history)
        for role in ("prefill", "decode", "router")
    }
    assert after == versions


def templates(cluster: Cluster) -> dict[str, str]:
    """Each Deployment's pod template, serialized (what the Deployment controller hashes)."""
    return {
        role: json.dumps(deployment(cluster, role)["spec"]["template"], sort_keys=True)
        for role in ("prefill", "decode", "router")
    }


def test_a_decode_scale_restarts_no_pod(cluster: Cluster) -> None:
    """Replicas live outside the pod templates: scaling decode leaves all three templates as they were."""
    create_md(cluster, example(**CPU))
    cluster.wait_for(lambda: deployment(cluster, "router"), what="children")
    settled(cluster)
    before = templates(cluster)
    update_spec(cluster, {"decode": {"gpus": 0, "replicas": 4}, "integrity": {"windowSeconds": 60}})
    cluster.wait_for(lambda: deployment(cluster, "decode")["spec"]["replicas"] == 4, what="decode scaled")
    cluster.wait_for(lambda: cluster.get(MD)["status"].get("observedGeneration") == 2, what="pass on gen 2")
    assert templates(cluster) == before  # byte-identical: no rollout of any pool


AUTO = {"minReplicas": 2, "maxReplicas": 6, "targets": {"waitingRequests": 4, "kvCacheUsage": 0.8}}


def test_an_autoscaled_pool_gets_an_hpa_and_its_scale_is_kept(cluster: Cluster) -> None:
    create_md(cluster, example(prefill={"gpus": 0}, decode={"gpus": 0, "autoscaling": AUTO}))
    hpa_path = f"{HPA_PATH.format(ns=NS)}/smollm-decode"
    hpa = cluster.wait_for(lambda: cluster.get(hpa_path), what="HPA")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "smollm-decode",
    }
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    assert [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]] == [
        "pagoda_waiting_sequences",
        "pagoda_kv_cache_usage_ratio",
    ]
    assert cluster.get(f"{HPA_PATH.format(ns=NS)}/smollm-prefill") is None
    assert cluster.wait_for(lambda: deployment(cluster, "decode"))["spec"]["replicas"] == 2  # created at min
    settled(cluster)
    before = templates(cluster)

    cluster.patch(f"{DEPS}/smollm-decode", {"spec": {"replicas": 5}})  # the HPA scales up
    set_ready(cluster, "decode", 5)
    # The scale and the controller's status are two watch events: a pass may see one before the other.
    md = cluster.wait_for(
        lambda: (m := cluster.get(MD)) and m["status"]["decode"].get("ready") == "5/5" and m,
        what="status follows the autoscaler",
    )
    assert md["status"]["decode"]["autoscaling"] == {"minReplicas": 2, "maxReplicas": 6}
    assert md["status"]["decode"]["desiredReplicas"] == 5 and md["status"]["decode"]["currentReplicas"] == 5
    time.sleep(2)  # several timer passes: none reverts the scale
    assert deployment(cluster, "decode")["spec"]["replicas"] == 5
    assert templates(cluster) == before

    # Autoscaling off: the HPA goes, the spec's replicas are enforced again.
    update_spec(cluster, {"decode": {"gpus": 0, "replicas": 3, "autoscaling": None}})
    cluster.wait_for(lambda: cluster.get(hpa_path) is None, what="HPA deleted")
    cluster.wait_for(lambda: deployment(cluster, "decode")["spec"]["replicas"] == 3, what="replicas enforced")


def test_deleted_or_edited_child_is_repaired(cluster: Cluster) -> None:
    create_md(cluster, example(**CPU))
    cluster.wait_for(lambda: deployment(cluster, "router"), what="children")
    svc_path = f"{SVC_PATH.format(ns=NS)}/smollm-decode"
    cluster.delete(svc_path)
    cluster.delete(f"{DEPS}/smollm-prefill")
    cluster.patch(
        f"{DEPS}/smollm-decode",
        {
            "spec": {
                "replicas": 7,
                "template": {"spec": {"containers": [{"name": "agent", "image": "evil:1", "args": []}]}},
            }
        },
    )
    assert cluster.wait_for(lambda: cluster.get(svc_path), what="service recreated")
    assert cluster.wait_for(lambda: deployment(cluster, "prefill"), what="prefill recreated")
    decode = cluster.wait_for(
        lambda: (d := deployment(cluster, "decode")) and d["spec"]["replicas"] == 1 and d,
        what="decode repaired",
    )
    container = decode["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "pagoda/node-agent:0.1.0" and flag(decode, "--role") == "decode"


def test_deleting_the_modeldeployment_is_handled(cluster: Cluster) -> None:
    create_md(cluster, example(**CPU))
    cluster.wait_for(lambda: deployment(cluster, "router"), what="children")
    md = cluster.get(MD)
    assert not md["metadata"].get("finalizers")  # no finalizer: deletion never waits for the operator
    cluster.delete(MD)
    cluster.wait_for(lambda: cluster.get(MD) is None, what="object gone")
    # Children carry the owner's uid, so the garbage collector removes them; the operator
    # must not bring back a child once its owner is gone.
    cluster.delete(f"{DEPS}/smollm-decode")
    time.sleep(2)
    assert deployment(cluster, "decode") is None


def test_agent_reports_aggregate_with_staleness_and_pruning(cluster: Cluster) -> None:
    create_md(cluster, example(prefill={"gpus": 0}, decode={"gpus": 0, "replicas": 2}))
    cluster.wait_for(lambda: deployment(cluster, "router"), what="children")
    for pod, pool in (("p-0", "prefill"), ("d-0", "decode"), ("d-1", "decode"), ("d-old", "decode")):
        add_pod(cluster, pod, pool)
    agent_patch(cluster, "p-0", report("prefill", kv_cap=500))
    agent_patch(cluster, "d-0", report("decode", kv_cap=1000))
    agent_patch(cluster, "d-1", report("decode", kv_cap=3000))
    agent_patch(cluster, "d-old", report("decode", age_s=600, kv_cap=99999))

    def aggregated() -> dict | None:
        md = cluster.get(MD)
        decode = md["status"].get("decode") or {}
        # All four reports read (a pass may run between two of the patches above).
        return md if decode.get("kvCapacityTokens") == 4000 and decode.get("staleAgents") == 1 else None

    md = cluster.wait_for(aggregated, what="aggregation")
    decode, prefill = md["status"]["decode"], md["status"]["prefill"]
    assert decode["reportingAgents"] == 2 and decode["staleAgents"] == 1
    assert (
        decode["tokensPerSecond"] == 101.0 and decode["kvUsedTokens"] == 20 and decode["weightBytes"] == 200
    )
    assert prefill["kvCapacityTokens"] == 500 and prefill["reportingAgents"] == 1
    # auto weights as the agents report them resolved (the built-in GGUF: fp8 prefill, int4 decode)
    assert (prefill["formats"], decode["formats"]) == ("fp8/bf16", "int4/int8")
    assert md["status"]["agents"]["d-old"]["stale"] is True
    assert md["status"]["agents"]["d-0"]["stale"] is False
    degraded = condition(md, "Degraded")
    assert (
        degraded["status"] == "True"
        and degraded["reason"] == "StaleAgents"
        and "d-old" in degraded["message"]
    )

    agent_patch(cluster, "d-old", report("decode", kv_cap=5))  # it reports again: fresh
    md = cluster.wait_for(
        lambda: (m := cluster.get(MD)) and m["status"]["decode"]["kvCapacityTokens"] == 4005 and m
    )
    assert md["status"]["agents"]["d-old"]["stale"] is False
    assert condition(md, "Degraded")["reason"] != "StaleAgents"


def test_kv_integrity_degraded_above_threshold_over_window(cluster: Cluster) -> None:
    create_md(cluster, example(**CPU, integrity={"mismatchRateThreshold": 0.01, "windowSeconds": 10}))
    cluster.wait_for(lambda: deployment(cluster, "router"), what="children")
    add_pod(cluster, "d-0", "decode")
    agent_patch(cluster, "d-0", report("decode", checks=100_000, mismatches=5_000))
    # The first window starts before this agent reported, so its counters count in full: 5%.
    md = cluster.wait_for(
        lambda: (
            (m := cluster.get(MD))
            and (c := condition(m, "KVIntegrityDegraded"))
            and c["status"] == "True"
            and m
        )
    )
    assert md["status"]["decode"]["mismatchRate"] == 0.05 and md["status"]["mismatchRate"] == 0.05
    assert condition(md, "KVIntegrityDegraded")["reason"] == "MismatchRateAboveThreshold"

    # A new window (its per-agent baselines are in the operator's memory, the status shows when it
    # began): 1000 new checks with no new mismatches.
    first = md["status"]["integrityWindow"]["startTime"]
    cluster.wait_for(
        lambda: (
            (w := cluster.get(MD)["status"]["integrityWindow"])["startTime"] != first and w["agents"] == 1
        ),
        timeout=20,
        what="a new window",
    )
    agent_patch(cluster, "d-0", report("decode", checks=101_000, mismatches=5_000))
    md = cluster.wait_for(
        lambda: (m := cluster.get(MD)) and condition(m, "KVIntegrityDegraded")["status"] == "False" and m,
        timeout=20,
    )
    assert md["status"]["decode"]["mismatchRate"] == 0.0
    assert condition(md, "KVIntegrityDegraded")["reason"] == "WithinThreshold"


def set_ready_named(cluster: Cluster, name: str, replicas: int, **extra: object) -> None:
    status = {"replicas": replicas, "updatedReplicas": replicas, "readyReplicas": replicas, **extra}
    cluster.patch(f"{DEPS}/{name}/status", {"status": status})


def selects(cluster: Cluster, pool: str) -> str | None:
    """The format generation the pool's ClusterIP Service selects, or None while its headless twin
    does not agree yet (the two are patched one after the other: a shift read between the two
    writes is in transition, and a steady state where they differ fails every caller's check)."""
    svc = cluster.get(f"{SVC_PATH.format(ns=NS)}/smollm-{pool}")["spec"]["selector"]
    headless = cluster.get(f"{SVC_PATH.format(ns=NS)}/smollm-{pool}-pods")["spec"]["selector"]
    return svc.get("pagoda.dev/formats") if svc == headless else None


NEW_GENERATION = generation_of(("auto", "int8", "auto", "int8"))


@pytest.mark.slow  # about 20 s: the whole blue/green sequence on the operator's timer
def test_a_kv_format_change_brings_up_the_new_pair_before_removing_the_old(cluster: Cluster) -> None:
    create_md(cluster, example(**CPU))
    cluster.wait_for(lambda: deployment(cluster, "router"), what="children")
    for role in ("prefill", "decode", "router"):
        set_ready(cluster, role, 1)
    settled(cluster)
    # the pass that saw the pair ready has run: the blue pair's history is complete from here on
    cluster.wait_for(lambda: condition(cluster.get(MD), "Ready")["status"] == "True", what="Ready")
    blue = {p: cluster.emulator.objects["apps/v1/deployments", NS, f"smollm-{p}"].history for p in POOLS}
    blue_spec = {p: copy.deepcopy(dict(blue[p][-1]["spec"])) for p in POOLS}
    blue_len = {p: len(blue[p]) for p in POOLS}
    update_spec(cluster, {"prefill": {"gpus": 0, "kvCacheFormat": "int8"}})

    # 1. The new pair starts beside the serving one, which is left as it is and keeps the traffic.
    green = cluster.wait_for(lambda: cluster.get(f"{DEPS}/smollm-decode-green"), what="green decode")
    green_prefill = cluster.wait_for(
        lambda: cluster.get(f"{DEPS}/smollm-prefill-green"), what="green prefill"
    )
    assert flag(green_prefill, "--prefill-kv") == "int8" and flag(green, "--prefill-kv") == "int8"
    assert green["spec"]["template"]["metadata"]["labels"]["pagoda.dev/formats"] == NEW_GENERATION
    assert green["spec"]["selector"]["matchLabels"]["pagoda.dev/slot"] == "green"
    md = cluster.wait_for(
        lambda: (m := cluster.get(MD)) and condition(m, "Progressing")["reason"] == "StartNewPair" and m,
        what="StartNewPair",
    )
    assert condition(md, "Ready")["status"] == "True"  # the serving pair is still serving
    time.sleep(1)
    for pool in ("prefill", "decode"):
        live = deployment(cluster, pool)
        assert live["spec"]["replicas"] == 1 and flag(live, "--prefill-kv") == "bf16"
        assert selects(cluster, pool) == GENERATION

    # 2. Both new pools ready: decode moves first (old bf16 prefill -> new fp8 decode is allowed),
    #    then prefill; the old pair is removed after that, and was never written to.
    set_ready_named(cluster, "smollm-prefill-green", 1)
    set_ready_named(cluster, "smollm-decode-green", 1)
    cluster.wait_for(lambda: selects(cluster, "decode") == NEW_GENERATION, what="decode shifted")
    cluster.wait_for(lambda: selects(cluster, "prefill") == NEW_GENERATION, what="prefill shifted")
    for pool in POOLS:
        history = cluster.emulator.objects["apps/v1/deployments", NS, f"smollm-{pool}"].history
        # its spec never changed during the whole change (a late write of the same spec from the
        # pass that saw it ready is allowed: it changes nothing), and it was never scaled to 0; a
        # None entry is its deletion, which may already have come on a fast machine
        versions = [v for v in history[blue_len[pool] :] if v is not None]
        assert all(v["spec"] == blue_spec[pool] for v in versions)
        assert all(v["spec"]["replicas"] == 1 for v in history if v is not None)
    cluster.wait_for(lambda: deployment(cluster, "prefill") is None, what="old prefill removed")
    cluster.wait_for(lambda: deployment(cluster, "decode") is None, what="old decode removed")
    md = cluster.wait_for(
        lambda: (m := cluster.get(MD)) and condition(m, "Progressing")["reason"] == "RolloutComplete" and m,
        what="rollout complete",
    )
    assert md["status"]["rollout"] == {"handoff": "int8->int8", "generation": NEW_GENERATION}
    assert md["status"]["prefill"]["ready"] == "1/1"  # the green pair serves


def test_a_stalled_new_pair_is_degraded_and_the_old_pair_keeps_serving(cluster: Cluster) -> None:
    create_md(cluster, example(**CPU))
    cluster.wait_for(lambda: deployment(cluster, "router"), what="children")
    for role in ("prefill", "decode", "router"):
        set_ready(cluster, role, 1)
    update_spec(cluster, {"decode": {"gpus": 0, "weightFormat": "bf16"}})  # a weight format change too
    for pool in ("decode", "prefill"):  # the pass creates them one after the other
        cluster.wait_for(lambda pool=pool: cluster.get(f"{DEPS}/smollm-{pool}-green"), what=f"green {pool}")
    stuck = {
        "type": "Progressing",
        "status": "False",
        "reason": "ProgressDeadlineExceeded",
        "message": 'ReplicaSet "smollm-decode-green-7d9" has timed out progressing.',
    }
    set_ready_named(cluster, "smollm-prefill-green", 1)
    set_ready_named(cluster, "smollm-decode-green", 0, conditions=[stuck])
    md = cluster.wait_for(
        lambda: (m := cluster.get(MD)) and condition(m, "Degraded")["reason"] == "NewPairStalled" and m,
        what="NewPairStalled",
    )
    assert "has timed out progressing" in condition(md, "Degraded")["message"]
    assert condition(md, "Ready")["status"] == "True"
    for pool in ("prefill", "decode"):
        assert selects(cluster, pool) == GENERATION and deployment(cluster, pool)["spec"]["replicas"] == 1


def test_spec_the_operator_rejects_gets_a_condition_and_no_children(cluster: Cluster) -> None:
    create_md(cluster, example(**{"prefill": {"gpus": 0, "weightFormat": "int4"}, "decode": {"gpus": 0}}))
    md = cluster.wait_for(lambda: (m := cluster.get(MD)) and condition(m, "Ready") and m, what="condition")
    ready = condition(md, "Ready")
    assert ready["status"] == "False" and ready["reason"] == "UnsupportedFormat"
    assert "INT4 pays off in decode only" in ready["message"]
    assert condition(md, "Degraded")["status"] == "True"
    assert deployment(cluster, "decode") is None


# --- credentials and network policies ---------------------------------------------------------

SECRETS = SECRET_PATH.format(ns=NS)
NETPOLS = NETPOL_PATH.format(ns=NS)
INTERNAL = f"{SECRETS}/smollm-internal"
ROLES = ("prefill", "decode", "router")
WRITES = {"create", "patch", "update", "delete"}


def env_of(dep: dict) -> dict[str, dict]:
    return {e["name"]: e for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}


def writes(cluster: Cluster) -> list:
    """The reconciler's writes so far: children and the status subresource. Left out are kopf's
    own Events and its bookkeeping patches of the ModelDeployment's metadata (finalizer, handled
    spec), which kopf repeats against kmock because kmock never bumps resourceVersion."""
    return [
        c
        for c in cluster.emulator.calls
        if c.verb in WRITES and c.resource not in ("events", "modeldeployments")
    ]


def settled(cluster: Cluster) -> dict:
    """The ModelDeployment once a pass wrote its status and kopf recorded the handled spec."""
    return cluster.wait_for(
        lambda: (
            (m := cluster.get(MD))
            and condition(m, "Ready")
            and "pagoda.dev/last-handled-configuration" in m["metadata"].get("annotations", {})
            and m
        ),
        what="first pass done",
    )


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def test_internal_secret_is_created_once_and_every_pod_references_it(cluster: Cluster) -> None:
    create_md(cluster, example(**CPU))
    cluster.wait_for(lambda: deployment(cluster, "router"), what="children")
    settled(cluster)
    secret = cluster.get(INTERNAL)
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert secret["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "pagoda-operator"
    assert secret["metadata"]["labels"]["pagoda.dev/model-deployment"] == "smollm"
    assert set(secret["data"]) == {"internal-token", "tenant-secret"}
    for value in secret["data"].values():
        assert re.fullmatch(r"[A-Za-z0-9_-]{43,}", base64.b64decode(value).decode())
    for role in ROLES:
        dep = deployment(cluster, role)
        env = env_of(dep)
        assert env["PAGODA_INTERNAL_TOKEN"]["valueFrom"]["secretKeyRef"] == {
            "name": "smollm-internal",
            "key": "internal-token",
        }
        assert env["PAGODA_TENANT_SECRET"]["valueFrom"]["secretKeyRef"] == {
            "name": "smollm-internal",
            "key": "tenant-secret",
        }
        annotations = dep["spec"]["template"]["metadata"]["annotations"]
        assert annotations["pagoda.dev/internal-secret-uid"] == secret["metadata"]["uid"]
    assert [c.verb for c in writes(cluster) if c.resource == "secrets"] == ["create"]

    # Later passes (timer every 0.5 s) neither rotate the Secret nor write anything else.
    before = writes(cluster)
    time.sleep(2.5)
    assert writes(cluster) == before
    assert cluster.get(INTERNAL)["data"] == secret["data"]
    assert len(cluster.emulator.objects["v1/secrets", NS, "smollm-internal"].history) == 1


def test_a_deleted_internal_secret_comes_back_new_and_rolls_every_pod(cluster: Cluster) -> None:
    create_md(cluster, example(**CPU))
    cluster.wait_for(lambda: deployment(cluster, "router"), what="children")
    old = cluster.wait_for(lambda: cluster.get(INTERNAL), what="internal Secret")
    cluster.delete(INTERNAL)
    new = cluster.wait_for(
        lambda: (s := cluster.get(INTERNAL)) and s["metadata"]["uid"] != old["metadata"]["uid"] and s,
        what="a new internal Secret",
    )
    assert all(new["data"][key] != old["data"][key] for key in ("internal-token", "tenant-secret"))
    for role in ROLES:
        cluster.wait_for(
            lambda role=role: (
                deployment(cluster, role)["spec"]["template"]["metadata"]["annotations"][
                    "pagoda.dev/internal-secret-uid"
                ]
                == new["metadata"]["uid"]
            ),
            what=f"{role} template on the new Secret",
        )


def test_missing_api_keys_secret_is_reported_until_it_is_there(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    create_md(cluster, example(**CPU, auth={"apiKeysSecret": {"name": "team-keys"}}))
    md = cluster.wait_for(
        lambda: (m := cluster.get(MD)) and condition(m, "Degraded")["reason"] == "ApiKeysSecretMissing" and m,
        what="ApiKeysSecretMissing",
    )
    ready, degraded = condition(md, "Ready"), condition(md, "Degraded")
    assert ready["status"] == "False" and ready["reason"] == "ApiKeysSecretMissing"
    assert degraded["status"] == "True" and "Secret default/team-keys" in degraded["message"]
    assert "does not exist" in degraded["message"]
    # The children are there all the same; the router's mount waits for the Secret.
    router = deployment(cluster, "router")
    assert env_of(router)["PAGODA_API_KEYS_FILE"]["value"] == "/etc/pagoda/api-keys/keys"
    volumes = router["spec"]["template"]["spec"]["volumes"]
    assert volumes[0]["secret"]["secretName"] == "team-keys"
    for role in ("prefill", "decode"):
        assert "PAGODA_API_KEYS_FILE" not in env_of(deployment(cluster, role))
        assert "volumes" not in deployment(cluster, role)["spec"]["template"]["spec"]

    value = "tenant-a pk-do-not-leak-0123456789"
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "team-keys", "namespace": NS}}
    cluster.create(SECRETS, {**secret, "data": {"wrong-key": b64(value)}})
    md = cluster.wait_for(
        lambda: (
            (m := cluster.get(MD)) and "has no key 'api-keys'" in condition(m, "Degraded")["message"] and m
        ),
        what="missing key reported",
    )
    assert condition(md, "Ready")["reason"] == "ApiKeysSecretMissing"
    cluster.patch(f"{SECRETS}/team-keys", {"data": {"api-keys": b64(value)}})
    md = cluster.wait_for(
        lambda: (m := cluster.get(MD)) and condition(m, "Degraded")["reason"] == "AsExpected" and m,
        what="condition cleared",
    )
    assert condition(md, "Ready")["reason"] == "PoolsNotReady"
    # The value is read by nobody but the kubelet: not in the status, Events or operator logs.
    # kopf posts Events one by one behind the pass: wait for the one of this transition.
    events = cluster.wait_for(
        lambda: (
            (items := cluster.get(EVENT_PATH.format(ns=NS))["items"])
            and any(e["reason"] == "DegradedTrue" and "team-keys" in e["message"] for e in items)
            and items
        ),
        what="the DegradedTrue Event",
    )
    operator_logs = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith(("kopf", "pagoda")))
    assert "team-keys" in operator_logs  # the operator's logs were captured ...
    for text in (json.dumps(md), json.dumps(events), operator_logs):
        assert "pk-do-not-leak" not in text and b64(value) not in text  # ... and hold no key


def test_network_policies_are_repaired_and_removed_when_turned_off(cluster: Cluster) -> None:
    create_md(cluster, example(**CPU, networkPolicy={"metricsFrom": [{"namespaceSelector": {}}]}))
    for role in ("decode", "prefill"):
        policy = cluster.wait_for(lambda role=role: cluster.get(f"{NETPOLS}/smollm-{role}"), what=role)
        assert policy["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
        assert policy["spec"]["podSelector"]["matchLabels"]["pagoda.dev/pool"] == role
        assert policy["spec"]["ingress"][-1] == {
            "from": [{"namespaceSelector": {}}],
            "ports": [{"protocol": "TCP", "port": 8000}],
        }
    cluster.delete(f"{NETPOLS}/smollm-decode")
    assert cluster.wait_for(lambda: cluster.get(f"{NETPOLS}/smollm-decode"), what="policy recreated")

    update_spec(cluster, {"networkPolicy": {"enabled": False}})
    for role in ("decode", "prefill"):
        cluster.wait_for(
            lambda role=role: cluster.get(f"{NETPOLS}/smollm-{role}") is None, what=f"{role} gone"
        )
    deletes = [c for c in writes(cluster) if c.verb == "delete"]
    assert sorted(c.name for c in deletes) == ["smollm-decode", "smollm-prefill"]


# Rules the chart grants that no pass here exercises, and why they are needed anyway.
UNEXERCISED = {
    ("", "namespaces", "list"): "kopf lists namespaces when PAGODA_WATCH_NAMESPACES holds patterns",
    ("", "namespaces", "watch"): "likewise",
    ("rbac.authorization.k8s.io", "clusterroles", "bind"): "checked by the API server when the "
    "agents' RoleBinding to the chart's agent ClusterRole is created (no call of its own)",
    ("rbac.authorization.k8s.io", "roles", "delete"): "an earlier operator's Role, on upgrade",
    ("rbac.authorization.k8s.io", "rolebindings", "delete"): "an earlier operator's RoleBinding, on upgrade",
    ("inference.networking.k8s.io", "inferencepools", "create"): "spec.router.gateway (test_gateway.py)",
    ("inference.networking.k8s.io", "inferencepools", "patch"): "likewise",
    ("inference.networking.k8s.io", "inferencepools", "delete"): "likewise",
    ("gateway.networking.k8s.io", "httproutes", "create"): "likewise",
    ("gateway.networking.k8s.io", "httproutes", "patch"): "likewise",
    ("gateway.networking.k8s.io", "httproutes", "delete"): "likewise",
    ("", "configmaps", "get"): "spec.rollout.qualityGate: the probe set (test_quality_gate_kmock.py)",
    ("", "configmaps", "create"): "likewise: the reference of a passed gate",
    ("", "configmaps", "patch"): "likewise: the reference of a later passed gate (test_quality_gate.py)",
    # get: the watch cache answers every read of these kinds; the API is asked only for an object
    # the cache cannot answer for (a foreign one met on create: watch_cache.CachedKube).
    ("apps", "deployments", "get"): "a foreign Deployment met on create (test_controllers_kmock.py)",
    ("rbac.authorization.k8s.io", "roles", "get"): "likewise, a foreign Role",
    ("inference.networking.k8s.io", "inferencepools", "get"): "likewise, a foreign InferencePool",
    ("gateway.networking.k8s.io", "httproutes", "get"): "likewise, a foreign HTTPRoute",
    (
        "pagoda.dev",
        "modeldeployments/finalizers",
        "update",
    ): "blockOwnerDeletion under OwnerReferencesPermissionEnforcement",
}


def chart_rules() -> set[tuple[str, str, str]]:
    chart = helm_python.Chart.load(str(CHART))
    docs = [
        d
        for path, text in chart.render({}, name="pagoda", namespace="pagoda-system").items()
        if path.endswith(".yaml")
        for d in yaml.safe_load_all(text)
        if d
    ]
    role = next(d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "pagoda-operator")
    return {
        (g, r, v)
        for rule in role["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }


@pytest.mark.slow  # about 25 s: every path of the operator, a format change and a LeaderWorkerSet included
@pytest.mark.parametrize(  # the chart's default (cluster) mode: the agents' ClusterRole is bound
    "operator_config",
    [
        Config(
            resync_s=0.5,
            stale_after_s=30,
            report_interval_s=5,
            install_crd=False,
            shift_settle_s=0.5,
            agent_cluster_role="pagoda-agent",
            secret_cache_s=0.5,
        )
    ],
)
def test_chart_rbac_allows_exactly_what_the_operator_calls(cluster: Cluster) -> None:
    """Every path of the operator runs against kmock; each request it made must be allowed by the
    chart's ClusterRole, and each verb the ClusterRole grants must have been used (or be listed)."""
    create_md(
        cluster,
        example(
            prefill={"gpus": 0},
            decode={"gpus": 0, "autoscaling": AUTO},
            auth={"apiKeysSecret": {"name": "team-keys"}},
        ),
    )
    cluster.wait_for(lambda: deployment(cluster, "router"), what="children")
    add_pod(cluster, "d-0", "decode")
    rbac = "/apis/rbac.authorization.k8s.io/v1/namespaces/default"
    edited = [
        f"/api/v1/namespaces/{NS}/serviceaccounts/smollm-pagoda-agent",
        f"{rbac}/rolebindings/smollm-pagoda-agent-pods",
        f"{SVC_PATH.format(ns=NS)}/smollm-router",
        f"{NETPOLS}/smollm-prefill",
        f"{PDB_PATH.format(ns=NS)}/smollm-router",
        f"{HPA_PATH.format(ns=NS)}/smollm-decode",
    ]
    for path in edited:  # hand edits the operator repairs with a patch
        cluster.patch(path, {"metadata": {"labels": {"app.kubernetes.io/managed-by": "someone"}}})
    for path in edited:
        cluster.wait_for(
            lambda path=path: (
                cluster.get(path)["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "pagoda-operator"
            ),
            what=f"{path} repaired",
        )
    cluster.delete(INTERNAL)
    cluster.wait_for(lambda: cluster.get(INTERNAL), what="internal Secret recreated")
    update_spec(cluster, {"prefill": {"gpus": 0, "kvCacheFormat": "int8"}})  # blue/green
    for pool in ("decode", "prefill"):  # the pass creates them one after the other
        cluster.wait_for(lambda pool=pool: cluster.get(f"{DEPS}/smollm-{pool}-green"), what=f"green {pool}")
    set_ready_named(cluster, "smollm-prefill-green", 1)
    set_ready_named(cluster, "smollm-decode-green", 2)
    cluster.wait_for(lambda: deployment(cluster, "decode") is None, what="the old pair removed", timeout=120)
    update_spec(cluster, {"decode": {"tensorParallel": 2, "nodesPerReplica": 2}})  # a LeaderWorkerSet
    lws = f"{LWS_PATH.format(ns=NS)}/smollm-decode-green"
    cluster.wait_for(lambda: cluster.get(lws), what="LeaderWorkerSet")
    cluster.patch(lws, {"metadata": {"labels": {"app.kubernetes.io/managed-by": "someone"}}})
    cluster.wait_for(
        lambda: cluster.get(lws)["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "pagoda-operator",
        what="LeaderWorkerSet repaired",
    )
    update_spec(
        cluster,
        {
            "networkPolicy": {"enabled": False},
            "router": {"disruptionBudget": {"enabled": False}},
            "decode": {"autoscaling": None, "tensorParallel": 1, "nodesPerReplica": 1},
        },
    )
    cluster.wait_for(lambda: cluster.get(lws) is None, what="back to a Deployment")
    cluster.wait_for(lambda: cluster.get(f"{NETPOLS}/smollm-decode") is None, what="policies deleted")
    cluster.wait_for(
        lambda: cluster.get(f"{PDB_PATH.format(ns=NS)}/smollm-router") is None, what="PDB deleted"
    )
    cluster.wait_for(
        lambda: cluster.get(f"{HPA_PATH.format(ns=NS)}/smollm-decode") is None, what="HPA deleted"
    )
    cluster.delete(MD)
    cluster.wait_for(lambda: cluster.get(MD) is None, what="finalizer released")

    allowed = chart_rules()
    used = {(c.group, c.resource, c.verb) for c in cluster.emulator.calls}
    assert used - allowed == set(), "requests the chart's RBAC would refuse"
    assert allowed - used == set(UNEXERCISED), "RBAC the operator does not need"


def quiet_events(cluster: Cluster, still_s: float = 1.0) -> int:
    """The number of Events once it stops growing: kopf posts Events one by one behind the passes
    (a fraction of a second each on a loaded machine), so the first pass's keep arriving a while."""
    count = -1
    while (now := len(cluster.get(EVENT_PATH.format(ns=NS))["items"])) != count:
        count = now
        time.sleep(still_s)
    return count


def test_an_unchanged_resync_posts_no_event(cluster: Cluster) -> None:
    """The timer pass runs every 0.5 s here; with nothing changed it neither writes nor posts Events."""
    create_md(cluster, example(**CPU))
    cluster.wait_for(lambda: deployment(cluster, "router"), what="children")
    settled(cluster)
    add_pod(cluster, "d-0", "decode")
    agent_patch(cluster, "d-0", report("decode"))
    cluster.wait_for(lambda: cluster.get(MD)["status"]["agentsTotal"] == 1, what="report read")
    time.sleep(1)  # let the passes that saw the report finish
    events = quiet_events(cluster)
    before = writes(cluster)
    time.sleep(2.5)  # five timer passes
    assert len(cluster.get(EVENT_PATH.format(ns=NS))["items"]) == events
    assert writes(cluster) == before
