"""``--tensor-parallel`` on the commands: ``bench decode`` measures the replica beside the same engine
on one rank (JSON shape, PNG), ``eval`` scores formats on a replica, the benches that hold several
engines refuse it, and a replica over two "hosts" (LeaderWorkerSet environment, both on this
machine) serves the same tokens as one rank while the worker host answers /health and leaves when
the leader stops."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from openai import OpenAI

from pagoda.node_agent.cli.main import main
from pagoda.node_agent.serving.launch import wait_ready

from ..bench.shape import check_environment, check_png, check_ratio, check_spread
from ..serving.live import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_bench_decode_with_tensor_parallel_2(tmp_path) -> None:
    out = tmp_path / "tp.json"
    argv = ["bench", "decode", "--tensor-parallel", "2", "--kv-memory", "32MiB", "--concurrency", "2"]
    argv += ["--max-tokens", "3", "--repeats", "2", "--threads", "2", "--json", str(out)]
    assert main(argv) == 0
    res = json.loads(out.read_text())
    check_environment(res, "decode", threads=2)
    assert res["tensor_parallel"] == 2 and res["threads_per_rank"] == 1
    rows = {(r["engine"], r["concurrency"]): r for r in res["rows"]}
    assert set(rows) == {("pagoda", 2), ("pagoda-tp1", 2)}
    for row in rows.values():
        assert row["status"] == "ok" and row["decode_tok_s"] > 0
        check_spread(row, "decode_tok_s", 2)
    check_ratio(res["ratios"]["pagoda_vs_pagoda_tp1"]["c2"], 2)
    check_png(out)


def test_eval_scores_formats_on_a_replica(tmp_path) -> None:
    out = tmp_path / "eval.json"
    argv = ["eval", "--tensor-parallel", "2", "--formats", "int4/fp8_e4m3", "--baseline", "none"]
    argv += ["--num-prompts", "1", "--max-new-tokens", "4", "--max-text-tokens", "48", "--json", str(out)]
    assert main(argv) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert 0 <= row["mean_kl"] < 0.1 and row["top1"] > 0.8  # INT4 exact + FP8 KV, as on one rank


@pytest.mark.parametrize("bench", ["kv", "weights"])
def test_benches_holding_several_engines_refuse_tensor_parallel(bench, capsys) -> None:
    assert main(["bench", bench, "--tensor-parallel", "2"]) == 2
    assert "holds one tensor-parallel replica" in capsys.readouterr().err


def test_a_replica_over_two_hosts_from_leaderworkerset_env(tmp_path) -> None:
    http, dist_port = free_port(), free_port()
    common = [sys.executable, "-P", "-m", "pagoda.node_agent.cli.main", "serve", "--tenant-secret", "s",
              "--kv-memory", "32MiB", "--max-num-seqs", "4", "--tensor-parallel", "2", "--nodes", "2",
              "--dist-port", str(dist_port), "--dist-timeout", "20"]  # fmt: skip
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "LWS_LEADER_ADDRESS": "127.0.0.1"}
    env.pop("RANK", None)
    worker_port = free_port()
    worker_log = tmp_path / "worker.log"
    worker = subprocess.Popen(
        [*common, "--port", str(worker_port)],
        env={**env, "LWS_WORKER_INDEX": "1"},
        stdout=worker_log.open("w"),
        stderr=subprocess.STDOUT,
    )
    leader = subprocess.Popen(
        [*common, "--port", str(http)], env={**env, "LWS_WORKER_INDEX": "0"}, stdout=subprocess.DEVNULL
    )
    try:
        url = f"http://127.0.0.1:{http}"
        wait_ready(url, [leader, worker], timeout=240)
        assert httpx.get(f"http://127.0.0.1:{worker_port}/health", timeout=5).status_code == 200
        client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        out = client.completions.create(
            model="smollm2-135m", prompt="The capital of France is", max_tokens=8, temperature=0
        )
        assert out.choices[0].text.startswith(" Paris")
        leader.send_signal(signal.SIGTERM)
        assert leader.wait(timeout=60) == 0
        assert worker.wait(timeout=60) == 0  # told to stop by rank 0, not lost
        assert "tensor-parallel rank 1 following rank 0" in worker_log.read_text()
    finally:
        for p in (leader, worker):
            if p.poll() is None:
                p.kill()
                p.wait()
        time.sleep(0.1)
