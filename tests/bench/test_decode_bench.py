"""``pagoda bench decode`` run briefly: its JSON shape, the done-when ratios, the llama.cpp row
(measured when llama-cpp-python imports, "not installed" when it does not) and the PNG."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from pagoda.node_agent.bench.decode import LLAMACPP, TARGETS, bench_decode, llamacpp_unavailable
from pagoda.node_agent.cli.main import main
from pagoda.node_agent.engine.config import EngineConfig, PhaseFormats

from .shape import check_environment, check_png, check_ratio, check_spread

HAS_LLAMACPP = importlib.util.find_spec("llama_cpp") is not None
# dense formats: no INT4 quantization to wait for; what is checked here is the bench, not the engine
QUICK = EngineConfig(formats=PhaseFormats.reference(), kv_memory=16 << 20, dtype="float32")


@pytest.mark.slow
def test_bench_decode_command_json_and_png(no_reload, hf_shared, tmp_path) -> None:
    out = tmp_path / "decode.json"
    argv = ["bench", "decode", "--dtype", "float32", "--kv-memory", "64MiB", "--concurrency", "1,16"]
    argv += ["--max-tokens", "3", "--repeats", "2", "--threads", "1", "--json", str(out)]
    assert main(argv) == 0
    res = json.loads(out.read_text())
    check_environment(res, "decode", threads=1)
    assert res["repeats"] == 2 and res["max_tokens"] == 3 and res["formats"]["decode_weights"] == "bf16"
    rows = {(r["engine"], r["concurrency"]): r for r in res["rows"]}
    assert {("pagoda", 1), ("pagoda", 16), ("transformers", 1), ("transformers", 16), (LLAMACPP, 1)} == set(
        rows
    )
    for key in [("pagoda", 1), ("pagoda", 16), ("transformers", 1), ("transformers", 16)]:
        assert rows[key]["status"] == "ok"
        check_spread(rows[key], "decode_tok_s", 2)
        check_spread(rows[key], "ttft_s", 2)
        assert rows[key]["decode_tok_s"] > 0
    # Pagoda's window held all 16 sequences for at least max_tokens decode steps
    assert rows["pagoda", 16]["window_steps"] >= 3
    for c in ("c1", "c16"):
        check_ratio(res["ratios"]["pagoda_vs_transformers"][c], 2)
    assert set(res["targets"]) == {t[0] for t in TARGETS}
    t = res["targets"]["pagoda_c16_vs_transformers_c16"]
    assert t["target"] == 3.0 and isinstance(t["met"], bool)
    check_ratio(t, 2)
    lc = rows[LLAMACPP, 1]
    if HAS_LLAMACPP:
        assert lc["status"] == "ok" and lc["single_stream"] and lc["decode_tok_s"] > 0
        check_ratio(res["targets"]["pagoda_c16_vs_llamacpp_single_stream"], 2)
        check_ratio(res["ratios"]["pagoda_vs_llamacpp_single_stream"]["c1"], 2)
    else:
        assert lc["status"] == "not installed"
    check_png(out)


@pytest.mark.slow
@pytest.mark.skipif(
    not HAS_LLAMACPP, reason="llama-cpp-python is not installed (pip install 'pagoda[llamacpp]')"
)
def test_llamacpp_row_is_measured_on_the_same_gguf(no_reload) -> None:
    res = bench_decode(
        QUICK, [1], max_tokens=3, baselines=(LLAMACPP,), repeats=1, threads=1, log=lambda _: None
    )
    (lc,) = [r for r in res["rows"] if r["engine"] == LLAMACPP]
    assert lc["status"] == "ok" and lc["concurrency"] == 1
    assert isinstance(lc["decode_tok_s"], float) and lc["decode_tok_s"] > 0 and lc["ttft_s"] > 0
    assert res["targets"]["pagoda_c1_vs_llamacpp_single_stream"]["median"] > 0


def test_llamacpp_missing_gives_a_not_installed_row(no_reload, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as if not installed: import and find_spec fail
    res = bench_decode(
        QUICK, [1], max_tokens=2, baselines=(LLAMACPP,), repeats=1, threads=1, log=lambda _: None
    )
    (lc,) = [r for r in res["rows"] if r["engine"] == LLAMACPP]
    assert (
        lc["status"] == "not installed"
        and "pip install" in lc["install"]
        and "llama-cpp-python" in lc["install"]
    )
    assert "decode_tok_s" not in lc
    t = res["targets"]["pagoda_c1_vs_llamacpp_single_stream"]
    assert t == {"target": 0.5, "status": "not measured: llama.cpp not installed"}
    assert (
        res["targets"]["pagoda_c16_vs_transformers_c16"]["status"] == "not measured: add 16 to --concurrency"
    )


def test_llamacpp_needs_a_gguf_source(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{}")
    why = llamacpp_unavailable(f"hf-dir://{tmp_path}")
    if HAS_LLAMACPP:
        assert why["status"] == "needs a GGUF source" and str(tmp_path) in why["detail"]
    else:
        assert why["status"] == "not installed"


def test_unknown_baseline_is_refused(capsys) -> None:
    assert main(["bench", "decode", "--baselines", "vllm", "--concurrency", "1"]) == 2
    assert "unknown baseline(s) ['vllm']" in capsys.readouterr().err


def test_dense_head_baseline_compares_a_packed_head(no_reload) -> None:
    import dataclasses

    from pagoda.node_agent.bench.decode import DENSE_HEAD

    cfg = dataclasses.replace(QUICK, decode_lm_head="int8")
    res = bench_decode(
        cfg, [2], max_tokens=3, baselines=(DENSE_HEAD,), repeats=2, threads=1, log=lambda _: None
    )
    rows = {(r["engine"], r["concurrency"]): r for r in res["rows"]}
    assert set(rows) == {("pagoda", 2), (DENSE_HEAD, 2)}
    for row in rows.values():
        assert row["status"] == "ok" and row["decode_tok_s"] > 0
        check_spread(row, "decode_tok_s", 2)
    check_ratio(res["ratios"]["pagoda_vs_pagoda_dense_head"]["c2"], 2)
    with pytest.raises(ValueError, match="packed --decode-lm-head"):
        dense = dataclasses.replace(QUICK, decode_lm_head="dense")
        bench_decode(dense, [1], max_tokens=2, baselines=(DENSE_HEAD,), repeats=1, log=lambda _: None)
