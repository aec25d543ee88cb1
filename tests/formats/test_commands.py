"""`pagoda eval`, `pagoda bench kv` and `pagoda bench weights` end to end on tiny settings, over the
session's already loaded weights (the loader and tokenizer are patched to hand them out)."""

from __future__ import annotations

import json

import pytest

from pagoda.node_agent.cli.main import main


@pytest.fixture
def no_reload(monkeypatch, builtin_loaded, builtin_tokenizer):
    import pagoda.node_agent.models.loader as loader
    import pagoda.node_agent.models.tokenizer as tokenizer

    monkeypatch.setattr(loader, "load_model", lambda source: builtin_loaded)
    monkeypatch.setattr(tokenizer, "Tokenizer", lambda *a, **k: builtin_tokenizer)


@pytest.mark.slow
def test_eval_command(no_reload, tmp_path, capsys) -> None:
    out = tmp_path / "eval.json"
    argv = [
        "eval",
        "--formats",
        "bf16/fp8",
        "--max-new-tokens",
        "3",
        "--num-prompts",
        "2",
        "--max-text-tokens",
        "48",
        "--kv-memory",
        "16MiB",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    res = json.loads(out.read_text())
    (row,) = res["rows"]
    assert row["formats"] == "bf16/fp8" and row["phase_formats"]["decode_kv"] == "fp8_e4m3"
    assert res["text_tokens"] == 48
    assert {"int4_gemm", "decode_layers"} <= set(res["kernels"]["ops"])  # the kernel table it ran with
    # top-1 over 48 tokens: 0.85+ on the AMD EPYCs of earlier runs, 0.79 (38 of 48, KL 0.0056) on a Xeon with
    # avx512_bf16/fp16 (not oneDNN's ISA: capping it changed nothing; cause not found)
    assert 0 < row["mean_kl"] < 0.05 and 0.75 <= row["top1"] <= 1.0
    assert out.with_suffix(".png").stat().st_size > 0
    assert "bf16/fp8" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_kv_command(no_reload, tmp_path) -> None:
    out = tmp_path / "kv.json"
    argv = ["bench", "kv", "--kv-memory", "4MiB", "--concurrency", "1,8", "--max-tokens", "3"]
    assert main([*argv, "--dtype", "float32", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    cap = res["capacity_tokens"]
    assert cap["fp8_e4m3"] >= 1.95 * cap["bf16"] and cap["int8"] >= 1.93 * cap["bf16"]
    rows = {(r["kv"], r["concurrency"]): r for r in res["rows"]}
    assert set(rows) == {(k, c) for k in ("bf16", "fp8_e4m3", "int8") for c in (1, 8)}
    # sized so that bf16 cannot hold all 8 sequences at once while fp8 and int8 can
    assert rows["fp8_e4m3", 8]["peak_running"] == rows["int8", 8]["peak_running"] == 8
    assert rows["bf16", 8]["peak_running"] < 8 or rows["bf16", 8]["preemptions"] > 0
    assert all(r["decode_tok_s"] > 0 for r in res["rows"])


@pytest.mark.slow
def test_bench_weights_command(no_reload, tmp_path) -> None:
    out = tmp_path / "w.json"
    argv = ["bench", "weights", "--concurrency", "1", "--max-tokens", "3", "--repeats", "1"]
    argv += ["--prefill-tokens", "32", "--prefill-prompts", "1", "--kv-memory", "16MiB", "--json", str(out)]
    assert main(argv) == 0
    res = json.loads(out.read_text())
    assert {(r["weights"], r["phase"]) for r in res["rows"]} == {
        (w, p) for w in ("bf16", "fp8", "int4") for p in ("decode", "prefill")
    }
    lin = res["linear_weight_bytes"]
    assert lin["int4"] < lin["fp8"] < lin["bf16"]
    # The built-in GGUF's Q4_1 blocks are kept exactly: 16 bytes of nibbles plus a 2-byte scale and
    # a 2-byte offset per 32 weights is 5 bits a weight, 5/16 of bf16 (N padded to 16 for the kernel)
    assert res["int4_linear_ratio_vs_true_bf16"] <= 5 / 16 + 0.002
