"""Kernel benchmark (``pagoda bench kernels``): INT4/FP8 vs dense GEMM, FP8 vs BF16 paged attention."""

from __future__ import annotations

from pathlib import Path

from pagoda.kernels.bench_kernels import run_kernel_bench
from pagoda.node_agent.bench.common import Log, echo, plot_lines


def bench_kernels(
    device: str = "auto", quick: bool = False, threads: int | None = None, log: Log = echo
) -> dict:
    """``run_kernel_bench`` on ``device`` (auto: cuda when available) with a printed table."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    res = run_kernel_bench(device, quick=quick, threads=threads)
    log(f"kernels on {res['device']} (backend {res['backend']}, {res['threads']} threads), times in us")
    log(
        f"{'N x K':<12}{'M':>5}{'dense':>10}{'int4':>10}{'fp8':>10}{'int4 x':>8}{'fp8 x':>8}"
        f"{'fp8 torch-decode':>18}{'native x':>10}"
    )
    for r in res["gemm"]:
        shape = f"{r['n']}x{r['k']}"
        log(
            f"{shape:<12}{r['m']:>5}{r['dense_us']:>10.1f}{r['int4_us']:>10.1f}"
            f"{r['fp8_us']:>10.1f}{r['int4_speedup']:>8.2f}{r['fp8_speedup']:>8.2f}"
            f"{r.get('fp8_torch_decode_us', float('nan')):>18.1f}{r.get('fp8_native_decode_speedup', float('nan')):>10.2f}"
        )
    log(f"{'attention':<12}{'batch':>5}{'bf16 KV':>10}{'fp8 KV':>10}{'fp8 x':>8}")
    for r in res["decode_attention"]:
        ctx = f"ctx {r['context']}"
        log(f"{ctx:<12}{r['batch']:>5}{r['bf16_us']:>10.1f}{r['fp8_us']:>10.1f}{r['fp8_speedup']:>8.2f}")
    return {"bench": "kernels", "quick": quick, **res}


def speedup_rows(result: dict) -> list[dict]:
    """Speedups over the dense/bf16 kernel per series and batch size (what the plot shows)."""
    rows = []
    for r in result["gemm"]:
        for fmt in ("int4", "fp8"):
            rows.append(
                {"series": f"{fmt} GEMM {r['n']}x{r['k']}", "batch": r["m"], "speedup": r[f"{fmt}_speedup"]}
            )
    for r in result["decode_attention"]:
        rows.append(
            {
                "series": f"fp8 KV attention ctx {r['context']}",
                "batch": r["batch"],
                "speedup": r["fp8_speedup"],
            }
        )
    return rows


def plot_kernels(path: Path, result: dict) -> None:
    plot_lines(
        path,
        speedup_rows(result),
        key="series",
        x="batch",
        y="speedup",
        title=f"kernel speedups ({result['device']}, {result['backend']})",
        ylabel="speedup vs dense / bf16 KV (x)",
    )
