"""The real kopf operator against the kmock emulator: children, repair, rollout order, status."""

from __future__ import annotations

import datetime as dt
import time

from op_cluster import CM_PATH, DEP_PATH, EVENT_PATH, MD_PATH, POD_PATH, SVC_PATH, Cluster
from op_schema import admit, example

NS = "default"
MD = MD_PATH.format(ns=NS) + "/smollm"
DEPS = DEP_PATH.format(ns=NS)
CPU = {"prefill": {"gpus": 0}, "decode": {"gpus": 0}}


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
    admit({**current, "spec": {**current["spec"], **spec_patch}})  # would the API server accept it?
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
    labels = {"pagoda.dev/model-deployment": "smollm", "pagoda.dev/pool": pool}
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
            "decodeKv": "fp8_e4m3",
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
    """What an agent's reporter sends: a merge patch of its own key on the status subresource."""
    cluster.patch(MD + "/status", {"status": {"agents": {pod: body}}})


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
        assert (flag(dep, "--prefill-weights"), flag(dep, "--prefill-kv")) == ("fp8", "bf16")
        assert (flag(dep, "--decode-weights"), flag(dep, "--decode-kv")) == ("int4", "fp8_e4m3")
        assert flag(dep, "--integrity") == "enforce"
        assert "--no-prefix-caching" in args_of(dep) and "--no-session-affinity" not in args_of(dep)
        env = {e["name"]: e for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env["PAGODA_MD_NAME"]["value"] == "smollm" and env["PAGODA_POOL"]["value"] == role
        assert env["PAGODA_POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        assert env["PAGODA_NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
        assert env["PAGODA_REPORT_INTERVAL_S"]["value"] == "5"
        assert "nvidia.com/gpu" not in str(dep["spec"]["template"]["spec"]["containers"][0]["resources"])
    assert flag(router, "--prefill-endpoints") == "http://smollm-prefill.default.svc:8000"
    assert flag(router, "--decode-endpoints") == "http://smollm-decode.default.svc:8000"
    assert "--prefill-endpoints" not in args_of(decode)

    for role in ("prefill", "decode", "router"):
        svc = cluster.get(f"{SVC_PATH.format(ns=NS)}/smollm-{role}")
        assert svc["spec"]["selector"] == {"pagoda.dev/model-deployment": "smollm", "pagoda.dev/pool": role}
        assert svc["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    for dep in (prefill, decode, router):
        assert dep["spec"]["template"]["metadata"]["annotations"]["pagoda.dev/handoff"] == "bf16->fp8_e4m3"
    # The agents take everything from args and env: no ConfigMap, so none that nobody reads.
    assert cluster.get(CM_PATH.format(ns=NS))["items"] == []
    role = cluster.get(f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/roles/smollm-agent")
    assert role["rules"] == [
        {
            "apiGroups": ["pagoda.dev"],
            "resources": ["modeldeployments/status"],
            "resourceNames": ["smollm"],
            "verbs": ["get", "patch"],
        }
    ]

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
    assert md["status"]["decode"]["ready"] == "1/1" and md["status"]["decode"]["formats"] == "int4/fp8_e4m3"
    events = cluster.wait_for(lambda: cluster.get(EVENT_PATH.format(ns=NS))["items"], what="events")
    reasons = {e["reason"] for e in events}
    assert "Created" in reasons


def test_update_rolls_out_and_rerun_changes_nothing(cluster: Cluster) -> None:
    create_md(cluster, example(**CPU))
    cluster.wait_for(lambda: deployment(cluster, "router"), what="children")
    update_spec(
        cluster,
        {"decode": {"gpus": 0, "replicas": 3, "weightFormat": "bf16"}, "integrity": {"mode": "audit"}},
    )
    decode = cluster.wait_for(
        lambda: (d := deployment(cluster, "decode")) and d["spec"]["replicas"] == 3 and d,
        what="decode scaled",
    )
    assert flag(decode, "--decode-weights") == "bf16" and flag(decode, "--integrity") == "audit"
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
    assert md["metadata"]["finalizers"] == ["pagoda.dev/operator"]  # kopf stops the timer first
    cluster.delete(MD)
    cluster.wait_for(lambda: cluster.get(MD) is None, what="finalizer released and object gone")
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
    agent_patch(cluster, "gone-pod", report("decode", kv_cap=77777))

    def aggregated() -> dict | None:
        md = cluster.get(MD)
        decode = md["status"].get("decode") or {}
        return (
            md
            if decode.get("kvCapacityTokens") == 4000 and "gone-pod" not in md["status"]["agents"]
            else None
        )

    md = cluster.wait_for(aggregated, what="aggregation")
    decode, prefill = md["status"]["decode"], md["status"]["prefill"]
    assert decode["reportingAgents"] == 2 and decode["staleAgents"] == 1
    assert (
        decode["tokensPerSecond"] == 101.0 and decode["kvUsedTokens"] == 20 and decode["weightBytes"] == 200
    )
    assert prefill["kvCapacityTokens"] == 500 and prefill["reportingAgents"] == 1
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

    # A new window: its snapshot is kept in status; 1000 new checks with no new mismatches.
    cluster.wait_for(
        lambda: (
            cluster.get(MD)["status"]["integrityWindow"]["counters"].get("d-0", {}).get("checks") == 100_000
        ),
        timeout=20,
        what="snapshot",
    )
    agent_patch(cluster, "d-0", report("decode", checks=101_000, mismatches=5_000))
    md = cluster.wait_for(
        lambda: (m := cluster.get(MD)) and condition(m, "KVIntegrityDegraded")["status"] == "False" and m,
        timeout=20,
    )
    assert md["status"]["decode"]["mismatchRate"] == 0.0
    assert condition(md, "KVIntegrityDegraded")["reason"] == "WithinThreshold"


def test_kv_handoff_change_rolls_in_a_safe_order(cluster: Cluster) -> None:
    create_md(cluster, example(**CPU))
    cluster.wait_for(lambda: deployment(cluster, "router"), what="children")
    for role in ("prefill", "decode", "router"):
        set_ready(cluster, role, 1)
    update_spec(cluster, {"prefill": {"gpus": 0, "kvCacheFormat": "fp8_e4m3"}})

    # 1. prefill drains first, still on its old template; decode is untouched.
    prefill = cluster.wait_for(
        lambda: (d := deployment(cluster, "prefill")) and d["spec"]["replicas"] == 0 and d, what="drain"
    )
    assert flag(prefill, "--prefill-kv") == "bf16"
    assert flag(deployment(cluster, "decode"), "--prefill-kv") == "bf16"
    md = cluster.wait_for(
        lambda: (m := cluster.get(MD)) and condition(m, "Progressing")["reason"] == "DrainPrefill" and m
    )
    assert "drains before the decode pool" in condition(md, "Progressing")["message"]
    time.sleep(1)
    assert flag(deployment(cluster, "decode"), "--prefill-kv") == "bf16"  # still waiting for the drain

    # 2. prefill pods are gone -> decode rolls; prefill stays at zero while old decode pods remain.
    set_ready(cluster, "prefill", 0)
    decode = cluster.wait_for(
        lambda: (d := deployment(cluster, "decode")) and flag(d, "--prefill-kv") == "fp8_e4m3" and d,
        what="decode rolled",
    )
    assert decode["spec"]["template"]["metadata"]["annotations"]["pagoda.dev/handoff"] == "fp8_e4m3->fp8_e4m3"
    set_ready(cluster, "decode", 1, updated=1, total=2)  # one old decode pod still running
    time.sleep(1.5)
    assert deployment(cluster, "prefill")["spec"]["replicas"] == 0

    # 3. only new decode pods -> prefill comes back with the new format.
    set_ready(cluster, "decode", 1)
    prefill = cluster.wait_for(
        lambda: (d := deployment(cluster, "prefill")) and d["spec"]["replicas"] == 1 and d,
        what="prefill restored",
    )
    assert flag(prefill, "--prefill-kv") == "fp8_e4m3"


def test_spec_the_operator_rejects_gets_a_condition_and_no_children(cluster: Cluster) -> None:
    create_md(cluster, example(**{"prefill": {"gpus": 0, "weightFormat": "int4"}, "decode": {"gpus": 0}}))
    md = cluster.wait_for(lambda: (m := cluster.get(MD)) and condition(m, "Ready") and m, what="condition")
    ready = condition(md, "Ready")
    assert ready["status"] == "False" and ready["reason"] == "UnsupportedFormat"
    assert "INT4 pays off in decode only" in ready["message"]
    assert condition(md, "Degraded")["status"] == "True"
    assert deployment(cluster, "decode") is None
