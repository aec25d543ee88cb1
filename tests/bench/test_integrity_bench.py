"""``pagoda bench integrity`` run briefly: the batch is held at the stated concurrency over the
timed window, the check's host and device time are reported apart, and the JSON has the method's
block and spread."""

from __future__ import annotations

import json

import pytest

from pagoda.node_agent.cli.main import main

from .shape import check_environment, check_png, check_spread


@pytest.mark.slow
def test_bench_integrity_holds_the_batch_and_splits_the_check(no_reload, tmp_path) -> None:
    out = tmp_path / "integrity.json"
    argv = ["bench", "integrity", "--dtype", "float32", "--kv-memory", "64MiB", "--concurrency", "1,4"]
    argv += ["--input-len", "40", "--output-len", "3", "--repeats", "2", "--threads", "1", "--json", str(out)]
    assert main(argv) == 0
    res = json.loads(out.read_text())
    check_environment(res, "integrity", threads=1)
    assert res["formats"]["decode_weights"] == "bf16" and res["repeats"] == 2
    rows = {(r["mode"], r["concurrency"]): r for r in res["rows"]}
    assert set(rows) == {(m, c) for m in ("enforce", "off") for c in (1, 4)}
    for (mode, _), r in rows.items():
        for key in ("decode_tok_s", "itl_p95_s", "check_host_s_per_step", "check_device_s_per_step"):
            check_spread(r, key, 2)
        assert r["window_steps"] >= 3  # all sequences decoded together for the timed steps
        assert r["kernel_observed"]
        if mode == "enforce":
            assert r["check_device_s_per_step"] > 0 and r["check_host_s_per_step"] > 0
            assert r["check_s_per_step"] == pytest.approx(
                r["check_host_s_per_step"] + r["check_device_s_per_step"]
            )
            assert 0 < r["check_share_pct"] < 100
        else:
            assert r["check_device_s_per_step"] == 0 and r["overhead_pct"] == 0
    check_png(out)
