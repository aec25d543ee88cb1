"""An MoE model (a Hugging Face directory on a PVC) deploys like any other: the operator never loads
the model, so the spec checks pass and the workers get the directory and the phase formats."""

from __future__ import annotations

import kubernetes_validate
from op_schema import admit, example

from pagoda.operator import children
from pagoda.operator.config import Config
from pagoda.operator.spec import parse

META = {"name": "moe", "namespace": "ns", "uid": "u-2"}
CFG = Config(fp8_placement="label", fp8_node_label="example.com/gpu")


def test_hf_dir_moe_model_passes_spec_checks_and_builds_children() -> None:
    stored = admit(
        example(
            "moe",
            model={"source": "pvc://models/tiny-qwen3-moe"},
            prefill={"weightFormat": "fp8"},
            decode={"weightFormat": "int4"},
        )
    )
    objs = children.build(META, parse(stored["spec"]), CFG)
    for role, weights in (("prefill", "fp8"), ("decode", "int4")):
        pod = objs[f"Deployment/moe-{role}"]["spec"]["template"]["spec"]
        args = pod["containers"][0]["args"]
        assert args[args.index("--model") + 1] == "hf-dir:///mnt/models/tiny-qwen3-moe"
        assert args[args.index(f"--{role}-weights") + 1] == weights
        claim = [v for v in pod["volumes"] if v["name"] == "model"][0]["persistentVolumeClaim"]
        assert claim == {"claimName": "models", "readOnly": True}
    for obj in objs.values():
        kubernetes_validate.validate(obj, "1.33", strict=True)
