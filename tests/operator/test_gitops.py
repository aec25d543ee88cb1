"""The GitOps example (kustomize base + overlay) renders through the operator, and the Argo CD
health script (Lua, run with lupa) reads real statuses written by a reconcile pass."""

from __future__ import annotations

import asyncio
import datetime as dt
import io
import shutil
import subprocess

import pytest
import yaml
from fake_kube import FakeKube
from op_schema import ROOT, admit, example

from pagoda.operator import render
from pagoda.operator.config import Config
from pagoda.operator.reconcile import reconcile

GITOPS = ROOT / "examples" / "gitops"
LUA = ROOT / "helm" / "pagoda" / "argocd" / "modeldeployment-health.lua"
NOW = dt.datetime(2026, 11, 29, 12, 0, 0, tzinfo=dt.UTC)


@pytest.mark.skipif(
    shutil.which("kubectl") is None, reason="kubectl (for `kubectl kustomize`) is not installed"
)
def test_the_production_overlay_builds_and_renders() -> None:
    built = subprocess.run(
        ["kubectl", "kustomize", str(GITOPS / "overlays" / "production")],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    (md,) = [d for d in yaml.safe_load_all(built) if d]
    assert md["metadata"]["namespace"] == "llm-prod"
    stored = admit(md)
    assert stored["spec"]["decode"]["autoscaling"]["maxReplicas"] == 16
    assert stored["spec"]["prefill"]["resources"]["requests"]["cpu"] == "4"  # merge patch kept the base keys
    out = io.StringIO()
    render.render(io.StringIO(built), None, Config(), out)
    kinds = {(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(out.getvalue()) if d}
    assert ("HorizontalPodAutoscaler", "smollm-decode") in kinds
    assert ("Deployment", "smollm-prefill") in kinds and ("Service", "smollm-decode-pods") in kinds


def test_the_base_alone_is_a_valid_modeldeployment() -> None:
    (md,) = [d for d in yaml.safe_load_all((GITOPS / "base" / "modeldeployment.yaml").read_text()) if d]
    admit(md)
    out = io.StringIO()
    render.render(io.StringIO(yaml.safe_dump(md)), "ns", Config(), out)
    assert "kind: Deployment" in out.getvalue()


def test_the_docs_carry_the_health_script() -> None:
    docs = (ROOT / "docs" / "operator.md").read_text()
    assert LUA.read_text().strip() in docs


# --- the Lua, on statuses the operator wrote ---------------------------------------------------


def _health(obj: dict) -> tuple[str, str]:
    lupa = pytest.importorskip("lupa", reason="lupa (Lua for Python) runs the Argo CD health script")
    lua = lupa.LuaRuntime(unpack_returned_tuples=True)

    def table(value: object) -> object:
        if isinstance(value, dict):
            return lua.table_from({k: table(v) for k, v in value.items()})
        if isinstance(value, list):
            return lua.table_from([table(v) for v in value])
        return value

    script = "function(obj)\n" + LUA.read_text() + "\nend"
    hs = lua.eval(script)(table(obj))
    return hs["status"], hs["message"]


def _reconciled(**spec: object) -> tuple[FakeKube, dict]:
    kube = FakeKube()
    body = admit(example("smollm", **spec))
    body["metadata"].update(uid="u", generation=1)
    kube.put(body)
    asyncio.run(reconcile(kube, body, Config(), now=NOW))  # type: ignore[arg-type]
    return kube, kube.objects[("ModelDeployment", "default", "smollm")]


def _ready(kube: FakeKube) -> None:
    for (kind, _, _), obj in kube.objects.items():
        if kind == "Deployment":
            n = obj["spec"].get("replicas", 1)
            obj["status"] = {"replicas": n, "updatedReplicas": n, "readyReplicas": n}


CPU = {"prefill": {"gpus": 0}, "decode": {"gpus": 0}}


def test_health_follows_the_conditions() -> None:
    assert _health({"metadata": {"generation": 1}})[0] == "Progressing"  # no status yet
    kube, md = _reconciled(**CPU)
    assert _health(md)[0] == "Progressing"  # pools not ready
    _ready(kube)
    asyncio.run(reconcile(kube, md, Config(), now=NOW))  # type: ignore[arg-type]
    status, message = _health(kube.objects[("ModelDeployment", "default", "smollm")])
    assert (status, message.split(":")[0]) == ("Healthy", "AllPoolsReady")
    newer = {**md, "metadata": {**md["metadata"], "generation": 2}}
    assert _health(newer)[0] == "Progressing"  # the operator has not seen generation 2

    _, paused = _reconciled(prefill={"gpus": 0, "replicas": 0}, decode={"gpus": 0, "replicas": 0})
    assert _health(paused)[0] == "Suspended"
    _, refused = _reconciled(prefill={"gpus": 0, "weightFormat": "int4"}, decode={"gpus": 0})
    status, message = _health(refused)
    assert status == "Degraded" and message.startswith("UnsupportedFormat")
