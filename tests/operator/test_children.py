"""Manifests built for one ModelDeployment: Kubernetes schemas, GPU placement, args."""

from __future__ import annotations

import argparse
import asyncio
import base64
import copy
import ipaddress
import re

import jsonschema
import kubernetes_validate
import pytest
from fake_kube import merge_patch
from op_schema import admit, example

from pagoda.node_agent.cli.serve import add_serve_args
from pagoda.operator import apply, children, credentials
from pagoda.operator.config import Config
from pagoda.operator.spec import parse

META = {"name": "m", "namespace": "ns", "uid": "u-1"}
CFG = Config(fp8_placement="label", fp8_node_label="example.com/gpu")


def build(**spec: object) -> dict:
    stored = admit(example("m", **spec))
    return children.build(META, parse(stored["spec"]), CFG)


@pytest.mark.parametrize(
    "spec",
    [
        {},
        {
            "prefill": {"gpus": 0},
            "decode": {"gpus": 0},
            "router": {"serviceType": "LoadBalancer", "port": 80},
        },
        {
            "model": {"source": "pvc://models/llama-3-8b"},
            "decode": {
                "gpus": 2,
                "tensorParallel": 2,
                "resources": {"requests": {"cpu": "4", "memory": "32Gi"}},
                "nodeSelector": {"pool": "gpu"},
                "tolerations": [
                    {"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}
                ],
            },
            "auth": {"apiKeysSecret": {"name": "team-keys", "key": "keys.txt"}},
            "routing": {"trustTenantHeader": True},
            "networkPolicy": {
                "metricsFrom": [
                    {
                        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
                        "podSelector": {
                            "matchExpressions": [{"key": "app", "operator": "In", "values": ["prometheus"]}]
                        },
                    },
                    {"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}},
                ]
            },
        },
    ],
)
def test_every_child_validates_against_its_kubernetes_schema(spec: dict) -> None:
    objs = build(**spec)
    assert {o["kind"] for o in objs.values()} == {
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "NetworkPolicy",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
    }
    for obj in [*objs.values(), credentials.internal_secret(META)]:
        kubernetes_validate.validate(obj, "1.33", strict=True)


def test_gpu_pools_request_gpus_and_fp8_pools_get_node_affinity() -> None:
    objs = build(
        prefill={"weightFormat": "bf16", "kvCacheFormat": "bf16"},
        decode={"gpus": 2, "tensorParallel": 2, "kvCacheFormat": "fp8_e4m3"},
    )
    prefill = objs["Deployment/m-prefill"]["spec"]["template"]["spec"]
    decode = objs["Deployment/m-decode"]["spec"]["template"]["spec"]
    assert decode["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert prefill["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    term = decode["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert term == [{"matchExpressions": [{"key": "example.com/gpu", "operator": "In", "values": ["true"]}]}]
    assert "affinity" not in prefill  # bf16/bf16 runs on any GPU
    default = build(decode={"gpus": 1})["Deployment/m-decode"]["spec"]["template"]["spec"]
    assert "affinity" not in default  # auto decode weights (int4 or stored) and int8 KV: no FP8 needed


@pytest.mark.parametrize(
    ("prefill", "fp8"),
    [("auto", True), ("fp8", True), ("stored", False), ("bf16", False)],
)
def test_auto_prefill_weights_are_placed_as_fp8(prefill: str, fp8: bool) -> None:
    """auto prefill weights resolve to fp8 on a dense or GGUF source (the operator does not read the
    source), so the pool gets the FP8 node requirement; an explicit stored prefill does not."""
    spec = {"gpus": 1, "weightFormat": prefill, "kvCacheFormat": "bf16"}
    pod = build(prefill=spec)["Deployment/m-prefill"]["spec"]["template"]["spec"]
    assert ("affinity" in pod) == fp8
    if fp8:
        terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert terms["nodeSelectorTerms"][0]["matchExpressions"][-1]["key"] == "example.com/gpu"


def test_fp8_placement_by_compute_capability_needs_8_9_or_later() -> None:
    """The default placement reads GPU feature discovery's compute capability labels: no product list."""
    stored = admit(example("m", decode={"affinity": {}, "kvCacheFormat": "fp8_e4m3"}))
    objs = children.build(META, parse(stored["spec"]), Config())
    terms = objs["Deployment/m-decode"]["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]

    def schedulable(major: int, minor: int) -> bool:
        node = {"nvidia.com/gpu.compute.major": str(major), "nvidia.com/gpu.compute.minor": str(minor)}

        def ok(e: dict) -> bool:
            value = node.get(e["key"])
            if e["operator"] == "Gt":
                return value is not None and int(value) > int(e["values"][0])
            return value in e["values"]

        return any(all(ok(e) for e in t["matchExpressions"]) for t in terms)

    assert [schedulable(*cc) for cc in ((8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (7, 5))] == [
        False, False, True, True, True, False
    ]  # fmt: skip
    none = children.build(META, parse(stored["spec"]), Config(fp8_placement="none"))
    assert "affinity" not in none["Deployment/m-decode"]["spec"]["template"]["spec"]


def test_fp8_affinity_is_anded_into_each_user_term() -> None:
    user = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
                    {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]},
                ]
            }
        }
    }
    objs = build(prefill={"affinity": user})
    terms = objs["Deployment/m-prefill"]["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    assert [t["matchExpressions"][-1]["key"] for t in terms] == ["example.com/gpu", "example.com/gpu"]
    assert [t["matchExpressions"][0]["values"] for t in terms] == [["a"], ["b"]]


def test_cpu_pools_have_no_gpu_request_and_no_fp8_affinity() -> None:
    objs = build(prefill={"gpus": 0}, decode={"gpus": 0})
    for role in ("prefill", "decode"):
        pod = objs[f"Deployment/m-{role}"]["spec"]["template"]["spec"]
        assert "nvidia.com/gpu" not in str(pod)
        assert "affinity" not in pod


def test_pvc_model_is_mounted_and_passed_as_a_directory() -> None:
    objs = build(model={"source": "pvc://models/llama/3b"})
    pod = objs["Deployment/m-decode"]["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert args[args.index("--model") + 1] == "hf-dir:///mnt/models/llama/3b"
    claim = [v for v in pod["volumes"] if v["name"] == "model"][0]["persistentVolumeClaim"]
    assert claim == {"claimName": "models", "readOnly": True}
    assert pod["containers"][0]["volumeMounts"] == [
        {"name": "model", "mountPath": "/mnt/models", "readOnly": True}
    ]


def test_a_builtin_model_needs_no_volume() -> None:
    """Without a PVC model or an API keys Secret nothing is mounted: args and env are the settings."""
    for role in ("prefill", "decode", "router"):
        pod = build()[f"Deployment/m-{role}"]["spec"]["template"]["spec"]
        assert "volumes" not in pod and "volumeMounts" not in pod["containers"][0]


def test_agent_args_follow_the_contract() -> None:
    stored = admit(example("m", routing={"sessionAffinity": False}, integrity={"mode": "audit"}))
    args = children.agent_args(parse(stored["spec"]), "decode")
    assert args == [
        "serve",
        "--role",
        "decode",
        "--model",
        "builtin://smollm2-135m",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
        "--prefill-weights",
        "auto",  # the CRD default: the engine picks per source, as with the flag left out
        "--prefill-kv",
        "bf16",
        "--decode-weights",
        "auto",
        "--decode-kv",
        "int8",
        "--integrity",
        "audit",
        "--kv-memory-fraction",
        "0.9",
        "--max-num-seqs",
        "64",
        "--tensor-parallel",
        "1",
        "--tenant-header",
        "X-Pagoda-Tenant",
        "--kv-port",
        "9000",
        "--drain-timeout",
        "30",
    ]


def test_max_queue_time_is_rendered_per_pool_as_the_workers_flag() -> None:
    """maxQueueTimeSeconds of a pool becomes that pool's --max-queue-time; absent, no deadline (no
    flag); the router never gets it (the workers queue, the router only forwards their refusals)."""
    plain = admit(example("m"))
    for role in ("prefill", "decode", "router"):
        assert "--max-queue-time" not in children.agent_args(parse(plain["spec"]), role)
    stored = admit(example("m", prefill={"maxQueueTimeSeconds": 2.5}, decode={"maxQueueTimeSeconds": 30}))
    spec = parse(stored["spec"])
    for role, value in (("prefill", "2.5"), ("decode", "30")):
        args = children.agent_args(spec, role)
        assert args[args.index("--max-queue-time") + 1] == value, args
    assert "--max-queue-time" not in children.agent_args(spec, "router")
    ap = argparse.ArgumentParser()  # the flag the worker really takes, with that value
    ap.add_argument("--model")
    add_serve_args(ap)
    known, _engine_flags = ap.parse_known_args(children.agent_args(spec, "prefill")[1:])
    assert known.max_queue_time == 2.5


@pytest.mark.parametrize("value", [0, -1, 5000])
def test_a_max_queue_time_out_of_range_is_refused_at_admission(value: float) -> None:
    with pytest.raises(jsonschema.ValidationError, match="maxQueueTimeSeconds"):
        admit(example("m", decode={"maxQueueTimeSeconds": value}))


def template(objs: dict, role: str) -> dict:
    return objs[f"Deployment/m-{role}"]["spec"]["template"]


# Spec change -> the pod templates it changes. Everything else (replicas, autoscaling, budgets,
# the operator's integrity window, Services) rolls no pod.
ROLLS: list[tuple[dict, set[str]]] = [
    ({"decode": {"replicas": 3}}, set()),
    ({"prefill": {"replicas": 2}, "decode": {"replicas": 2}}, set()),
    ({"router": {"replicas": 3}}, set()),
    ({"integrity": {"windowSeconds": 60, "mismatchRateThreshold": 0.01}}, set()),
    ({"decode": {"autoscaling": {"maxReplicas": 8, "targets": {"kvCacheUsage": 0.8}}}}, set()),
    ({"decode": {"disruptionBudget": {"maxUnavailable": 2}}}, set()),
    ({"router": {"serviceType": "LoadBalancer", "port": 80}}, set()),
    ({"networkPolicy": {"enabled": False}}, set()),
    ({"rollout": {"progressDeadlineSeconds": 600}}, set()),
    ({"decode": {"rollingUpdate": {"maxSurge": 2}}}, set()),
    ({"decode": {"maxConcurrency": 128}}, {"decode"}),
    ({"prefill": {"maxQueueTimeSeconds": 5}}, {"prefill"}),
    ({"prefill": {"kvMemoryFraction": 0.5}}, {"prefill"}),
    ({"decode": {"drain": {"timeoutSeconds": 120}}}, {"decode"}),
    ({"prefill": {"startupSeconds": 1800}}, {"prefill"}),
    ({"decode": {"podTemplate": {"spec": {"priorityClassName": "llm"}}}}, {"decode"}),
    ({"router": {"drain": {"preStopSeconds": 10}}}, {"router"}),
    ({"routing": {"trustTenantHeader": True}}, {"router"}),
    ({"routing": {"sessionAffinity": False}}, {"router"}),
    ({"auth": {"apiKeysSecret": {"name": "keys"}}}, {"router"}),
    ({"decode": {"weightFormat": "bf16"}}, {"prefill", "decode"}),  # engines report all formats
    ({"integrity": {"mode": "audit"}}, {"prefill", "decode"}),
    ({"routing": {"prefixCaching": False}}, {"prefill", "decode", "router"}),
    ({"image": "pagoda/node-agent:0.2.0"}, {"prefill", "decode", "router"}),
    ({"model": {"source": "builtin://other"}}, {"prefill", "decode", "router"}),
]


@pytest.mark.parametrize(("change", "rolled"), ROLLS, ids=[str(c) for c, _ in ROLLS])
def test_which_spec_changes_roll_which_pools(change: dict, rolled: set[str]) -> None:
    """Only what a pod reads is in its template: a change rolls exactly the pools that read it."""
    before, after = build(), build(**change)
    changed = {
        role for role in ("prefill", "decode", "router") if template(before, role) != template(after, role)
    }
    assert changed == rolled


def test_an_autoscaled_pool_leaves_its_replicas_to_the_autoscaler() -> None:
    objs = build(
        decode={"autoscaling": {"minReplicas": 2, "maxReplicas": 8, "targets": {"kvCacheUsage": 0.8}}}
    )
    assert "replicas" not in objs["Deployment/m-decode"]["spec"]
    assert objs["Deployment/m-prefill"]["spec"]["replicas"] == 1
    assert "HorizontalPodAutoscaler/m-prefill" not in objs


def test_an_upgrade_drops_the_old_config_volume_and_hash() -> None:
    """A Deployment written by an operator that still mounted the ``<md>-config`` ConfigMap loses
    the volume, the mount and the config-hash annotation in one patch, and is in sync after it."""
    desired = build()["Deployment/m-decode"]
    old = copy.deepcopy(desired)
    old["spec"]["template"]["metadata"]["annotations"]["pagoda.dev/config-hash"] = "0123456789abcdef"
    old["spec"]["template"]["spec"]["volumes"] = [{"name": "config", "configMap": {"name": "m-config"}}]
    old["spec"]["template"]["spec"]["containers"][0]["volumeMounts"] = [
        {"name": "config", "mountPath": "/etc/pagoda", "readOnly": True}
    ]
    live = apply._stamped(old)  # as the previous operator created it
    patches: list[dict] = []

    class Kube:
        async def patch(self, kind: str, namespace: str, name: str, body: dict) -> None:
            patches.append(body)

    assert asyncio.run(apply.ensure(Kube(), desired, live)) == "patched"  # type: ignore[arg-type]
    patched = merge_patch(live, patches[0])
    pod = patched["spec"]["template"]
    assert "pagoda.dev/config-hash" not in pod["metadata"]["annotations"]
    assert "volumes" not in pod["spec"] and "volumeMounts" not in pod["spec"]["containers"][0]
    assert apply.in_sync(desired, patched)


def env_of(objs: dict, role: str) -> dict[str, dict]:
    return {e["name"]: e for e in template(objs, role)["spec"]["containers"][0]["env"]}


def test_every_agent_gets_the_internal_secrets_by_reference_only() -> None:
    objs = build()
    for role in ("prefill", "decode", "router"):
        env = env_of(objs, role)
        for var, key in (
            ("PAGODA_INTERNAL_TOKEN", "internal-token"),
            ("PAGODA_TENANT_SECRET", "tenant-secret"),
        ):
            assert env[var] == {
                "name": var,
                "valueFrom": {"secretKeyRef": {"name": "m-internal", "key": key}},
            }
        assert "PAGODA_API_KEYS_FILE" not in env  # not configured


def test_api_keys_are_mounted_into_the_router_only() -> None:
    objs = build(auth={"apiKeysSecret": {"name": "team-keys"}})
    router = template(objs, "router")["spec"]
    assert router["volumes"] == [
        {
            "name": "api-keys",
            "secret": {
                "secretName": "team-keys",
                "items": [{"key": "api-keys", "path": "keys"}],  # the CRD's default key
                "defaultMode": 0o444,
            },
        }
    ]
    # A directory mount, not subPath: the kubelet updates it in place when the Secret changes.
    assert router["containers"][0]["volumeMounts"] == [
        {"name": "api-keys", "mountPath": "/etc/pagoda/api-keys", "readOnly": True}
    ]
    assert env_of(objs, "router")["PAGODA_API_KEYS_FILE"]["value"] == "/etc/pagoda/api-keys/keys"
    assert "fsGroup" not in router["securityContext"]  # no fixed ids: readable by whatever uid runs
    for role in ("prefill", "decode"):
        assert "PAGODA_API_KEYS_FILE" not in env_of(objs, role)
        assert "team-keys" not in str(template(objs, role)), role


def test_a_pvc_model_and_api_keys_mount_side_by_side_on_the_router() -> None:
    objs = build(model={"source": "pvc://models/llama"}, auth={"apiKeysSecret": {"name": "k", "key": "f"}})
    router = template(objs, "router")["spec"]
    assert [v["name"] for v in router["volumes"]] == ["model", "api-keys"]
    assert router["volumes"][1]["secret"]["items"] == [{"key": "f", "path": "keys"}]
    assert [v["name"] for v in template(objs, "decode")["spec"]["volumes"]] == ["model"]


def test_trust_tenant_header_goes_to_the_router_only_and_kv_port_to_decode_only() -> None:
    plain, trusting = build(), build(routing={"trustTenantHeader": True})
    for role in ("prefill", "decode", "router"):
        assert "--trust-tenant-header" not in template(plain, role)["spec"]["containers"][0]["args"]
    assert "--trust-tenant-header" in template(trusting, "router")["spec"]["containers"][0]["args"]
    for role in ("prefill", "decode"):
        assert "--trust-tenant-header" not in template(trusting, role)["spec"]["containers"][0]["args"]
    for role in ("prefill", "decode", "router"):
        container = template(plain, role)["spec"]["containers"][0]
        kv = [p for p in container["ports"] if p["name"] == "kv"]
        has_flag = "--kv-port" in container["args"]
        if role == "decode":
            assert kv == [{"name": "kv", "containerPort": 9000, "protocol": "TCP"}]
            assert container["args"][container["args"].index("--kv-port") + 1] == "9000"
        else:
            assert kv == [] and not has_flag, role


def test_a_new_internal_secret_rolls_every_pod_template() -> None:
    stored = parse(admit(example("m"))["spec"])
    first = children.build(META, stored, CFG, internal_uid="uid-a")
    second = children.build(META, stored, CFG, internal_uid="uid-b")
    for role in ("prefill", "decode", "router"):
        annotations = template(first, role)["metadata"]["annotations"]
        assert annotations[children.INTERNAL_SECRET_ANNOTATION] == "uid-a"
        assert template(first, role) != template(second, role)
    assert children.INTERNAL_SECRET_ANNOTATION not in template(build(), "decode")["metadata"]["annotations"]


def test_internal_secret_values_are_fresh_random_url_safe_tokens() -> None:
    one, two = credentials.internal_secret(META), credentials.internal_secret(META)
    assert set(one["data"]) == {"internal-token", "tenant-secret"}
    values = [base64.b64decode(v).decode() for s in (one, two) for v in s["data"].values()]
    assert len(set(values)) == 4  # every value differs
    for value in values:
        assert re.fullmatch(r"[A-Za-z0-9_-]{43,}", value)  # >= 32 random bytes, url-safe
    assert one["metadata"]["ownerReferences"] == [children.owner_reference(META)]
    assert one["metadata"]["labels"] == children.labels("m", "internal")


# --- network policies: evaluated as a CNI would, on the pods the Deployments create ------------

Labels = dict[str, str]


def _selects(selector: dict, labels: Labels) -> bool:
    ok = all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        ok = (
            ok
            and {
                "In": key in labels and labels[key] in values,
                "NotIn": key not in labels or labels[key] not in values,
                "Exists": key in labels,
                "DoesNotExist": key not in labels,
            }[op]
        )
    return ok


def _peer_matches(peer: dict, src: Pod) -> bool:
    if "ipBlock" in peer:
        net = ipaddress.ip_network(peer["ipBlock"]["cidr"])
        return ipaddress.ip_address(src.ip) in net and not any(
            ipaddress.ip_address(src.ip) in ipaddress.ip_network(e) for e in peer["ipBlock"].get("except", [])
        )
    if "namespaceSelector" in peer:
        if not _selects(peer["namespaceSelector"], src.namespace_labels):
            return False
    elif src.namespace != "ns":
        return False  # a podSelector alone means: in the policy's namespace
    return _selects(peer.get("podSelector") or {}, src.labels)


class Pod:
    def __init__(self, labels: Labels, namespace: str = "ns", ns_labels: Labels | None = None) -> None:
        self.labels, self.namespace, self.ip = labels, namespace, "192.168.0.10"
        self.namespace_labels = ns_labels or {"kubernetes.io/metadata.name": namespace}


def allowed(policies: list[dict], src: Pod, dst: Pod, port: int) -> bool:
    """Kubernetes NetworkPolicy ingress semantics: unselected pods are open; selected pods admit
    the union of their policies' rules."""
    selecting = [
        p for p in policies if dst.namespace == "ns" and _selects(p["spec"]["podSelector"], dst.labels)
    ]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress") or []:
            ports = rule.get("ports")
            port_ok = ports is None or any(p["port"] == port and p["protocol"] == "TCP" for p in ports)
            peers = rule.get("from")
            if port_ok and (peers is None or any(_peer_matches(peer, src) for peer in peers)):
                return True
    return False


def pods_of(objs: dict, md: str = "m") -> dict[str, Pod]:
    """A pod of each Deployment, labelled by its template."""
    return {
        role: Pod(objs[f"Deployment/{md}-{role}"]["spec"]["template"]["metadata"]["labels"])
        for role in ("prefill", "decode", "router")
    }


PROMETHEUS = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
    "podSelector": {"matchLabels": {"app": "prometheus"}},
}


def test_network_policies_admit_only_the_peers_of_each_pool() -> None:
    objs = build()
    policies = [o for o in objs.values() if o["kind"] == "NetworkPolicy"]
    assert sorted(o["metadata"]["name"] for o in policies) == ["m-decode", "m-prefill"]
    assert all(p["spec"]["policyTypes"] == ["Ingress"] for p in policies)  # egress stays open
    pods = pods_of(objs)
    other = children.build({**META, "name": "other"}, parse(admit(example("other"))["spec"]), CFG)
    other_md = pods_of(other, "other")
    stranger = Pod({"app": "curl"})
    expect = {
        ("router", "decode", 8000): True,  # /internal/decode
        ("prefill", "decode", 9000): True,  # KV pages
        ("router", "prefill", 8000): True,  # /internal/prefill
        ("router", "decode", 9000): False,
        ("prefill", "decode", 8000): False,
        ("decode", "prefill", 8000): False,
        ("prefill", "prefill", 8000): False,
        ("decode", "decode", 9000): False,
    }
    for (src, dst, port), want in expect.items():
        assert allowed(policies, pods[src], pods[dst], port) is want, (src, dst, port)
    for dst, port in (("decode", 8000), ("decode", 9000), ("prefill", 8000)):
        assert not allowed(policies, stranger, pods[dst], port)
        assert not allowed(policies, other_md["router"], pods[dst], port)  # another deployment's router
        assert not allowed(policies, other_md["prefill"], pods[dst], port)
    # The router is not fenced: clients (and anything else) reach it.
    assert allowed(policies, stranger, pods["router"], 8000)
    prometheus = Pod({"app": "prometheus"}, namespace="monitoring")
    assert not allowed(policies, prometheus, pods["decode"], 8000)  # no metricsFrom yet


def test_metrics_peers_reach_the_http_port_of_both_pools_only() -> None:
    objs = build(networkPolicy={"metricsFrom": [PROMETHEUS]})
    policies = [o for o in objs.values() if o["kind"] == "NetworkPolicy"]
    pods = pods_of(objs)
    prometheus = Pod({"app": "prometheus"}, namespace="monitoring")
    grafana = Pod({"app": "grafana"}, namespace="monitoring")
    elsewhere = Pod({"app": "prometheus"}, namespace="team-b")
    for dst in ("prefill", "decode"):
        assert allowed(policies, prometheus, pods[dst], 8000)
        assert not allowed(policies, grafana, pods[dst], 8000)
        assert not allowed(policies, elsewhere, pods[dst], 8000)
    assert not allowed(policies, prometheus, pods["decode"], 9000)


def test_network_policies_can_be_turned_off() -> None:
    objs = build(networkPolicy={"enabled": False})
    assert not [o for o in objs.values() if o["kind"] == "NetworkPolicy"]


def test_liveness_outlasts_the_drain() -> None:
    """/health answers 503 while a server drains: the liveness probe must not kill it meanwhile."""
    container = template(build(), "decode")["spec"]["containers"][0]
    assert container["livenessProbe"]["failureThreshold"] == 6  # the default drain fits in 60 s
    long = build(decode={"drain": {"timeoutSeconds": 300, "preStopSeconds": 10}})
    probe = template(long, "decode")["spec"]["containers"][0]["livenessProbe"]
    grace = template(long, "decode")["spec"]["terminationGracePeriodSeconds"]
    assert probe["periodSeconds"] * probe["failureThreshold"] > grace >= 300 + 10
