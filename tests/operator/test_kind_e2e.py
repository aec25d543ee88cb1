"""End to end on a kind cluster: build images, install the chart, apply the example, wait for Ready.

Runs only where a Docker engine, kind, kubectl and helm are available; skipped (with the
missing piece named) elsewhere.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import uuid

import pytest
from op_schema import CHART, ROOT


def _missing() -> str | None:
    for tool in ("docker", "kind", "kubectl", "helm"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    probe = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        return "no Docker engine reachable (docker info failed)"
    return None


MISSING = _missing()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(MISSING is not None, reason=f"kind e2e needs Docker and kind: {MISSING}"),
]


def run(*cmd: str, timeout: float = 900) -> str:
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def kind_cluster():
    name = f"pagoda-e2e-{uuid.uuid4().hex[:6]}"
    run("kind", "create", "cluster", "--name", name, "--wait", "120s")
    try:
        yield name
    finally:
        subprocess.run(["kind", "delete", "cluster", "--name", name], capture_output=True, timeout=300)


def test_chart_install_and_example_becomes_ready(kind_cluster: str) -> None:
    context = f"kind-{kind_cluster}"
    for dockerfile, tag, extra in (
        ("docker/operator.Dockerfile", "pagoda/operator:0.1.0", []),
        (
            "docker/node-agent.Dockerfile",
            "pagoda/node-agent:0.1.0",
            [
                "--build-arg",
                "BASE=python:3.11-slim",
                "--build-arg",
                "TORCH_INDEX=https://download.pytorch.org/whl/cpu",
            ],
        ),
    ):
        run("docker", "build", "-f", dockerfile, "-t", tag, *extra, ".", timeout=3600)
        run("kind", "load", "docker-image", tag, "--name", kind_cluster)
    run(
        "helm", "install", "pagoda", str(CHART), "--kube-context", context,
        "--namespace", "pagoda-system", "--create-namespace", "--wait", "--timeout", "5m",
    )  # fmt: skip
    run("kubectl", "--context", context, "apply", "-f", str(CHART / "examples" / "cpu-trial.yaml"))
    deadline = time.monotonic() + 900
    status = ""
    while time.monotonic() < deadline:
        out = run("kubectl", "--context", context, "get", "md", "smollm", "-o", "json")
        conditions = json.loads(out).get("status", {}).get("conditions", [])
        status = next((c["status"] for c in conditions if c["type"] == "Ready"), "")
        if status == "True":
            break
        time.sleep(5)
    assert status == "True", run("kubectl", "--context", context, "describe", "md", "smollm")
    columns = run("kubectl", "--context", context, "get", "md")
    assert "DECODE FORMATS" in columns and "int4/fp8_e4m3" in columns
