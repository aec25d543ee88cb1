"""``pagoda bench kv`` and ``pagoda bench weights`` run briefly: JSON shape, the method's block,
medians with spread, paired ratios, and the PNG."""

from __future__ import annotations

import json

import pytest

from pagoda.node_agent.cli.main import main

from .shape import check_environment, check_png, check_ratio, check_spread


@pytest.mark.slow
def test_bench_kv_times_pure_decode_steps(no_reload, tmp_path) -> None:
    out = tmp_path / "kv.json"
    argv = ["bench", "kv", "--dtype", "float32", "--kv-memory", "4MiB", "--concurrency", "1,8"]
    assert main([*argv, "--max-tokens", "3", "--repeats", "2", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    check_environment(res, "kv", threads=1)
    assert res["repeats"] == 2 and "pure decode steps" in res["method"]
    rows = {(r["kv"], r["concurrency"]): r for r in res["rows"]}
    assert set(rows) == {(k, c) for k in ("bf16", "fp8_e4m3", "int8") for c in (1, 8)}
    for r in rows.values():
        check_spread(r, "decode_tok_s", 2)
        assert r["decode_tok_s"] > 0 and r["window_steps"] >= 1
        assert isinstance(r["preemptions"], int) and isinstance(r["peak_running"], int)
    # fp8 and int8 hold all 8 and decode them together; bf16 cannot hold them at once
    for f in ("fp8_e4m3", "int8"):
        assert rows[f, 8]["peak_running"] == 8 and rows[f, 8]["window_mean_batch"] == 8
    assert rows["bf16", 8]["peak_running"] < 8
    for c in ("c1", "c8"):
        check_ratio(res["decode_ratio_fp8_vs_bf16"][c], 2)
        check_ratio(res["decode_ratio_int8_vs_bf16"][c], 2)
    assert res["capacity_ratio_fp8_vs_bf16"] >= 1.95 and res["capacity_ratio_int8_vs_bf16"] >= 1.93
    check_png(out)


@pytest.mark.slow
def test_bench_weights_against_true_bf16(no_reload, tmp_path) -> None:
    out = tmp_path / "weights.json"
    argv = ["bench", "weights", "--concurrency", "1", "--max-tokens", "3", "--repeats", "2"]
    argv += ["--prefill-tokens", "32", "--prefill-prompts", "1", "--kv-memory", "16MiB", "--json", str(out)]
    assert main(argv) == 0
    res = json.loads(out.read_text())
    check_environment(res, "weights", threads=1)
    assert res["dtype"]["bf16"] == "torch.bfloat16"  # dense is 2-byte bf16, not the float32 compute dtype
    rows = {(r["weights"], r["phase"]): r for r in res["rows"]}
    assert set(rows) == {(w, p) for w in ("bf16", "fp8", "int4") for p in ("decode", "prefill")}
    for r in rows.values():
        check_spread(r, "tok_s", 2)
        assert r["tok_s"] > 0 and r["dtype"].startswith("torch.")
    for point in ("decode_c1", "prefill"):
        assert set(res["speedup_vs_dense"][point]) == {"fp8", "int4"}
        for ratio in res["speedup_vs_dense"][point].values():
            check_ratio(ratio, 2)
    assert res["true_bf16_linear_bytes"] == res["linear_weight_bytes"]["bf16"]
    assert (
        res["linear_weight_bytes"]["int4"]
        < res["linear_weight_bytes"]["fp8"]
        < res["linear_weight_bytes"]["bf16"]
    )
    check_png(out)
