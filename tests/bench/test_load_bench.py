"""``pagoda bench load`` on a tiny checkpoint it writes: the JSON's shape, the method's block, what
each rank holds (half at two ranks, the same bytes as the old whole-file path at one), and the PNG.
The memory bound itself is measured at full size (docs/bench/load.json), not asserted here."""

from __future__ import annotations

import json

import pytest

from pagoda.node_agent.cli.main import main

from .shape import check_environment, check_png, check_spread


@pytest.mark.slow  # 40 s on a busy 2-core machine: three rounds of fresh rank processes importing torch
def test_bench_load_reports_every_rank(tmp_path) -> None:
    out = tmp_path / "load.json"
    argv = ["bench", "load", "--size-mib", "4", "--shard-mib", "1", "--hidden", "128", "--experts", "8"]
    argv += ["--vocab", "512", "--tp", "1,2", "--json", str(out)]
    assert main(argv) == 0
    res = json.loads(out.read_text())
    check_environment(res, "load", threads=1)
    ck = res["checkpoint"]
    assert ck["files"] >= 3 and ck["experts"] == 8 and ck["stored_bytes"] > 3 * 2**20
    assert res["weights_float32_bytes"] == 2 * ck["stored_bytes"]
    rows = {(r["mode"], r["tp"]): r for r in res["rows"]}
    assert set(rows) == {("whole", 1), ("sharded", 1), ("sharded", 2)}
    for row in rows.values():
        check_spread(row, "load_s", 1)
        assert len(row["ranks"]) == row["tp"]
        for r in row["ranks"]:
            assert r["load_s"] > 0 and r["overhead_rss_bytes"] > 0
            assert r["peak_rss_bytes"] >= r["overhead_rss_bytes"]
    whole = rows["whole", 1]["ranks"][0]["held_bytes"]
    assert whole == rows["sharded", 1]["ranks"][0]["held_bytes"] == res["weights_float32_bytes"]
    for r in rows["sharded", 2]["ranks"]:  # half of it, with the replicated norms and routers
        assert 0.45 * whole < r["held_bytes"] < 0.6 * whole
    check_png(out)


@pytest.mark.slow  # fresh rank processes importing torch, like the test above
def test_bench_load_gguf_reports_every_rank(tmp_path) -> None:
    """The GGUF variant: a qwen3moe file loaded the whole way and per rank; each rank of two holds
    half of the float32 weights (the replicated norms and routers beside), one rank all of them."""
    out = tmp_path / "load.json"
    argv = ["bench", "load", "--gguf", "--size-mib", "4", "--hidden", "128", "--experts", "8"]
    argv += ["--vocab", "512", "--tp", "1,2", "--json", str(out)]
    assert main(argv) == 0
    res = json.loads(out.read_text())
    assert res["gguf"] and res["checkpoint"]["files"] == 1
    assert res["weights_float32_bytes"] == 4 * res["checkpoint"]["params"]
    rows = {(r["mode"], r["tp"]): r for r in res["rows"]}
    assert set(rows) == {("gguf-whole", 1), ("gguf-sharded", 1), ("gguf-sharded", 2)}
    whole = rows["gguf-whole", 1]["ranks"][0]["held_bytes"]
    assert whole == rows["gguf-sharded", 1]["ranks"][0]["held_bytes"] == res["weights_float32_bytes"]
    for r in rows["gguf-sharded", 2]["ranks"]:
        assert 0.45 * whole < r["held_bytes"] < 0.6 * whole
