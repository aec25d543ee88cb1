"""Manifests built for one ModelDeployment: Kubernetes schemas, GPU placement, args."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import kubernetes_validate
import pytest
from op_schema import admit, example

from pagoda.operator import apply, children
from pagoda.operator.config import Config
from pagoda.operator.spec import parse

META = {"name": "m", "namespace": "ns", "uid": "u-1"}
CFG = Config(fp8_node_label="example.com/gpu", fp8_products=("H100", "H200"))


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
        },
    ],
)
def test_every_child_validates_against_its_kubernetes_schema(spec: dict) -> None:
    objs = build(**spec)
    assert {o["kind"] for o in objs.values()} == {
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "Deployment",
        "Service",
    }
    for obj in objs.values():
        kubernetes_validate.validate(obj, "1.33", strict=True)


def test_gpu_pools_request_gpus_and_fp8_pools_get_node_affinity() -> None:
    objs = build(
        prefill={"weightFormat": "bf16", "kvCacheFormat": "bf16"}, decode={"gpus": 2, "tensorParallel": 2}
    )
    prefill = objs["Deployment/m-prefill"]["spec"]["template"]["spec"]
    decode = objs["Deployment/m-decode"]["spec"]["template"]["spec"]
    assert decode["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert prefill["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    term = decode["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert term == [
        {"matchExpressions": [{"key": "example.com/gpu", "operator": "In", "values": ["H100", "H200"]}]}
    ]
    assert "affinity" not in prefill  # bf16/bf16 runs on any GPU


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
    """Nothing is mounted but a PVC model: the agents read their settings from args and env only."""
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
        "fp8",
        "--prefill-kv",
        "bf16",
        "--decode-weights",
        "int4",
        "--decode-kv",
        "fp8_e4m3",
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
        "--no-session-affinity",
    ]


def template(objs: dict, role: str) -> dict:
    return objs[f"Deployment/m-{role}"]["spec"]["template"]


def test_a_change_the_agents_see_changes_every_pod_template() -> None:
    before = build()
    after = build(integrity={"mode": "audit"})
    for role in ("prefill", "decode", "router"):
        assert template(before, role) != template(after, role), role
        args = template(after, role)["spec"]["containers"][0]["args"]
        assert args[args.index("--integrity") + 1] == "audit"
    assert template(before, "decode")["metadata"]["annotations"] == {
        children.HANDOFF_ANNOTATION: "bf16->fp8_e4m3"
    }


def test_operator_only_settings_and_scaling_leave_the_pod_templates_alone() -> None:
    """The integrity window and threshold only feed the operator's status; replicas only the
    Deployment's scale. Neither may roll the pods."""
    before = build()
    after = build(integrity={"windowSeconds": 60, "mismatchRateThreshold": 0.01}, decode={"replicas": 3})
    for role in ("prefill", "decode", "router"):
        assert template(before, role) == template(after, role), role
    assert after["Deployment/m-decode"]["spec"]["replicas"] == 3


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch, as the API server applies the operator's patches."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


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
