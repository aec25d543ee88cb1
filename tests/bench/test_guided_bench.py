"""``pagoda bench guided`` run briefly: both modes hold the batch over the timed window, the
constrained one masks every row of every window step, and the JSON has the method's block and
spread."""

from __future__ import annotations

import json

import pytest

from pagoda.node_agent.cli.main import main

from .shape import check_environment, check_png, check_spread


@pytest.mark.slow
def test_bench_guided_times_the_masks_inside_the_step(no_reload, tmp_path) -> None:
    out = tmp_path / "guided.json"
    argv = ["bench", "guided", "--dtype", "float32", "--kv-memory", "32MiB", "--concurrency", "1,2"]
    argv += ["--input-len", "8", "--output-len", "2", "--repeats", "2", "--threads", "1", "--json", str(out)]
    assert main(argv) == 0
    res = json.loads(out.read_text())
    check_environment(res, "guided", threads=1)
    assert res["repeats"] == 2 and res["schema"]["type"] == "object"
    rows = {(r["mode"], r["concurrency"]): r for r in res["rows"]}
    assert set(rows) == {(m, c) for m in ("json_schema", "off") for c in (1, 2)}
    for (mode, _), r in rows.items():
        for key in ("step_s", "mask_s_per_step", "decode_tok_s"):
            check_spread(r, key, 2)
        assert r["window_steps"] >= 2
        if mode == "json_schema":
            assert 0 < r["mask_s_per_step"] < r["step_s"] and 0 < r["mask_share_pct"] < 100
        else:
            assert r["mask_s_per_step"] == 0 and r["overhead_pct"] == 0
    check_png(out)
