"""``pagoda-operator render``: the operator's objects for a spec, without a cluster or torch."""

from __future__ import annotations

import io
import pathlib
import subprocess
import sys

import kubernetes_validate
import pytest
import yaml
from op_schema import CHART, ROOT, admit, example

from pagoda.operator import children, render
from pagoda.operator.config import Config
from pagoda.operator.spec import parse

AUTO = {"minReplicas": 2, "maxReplicas": 8, "targets": {"kvCacheUsage": 0.8, "ttftSeconds": 1.5}}


def rendered(body: dict, namespace: str | None = None, cfg: Config | None = None) -> list[dict]:
    out = io.StringIO()
    render.render(io.StringIO(yaml.safe_dump(body)), namespace, cfg or Config(), out)
    return [d for d in yaml.safe_load_all(out.getvalue()) if d]


def by_key(objs: list[dict]) -> dict[str, dict]:
    return {f"{o['kind']}/{o['metadata']['name']}": o for o in objs}


def test_render_runs_as_a_command_without_torch_or_the_engine(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "md.yaml"
    path.write_text(yaml.safe_dump(example("smollm", decode={"autoscaling": AUTO})))
    script = (
        "import sys\n"
        "from pagoda.operator.main import main\n"
        "try:\n"
        f"    main(['render', '-f', {str(path)!r}, '--namespace', 'team'])\n"
        "except SystemExit as e:\n"
        "    code = e.code\n"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('pagoda.node_agent', 'pagoda.kernels'))]\n"
        "print('IMPORTED', bad, file=sys.stderr)\n"
        "sys.exit(code)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "IMPORTED []" in done.stderr
    objs = by_key([d for d in yaml.safe_load_all(done.stdout) if d])
    assert {o["metadata"]["namespace"] for o in objs.values()} == {"team"}
    # The same code path as a reconciliation pass: exactly what children.build makes.
    spec = parse(admit(example("smollm", decode={"autoscaling": AUTO}))["spec"])
    owner = {"name": "smollm", "namespace": "team", "uid": render.RENDER_UID}
    assert objs == children.build(owner, spec, Config())


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ({"decode": {"weightFormat": "int3"}}, "spec.decode.weightFormat: 'int3' is not one of"),
        ({"model": {}}, "spec.model.source: required"),
        ({"decode": {"replicaz": 2}}, "spec.decode.replicaz: unknown field"),
        ({"prefill": {"weightFormat": "int4"}}, "UnsupportedFormat: prefill.weightFormat int4"),
        (
            {"prefill": {"kvCacheFormat": "fp8_e4m3"}, "decode": {"kvCacheFormat": "bf16"}},
            "is invalid: spec: prefill KV pages in a 1-byte format",  # the CRD's CEL rule, as admission
        ),
        ({"decode": {"autoscaling": {"maxReplicas": 2, "targets": {}}}}, "needs at least 1 field"),
    ],
)
def test_an_invalid_spec_exits_2_with_the_reason(tmp_path: pathlib.Path, spec: dict, why: str) -> None:
    body = example("bad")
    body["spec"].update(spec)
    path = tmp_path / "md.yaml"
    path.write_text(yaml.safe_dump(body))
    with pytest.raises(render.RenderError, match=why.replace("(", r"\(")):
        rendered(body)
    assert render.main(["-f", str(path)]) == 2


