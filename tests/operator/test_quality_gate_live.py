"""The quality gate against real engines: the kopf operator on the kmock cluster, the serving and
the new pair's score endpoints three real ``pagoda serve`` processes on the built-in model.

- the reference (the serving pair): the default formats (INT4 decode weights, int8 decode KV);
- an honest new pair: FP8 e4m3 decode KV pages instead (KL about 0.005 on the built-in set);
- the same change with the corruption drill (``--fault-corrupt-layer``): one layer's output
  projections scaled at load.

The honest change passes and shifts; the drilled one is held with ``QualityGateFailed`` and its KL
while the old pair serves. A gate whose proofs the engines refuse (another token) cannot finish:
it times out and stalls without shifting. The servers start once for the module: about 30-60 s on 2 cores.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import subprocess
from collections.abc import Iterator

import pytest
from op_cluster import CM_PATH, SECRET_PATH, Cluster
from test_operator_kmock import GENERATION, MD, NEW_GENERATION, NS, condition, selects
from test_quality_gate_kmock import gate_of, reasons, serving_then_change, still_on_the_old_pair

from pagoda.node_agent.serving import launch
from pagoda.operator import children, credentials, quality_gate
from pagoda.operator.config import Config
from pagoda.quality_probe import ScoreResponse

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TOKEN = "quality-gate-live-test-token-0123456789abcdef"
ENGINE = ["--model", "builtin://smollm2-135m", "--kv-memory", "24MiB", "--max-model-len", "512"]
SERVERS = {
    "reference": [],
    "honest": ["--decode-kv", "fp8_e4m3"],
    "drilled": ["--decode-kv", "fp8_e4m3", "--enable-fault-injection", "--fault-corrupt-layer", "10",
                "--fault-corrupt-scale", "2.0"],
}  # fmt: skip
PROBES = {
    "texts": ["The lighthouse keeper climbed the spiral stairs at dusk, trimmed the wick, wound the "
              "clockwork that turned the lens, and wrote the weather into the log before the first "
              "ship rounded the point."],
    "prompts": ["Name three things a lighthouse keeper did every night.", "What is a fog signal?"],
    "max_new_tokens": 12,
}  # fmt: skip


@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> Iterator[dict[str, str]]:
    """The three engines, started together (each loads the model) and stopped after the module."""
    token_file = tmp_path_factory.mktemp("gate") / "token"
    token_file.write_text(TOKEN)
    procs: dict[str, subprocess.Popen] = {}
    urls: dict[str, str] = {}
    try:
        for name, flags in SERVERS.items():
            port = launch.free_port()
            argv = ["serve", "--port", str(port), *ENGINE, "--internal-token-file", str(token_file), *flags]
            procs[name] = subprocess.Popen(launch.agent_command(*argv), stdout=subprocess.DEVNULL)
            urls[name] = f"http://127.0.0.1:{port}"
        for name, url in urls.items():
            launch.wait_ready(url, [procs[name]], timeout=300)
        yield urls
    finally:
        launch.stop(list(procs.values()), timeout=20)


@pytest.fixture
def operator_config(operator_config: Config) -> Config:
    """The kmock tests' short timers; a real engine's score takes seconds, so a long request limit."""
    return dataclasses.replace(operator_config, quality_request_s=120.0, quality_retry_s=1.0)


def gate_against(
    cluster: Cluster,
    monkeypatch,
    servers: dict[str, str],
    candidate: str,
    token: str = TOKEN,
    timeout_s: int = 300,
) -> None:
    """The engines' token as the ModelDeployment's internal Secret (the operator keeps an existing
    one), the probe set as a ConfigMap, and the gate pointed at the reference and ``candidate``."""
    data = {k: base64.b64encode((token if k == children.INTERNAL_TOKEN_KEY else "t" * 43).encode()).decode()
            for k in credentials.KEYS}  # fmt: skip
    secret = {"metadata": {"name": "smollm-internal", "namespace": NS}, "type": "Opaque", "data": data}
    cluster.create(SECRET_PATH.format(ns=NS), secret)
    cm = {"metadata": {"name": "probes", "namespace": NS}, "data": {"probes.json": json.dumps(PROBES)}}
    cluster.create(CM_PATH.format(ns=NS), cm)
    urls = {"reference": servers["reference"], "candidate": servers[candidate]}

    async def resolve(kube, cfg, target):
        return urls[target.role]

    monkeypatch.setattr(quality_gate, "resolve_url", resolve)
    serving_then_change(cluster, timeout_s=timeout_s, probe_set="probes")


def test_an_honest_change_passes_against_real_engines_and_shifts(
    cluster: Cluster, servers, monkeypatch
) -> None:
    gate_against(cluster, monkeypatch, servers, "honest")
    cluster.wait_for(lambda: selects(cluster, "decode") == NEW_GENERATION, timeout=240, what="decode shifted")
    cluster.wait_for(
        lambda: selects(cluster, "prefill") == NEW_GENERATION, timeout=60, what="prefill shifted"
    )
    gate = gate_of(cluster)
    assert gate["phase"] == "Passed" and gate["reference"] == GENERATION
    assert 0 <= gate["meanKL"] < 0.02 and gate["top1"] >= 0.9, gate
    assert "QualityGatePassed" in reasons(cluster)
    # the recorded reference is the serving engine's own answer: its formats and the probe set's tokens
    cm = cluster.get(f"{CM_PATH.format(ns=NS)}/smollm-quality-reference")
    ref = ScoreResponse.from_json(json.loads(cm["data"]["reference.json"]))
    assert ref.formats["decode_kv"] == "int8" and len(ref.greedy) == len(PROBES["prompts"])


def test_the_drilled_change_is_held_with_its_kl_while_the_old_pair_serves(
    cluster: Cluster, servers, monkeypatch
) -> None:
    gate_against(cluster, monkeypatch, servers, "drilled")
    md = cluster.wait_for(
        lambda: (m := cluster.get(MD)) and condition(m, "Degraded")["reason"] == "QualityGateFailed" and m,
        timeout=240,
        what="QualityGateFailed",
    )
    gate = md["status"]["quality"]["gate"]
    assert gate["phase"] == "Failed" and gate["meanKL"] > 0.02, gate
    assert "mean KL" in condition(md, "Degraded")["message"]
    still_on_the_old_pair(cluster)
    assert cluster.get(f"{CM_PATH.format(ns=NS)}/smollm-quality-reference") is None


def test_a_gate_the_engines_refuse_times_out_and_stalls(cluster: Cluster, servers, monkeypatch) -> None:
    gate_against(cluster, monkeypatch, servers, "honest", token="another-token-" + "x" * 32, timeout_s=10)
    md = cluster.wait_for(
        lambda: (m := cluster.get(MD)) and condition(m, "Degraded")["reason"] == "QualityGateTimeout" and m,
        timeout=60,
        what="QualityGateTimeout",
    )
    gate = md["status"]["quality"]["gate"]
    assert gate["phase"] == "TimedOut" and "403" in gate.get("lastError", ""), gate
    still_on_the_old_pair(cluster)
