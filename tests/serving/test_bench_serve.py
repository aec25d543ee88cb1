"""``pagoda bench serve``'s client side against the live server (the CLI also starts servers)."""

from __future__ import annotations

import asyncio
import json

import pytest

from pagoda.node_agent.bench.serve import percentile, run_point, workload
from pagoda.node_agent.cli.engine_args import engine_argv, engine_config_from_args
from pagoda.node_agent.cli.main import build_parser, main

from .conftest import MODEL

pytestmark = [pytest.mark.serve, pytest.mark.timeout(300)]


def test_bench_point_measures_latency_and_prefix_hits(stack) -> None:
    prompts = workload("shared-prefix", 4, "bench-test-")
    asyncio.run(run_point(stack.url, MODEL, prompts[:1], 1, 2))
    r = asyncio.run(run_point(stack.url, MODEL, prompts, 2, 4))
    assert r["requests"] == 4 and r["errors"] == 0
    assert r["throughput_tok_s"] > 0 and 0 < r["ttft_p50_s"] <= r["ttft_p95_s"]
    assert 0 < r["itl_p50_s"] <= r["itl_p95_s"]
    assert r["prefix_hit_rate"] > 0.3  # the shared preamble is served from the cache
    # this stack's engine runs without the time budget, so it reports no step times: none are made up
    assert r["engine_step_s"] is None and r["host_cost_s"] is None and r["itl_mean_s"] > 0


def test_percentile_and_cli_flags() -> None:
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0 and percentile([], 0.9) == 0.0
    a = build_parser().parse_args(["bench", "serve", "--concurrency", "1,4", "--modes", "single"])
    assert a.concurrency == [1, 4] and a.modes == ["single"]
    s = build_parser().parse_args(["serve", "--role", "router", "--decode-endpoints", "http://d:8000"])
    assert (s.host, s.port, s.role, s.tenant_header) == ("127.0.0.1", 8000, "router", "X-Pagoda-Tenant")


def test_started_servers_get_the_engine_flags() -> None:
    flags = ["--dtype", "float32", "--kv-memory", "16MiB", "--decode-kv", "fp8_e4m3", "--no-prefix-caching"]
    a = build_parser().parse_args(["bench", "serve", *flags])
    s = build_parser().parse_args(["serve", *engine_argv(a)])
    assert engine_config_from_args(s) == engine_config_from_args(a)


def test_bench_serve_command_against_a_running_server(stack, tmp_path) -> None:
    from ..bench.shape import check_png, check_spread

    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--url", stack.url, "--concurrency", "2", "--num-requests", "2"]
    assert main([*argv, "--max-tokens", "3", "--repeats", "2", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert (
        res["bench"] == "serve"
        and res["repeats"] == 2
        and res["command"].startswith("pagoda bench serve --concurrency 2")
    )
    assert res["machine"]["logical_cores"] >= 1 and res["threads"] is None and res["versions"]["torch"]
    assert {(r["mode"], r["workload"], r["concurrency"]) for r in res["rows"]} == {
        ("external", "shared-prefix", 2),
        ("external", "unique", 2),
    }
    for r in res["rows"]:
        assert r["requests"] == 4 and r["errors"] == 0
        for key in ("throughput_tok_s", "ttft_p50_s", "itl_p95_s", "prefix_hit_rate"):
            check_spread(r, key, 2)
    check_png(out)