def test_not_a_modeldeployment_exits_2(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "x.yaml"
    path.write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n")
    assert render.main(["-f", str(path)]) == 2
    assert "not a pagoda.dev/v1alpha1 ModelDeployment" in capsys.readouterr().err
    assert render.main(["-f", str(tmp_path / "missing.yaml")]) == 2


def test_a_decode_scale_renders_byte_identical_templates() -> None:
    one = by_key(rendered(example("m", decode={"replicas": 1})))
    two = by_key(rendered(example("m", decode={"replicas": 5})))
    for role in ("prefill", "decode", "router"):
        assert yaml.safe_dump(one[f"Deployment/m-{role}"]["spec"]["template"]) == yaml.safe_dump(
            two[f"Deployment/m-{role}"]["spec"]["template"]
        )
    assert two["Deployment/m-decode"]["spec"]["replicas"] == 5


def test_render_shows_autoscaler_budgets_and_headless_services_all_schema_valid() -> None:
    objs = by_key(
        rendered(example("m", decode={"autoscaling": AUTO}, router={"disruptionBudget": {"enabled": False}}))
    )
    assert "replicas" not in objs["Deployment/m-decode"]["spec"]  # the HPA's
    hpa = objs["HorizontalPodAutoscaler/m-decode"]["spec"]
    assert hpa["scaleTargetRef"]["name"] == "m-decode" and (hpa["minReplicas"], hpa["maxReplicas"]) == (2, 8)
    assert [m["pods"]["target"]["averageValue"] for m in hpa["metrics"]] == ["800m", "1500m"]
    assert {k for k in objs if k.startswith("PodDisruptionBudget/")} == {
        "PodDisruptionBudget/m-prefill",
        "PodDisruptionBudget/m-decode",
    }
    for pool in ("prefill", "decode"):
        svc = objs[f"Service/m-{pool}-pods"]["spec"]
        generation = {"pagoda.dev/formats": children.formats_generation(parse(admit(example("m"))["spec"]))}
        assert svc["clusterIP"] == "None" and svc["selector"] == {
            **children.selector("m", pool),
            **generation,
        }
        assert objs[f"Service/m-{pool}"]["spec"]["type"] == "ClusterIP"  # kept for other users
    for obj in objs.values():
        kubernetes_validate.validate(obj, "1.33", strict=True)


def test_keda_mode_renders_a_scaled_object() -> None:
    cfg = Config(autoscaler="keda", prometheus_address="http://prom:9090")
    objs = by_key(rendered(example("m", decode={"autoscaling": AUTO}), "ns", cfg))
    assert "HorizontalPodAutoscaler/m-decode" not in objs
    so = objs["ScaledObject/m-decode"]["spec"]
    assert so["scaleTargetRef"]["name"] == "m-decode" and (so["minReplicaCount"], so["maxReplicaCount"]) == (
        2,
        8,
    )
    kv, ttft = so["triggers"]
    assert kv["metricType"] == "Value" and kv["metadata"]["threshold"] == "0.8"
    assert 'namespace="ns",pagoda_dev_model_deployment="m",pool="decode"' in kv["metadata"]["query"]
    assert kv["metadata"]["ignoreNullValues"] == "false"
    assert ttft["metadata"]["query"].startswith("histogram_quantile(0.9,")


def test_the_chart_examples_render() -> None:
    for path in (CHART / "examples").glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            assert rendered(doc), path


@pytest.mark.parametrize(
    ("pools", "weights", "fp8_prefill"),
    [
        ({}, ("auto", "auto"), True),  # the CRD defaults; auto prefill is placed as fp8
        ({"prefill": {"weightFormat": "bf16"}, "decode": {"weightFormat": "int4"}}, ("bf16", "int4"), False),
        (
            {"prefill": {"weightFormat": "stored"}, "decode": {"weightFormat": "stored"}},
            ("stored", "stored"),
            False,
        ),
    ],
)
def test_render_passes_the_weight_formats_to_both_engines(
    pools: dict, weights: tuple[str, str], fp8_prefill: bool
) -> None:
    gpu = {"gpus": 1, "kvCacheFormat": "bf16"}
    spec = {p: {**gpu, **pools.get(p, {})} for p in ("prefill", "decode")}
    objs = by_key(rendered(example("m", **spec), "ns"))
    for role in ("prefill", "decode"):
        pod = objs[f"Deployment/m-{role}"]["spec"]["template"]["spec"]
        args = pod["containers"][0]["args"]
        assert (
            args[args.index("--prefill-weights") + 1],
            args[args.index("--decode-weights") + 1],
        ) == weights
        assert ("affinity" in pod) == (fp8_prefill and role == "prefill")
