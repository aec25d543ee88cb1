"""End to end on a kind cluster: build images, install the chart, apply the example, wait for Ready,
scale decode without restarting any pod, and stop a pod gracefully (out of the endpoints first).

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
    assert "DECODE FORMATS" in columns and "int4/int8" in columns
    scale_restarts_nothing(context)
    a_deleted_pod_drains(context)


def pods(context: str) -> dict[str, dict]:
    out = run(
        "kubectl",
        "--context",
        context,
        "get",
        "pods",
        "-l",
        "pagoda.dev/model-deployment=smollm",
        "-o",
        "json",
    )
    return {p["metadata"]["name"]: p for p in json.loads(out)["items"]}


def wait_ready(context: str, pool: str, n: int, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready = [
            p
            for p in pods(context).values()
            if p["metadata"]["labels"].get("pagoda.dev/pool") == pool
            and not p["metadata"].get("deletionTimestamp")
            and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))
        ]
        if len(ready) == n:
            return
        time.sleep(3)
    raise AssertionError(f"{pool} did not reach {n} ready pods")


def scale_restarts_nothing(context: str) -> None:
    """Scaling decode adds a pod and restarts none: same pod uids, same restart counts."""
    before = {
        name: (p["metadata"]["uid"], p["status"]["containerStatuses"][0]["restartCount"])
        for name, p in pods(context).items()
    }
    run(
        "kubectl",
        "--context",
        context,
        "patch",
        "md",
        "smollm",
        "--type",
        "merge",
        "-p",
        '{"spec":{"decode":{"replicas":2}}}',
    )
    wait_ready(context, "decode", 2)
    after = pods(context)
    for name, (uid, restarts) in before.items():
        assert name in after, f"{name} was replaced by the scale"
        assert after[name]["metadata"]["uid"] == uid
        assert after[name]["status"]["containerStatuses"][0]["restartCount"] == restarts


def a_deleted_pod_drains(context: str) -> None:
    """A deleted decode pod leaves the headless Service's endpoints while it still runs (preStop),
    then exits within its grace period, and the Deployment replaces it."""
    victim = next(
        n for n, p in pods(context).items() if p["metadata"]["labels"]["pagoda.dev/pool"] == "decode"
    )
    grace = pods(context)[victim]["spec"]["terminationGracePeriodSeconds"]
    ip = pods(context)[victim]["status"]["podIP"]
    run("kubectl", "--context", context, "delete", "pod", victim, "--wait=false")
    seen_out_of_endpoints = False
    deadline = time.monotonic() + grace + 60
    while time.monotonic() < deadline:
        live = pods(context).get(victim)
        if live is None:
            break
        slices = json.loads(
            run(
                "kubectl",
                "--context",
                context,
                "get",
                "endpointslices",
                "-o",
                "json",
                "-l",
                "kubernetes.io/service-name=smollm-decode-pods",
            )  # fmt: skip
        )["items"]
        ready_ips = {
            a
            for sl in slices
            for e in sl.get("endpoints") or []
            if (e.get("conditions") or {}).get("ready")
            for a in e["addresses"]
        }
        seen_out_of_endpoints |= ip not in ready_ips
        time.sleep(1)
    assert pods(context).get(victim) is None, "the pod did not exit within its grace period"
    assert seen_out_of_endpoints, "the terminating pod stayed in the per-pod DNS endpoints"
    wait_ready(context, "decode", 2)
