"""Smoke tests for the kernel benchmark helpers (shapes and keys only, never timings)."""

import json

import torch

from pagoda.kernels.bench_kernels import kv_bytes_per_token, kv_scale_granularity_report, run_kernel_bench


def test_run_kernel_bench_quick_cpu():
    before = torch.get_num_threads()
    res = run_kernel_bench("cpu", quick=True, threads=1)
    assert res["threads"] == 1 and torch.get_num_threads() == before
    assert res["backend"] == "cpu"
    assert [(r["m"], r["n"], r["k"]) for r in res["gemm"]] == [(1, 64, 128), (8, 64, 128)]
    for r in res["gemm"]:
        assert r["dense_us"] > 0 and r["int4_us"] > 0 and r["fp8_us"] > 0
    (attn,) = res["decode_attention"]
    assert attn["fp8_kv_bytes"] * 2 == attn["bf16_kv_bytes"]
    assert attn["bf16_us"] > 0 and attn["fp8_us"] > 0


def test_kv_scale_granularity_report_orders_sensibly():
    gen = torch.Generator().manual_seed(0)
    # Heads with very different magnitudes and a few outlier tokens.
    mag = torch.tensor([0.002, 1.0, 30.0])[None, :, None]
    calib = torch.randn(64, 3, 16, generator=gen) * mag
    ev = torch.randn(80, 3, 16, generator=gen) * mag
    rep = kv_scale_granularity_report(calib, ev)
    assert rep["per_token"] <= rep["per_page"] <= rep["per_tensor"]
    # e4m3's exponent range hides moderate head-to-head differences; at 15000x the small head
    # falls into subnormals under one per-tensor scale (measured 0.026 per-head vs 0.040).
    assert rep["static_head"] < 0.75 * rep["per_tensor"]
    ev[5] *= 20  # an outlier token beyond the calibrated range is clipped; headroom absorbs it
    clipped = kv_scale_granularity_report(calib, ev)
    assert clipped["static_head_clipped"] > 0
    assert kv_scale_granularity_report(calib, ev, headroom=40)["static_head_clipped"] == 0


def test_kv_bytes_per_token_capacity_ratio():
    # SmolLM2: 3 KV heads x 64. bf16 stores 2 * 3 * 64 * 2 bytes per token.
    bf16 = 2 * 3 * 64 * 2
    assert bf16 / kv_bytes_per_token(3, 64, "static_head") == 2.0
    assert bf16 / kv_bytes_per_token(3, 64, "per_page") > 1.95
    assert bf16 / kv_bytes_per_token(3, 64, "per_token") < 1.95


def test_bench_kernels_command(tmp_path):
    from pagoda.node_agent.cli.main import main

    out = tmp_path / "kernels.json"
    assert main(["bench", "kernels", "--device", "cpu", "--quick", "--threads", "1", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["bench"] == "kernels" and res["device"] == "cpu" and res["threads"] == 1
    # the method's block; the threads the kernels ran with are kept (torch's own count is restored after)
    assert res["command"] == f"pagoda bench kernels --device cpu --quick --threads 1 --json {out}"
    assert res["machine"]["logical_cores"] >= 1 and res["versions"]["torch"] == torch.__version__
    assert [(r["m"], r["n"], r["k"]) for r in res["gemm"]] == [(1, 64, 128), (8, 64, 128)]
    assert out.with_suffix(".png").stat().st_size > 0
