"""Manifests built for one ModelDeployment: Kubernetes schemas, GPU placement, args."""

from __future__ import annotations

import kubernetes_validate
import pytest
from op_schema import admit, example

from pagoda.operator import children
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
        "ConfigMap",
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


def test_a_config_change_changes_the_pod_template() -> None:
    before = build()["Deployment/m-decode"]["spec"]["template"]["metadata"]["annotations"]
    after = build(integrity={"windowSeconds": 60})["Deployment/m-decode"]["spec"]["template"]["metadata"][
        "annotations"
    ]
    assert before[children.CONFIG_HASH_ANNOTATION] != after[children.CONFIG_HASH_ANNOTATION]
    assert before[children.HANDOFF_ANNOTATION] == "bf16->fp8_e4m3"
