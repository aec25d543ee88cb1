"""``bench serve``'s engine-side figures: the decode step read off a server's /metrics, the host
cost beside the clients' gaps, and the in-process ``engine`` mode its streams are compared with."""

from __future__ import annotations

import pytest

from pagoda.node_agent.bench import serve_engine
from pagoda.node_agent.bench.serve import bench_serve, workload

METRICS = """# HELP pagoda_step_timed_total Steps timed against a cost-model prediction
# TYPE pagoda_step_timed_total counter
pagoda_step_timed_total{phase="decode",pool="both"} 40.0
pagoda_step_timed_total{phase="prefill",pool="both"} 3.0
pagoda_step_actual_seconds_total{phase="decode",pool="both"} 0.6
pagoda_step_actual_seconds_total{phase="prefill",pool="both"} 9.0
pagoda_step_predicted_seconds_total{phase="decode",pool="both"} 0.5
"""


def test_step_counters_read_the_decode_pass_only() -> None:
    assert serve_engine.step_counters(METRICS) == {"steps": 40.0, "step_s": 0.6}
    assert serve_engine.step_counters("llamacpp:tokens_predicted_total 12\n") == {}
    assert serve_engine.step_counters(METRICS.replace("0.6", "n/a")) == {}  # a half-read pair is none


def test_host_cost_is_the_gap_beyond_the_mean_decode_step() -> None:
    before, after = {"steps": 40.0, "step_s": 0.6}, {"steps": 50.0, "step_s": 0.8}
    r = serve_engine.host_cost(before, after, [0.025, 0.023, 0.022])
    assert r["engine_step_s"] == pytest.approx(0.02)
    assert r["itl_mean_s"] == pytest.approx(0.0233333, rel=1e-4)
    assert r["host_cost_s"] == pytest.approx(0.0033333, rel=1e-3)
    none = serve_engine.host_cost({}, {}, [0.02])  # llama-server, a router: no engine counters
    assert none["engine_step_s"] is None and none["host_cost_s"] is None and none["itl_mean_s"] == 0.02
    assert serve_engine.host_cost(after, after, [0.02])["host_cost_s"] is None  # no step ran


def test_stream_rate_is_paired_with_the_engine_rate_per_repeat() -> None:
    rows = [
        {"mode": "single", "workload": "unique", "concurrency": 4, "itl_p50_s_runs": [0.02, 0.04]},
        {"mode": "engine", "workload": "unique", "concurrency": 4, "decode_tok_s_runs": [250.0, 100.0]},
        {"mode": "single", "workload": "unique", "concurrency": 16, "itl_p50_s_runs": [0.05, 0.05]},
    ]
    (v,) = serve_engine.stream_versus_engine(rows)  # c16 has no engine row: not compared
    assert (v["mode"], v["concurrency"], v["stream_tok_s"]) == ("single", 4, 150.0)
    assert v["stream_over_engine"]["runs"] == [pytest.approx(0.8), pytest.approx(1.0)]


def test_the_engine_mode_needs_the_engine_flags() -> None:
    with pytest.raises(ValueError, match="engine flags"):
        bench_serve("builtin://smollm2-135m", [], [1], modes=["engine"], url="http://127.0.0.1:9")


def test_the_engine_mode_steps_the_same_workloads_in_process(make_engine) -> None:
    built: list[object] = []

    def factory():
        built.append(make_engine(kv_memory=64 << 20))
        return built[-1]

    lines: list[str] = []
    res = bench_serve(
        "builtin://smollm2-135m",
        [],
        [2],
        max_tokens=3,
        modes=["engine"],
        repeats=2,
        make_engine=factory,
        log=lines.append,
    )
    assert len(built) == 1  # loaded once for every point
    assert {(r["mode"], r["workload"], r["concurrency"]) for r in res["rows"]} == {
        ("engine", "shared-prefix", 2),
        ("engine", "unique", 2),
    }
    for r in res["rows"]:
        assert len(r["decode_tok_s_runs"]) == 2 and min(r["decode_tok_s_runs"]) > 0
        assert r["decode_step_s"] > 0 and r["throughput_tok_s"] == r["decode_tok_s"]
    assert res["versus"] == [] and res["stream_versus_engine"] == []  # no server to compare
    assert workload("unique", 2, "x") != workload("unique", 2, "y")


def test_a_live_server_s_decode_steps_sit_beside_its_clients_gaps(make_engine) -> None:
    import argparse
    import asyncio

    from pagoda.node_agent.bench.serve import run_point
    from pagoda.node_agent.cli.serve import add_serve_args, build_app

    from ..serving.live import LiveServer

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin://smollm2-135m")
    ap.add_argument("--no-prefix-caching", action="store_true")
    add_serve_args(ap)
    engine = make_engine(kv_memory=24 << 20, max_num_seqs=8, itl_target_ms=0.0)  # the serve default: auto
    server = LiveServer(build_app(ap.parse_args([]), engine=engine)).start()
    try:
        asyncio.run(run_point(server.url, "smollm2-135m", workload("unique", 1, "warm-"), 1, 2))
        r = asyncio.run(run_point(server.url, "smollm2-135m", workload("unique", 2, "steps-"), 2, 6))
    finally:
        server.stop()
    assert r["errors"] == 0
    assert 0 < r["engine_step_s"] <= r["itl_p95_s"] and r["itl_mean_s"] > 0
    assert r["host_cost_s"] == pytest.approx(r["itl_mean_s"] - r["engine_step_s"])
