"""``pagoda bench ...``: benchmarks that write JSON and a PNG plot, ratios against a same-run baseline."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

BENCH_PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator works to a ten year old.",
    "List five ideas for a weekend trip in the mountains and explain each one.",
    "Describe the water cycle in detail, step by step.",
    "What are the main differences between a violin and a cello?",
    "Give me a recipe for a simple vegetable soup and explain each step.",
    "Why is the sky blue? Answer with a careful physical explanation.",
    "Summarize the plot of a detective novel you would like to write.",
]


def bench_prompts(n: int, salt: str = "") -> list[str]:
    """n distinct prompts (a numbered variant of the base set, so no two share a prefix page)."""
    return [f"[{salt}{i}] {BENCH_PROMPTS[i % len(BENCH_PROMPTS)]}" for i in range(n)]


def parse_int_list(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError("concurrency values must be positive integers")
    return vals


def run_pagoda_decode(engine, prompts: list[str], max_tokens: int) -> dict:
    """Submit all prompts at once; TTFT per request and decode tok/s once every stream is running."""
    from pagoda.node_agent.engine.sequence import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    first: dict[str, float] = {}
    stamps: list[float] = []
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.request_id not in first:
                first[o.request_id] = now
            else:
                stamps.append(now)
    t_all_first = max(first[i] for i in ids)
    end = max(stamps) if stamps else t_all_first
    after = sum(1 for s in stamps if s > t_all_first)
    ttft = sorted(first[i] - t0 for i in ids)
    return {
        "decode_tok_s": after / (end - t_all_first) if end > t_all_first else 0.0,
        "ttft_s": ttft[len(ttft) // 2],
        "total_s": end - t0,
    }


def run_hf_decode(model, tok, prompts: list[str], max_tokens: int) -> dict:
    """transformers ``generate`` on the same prompts as one padded batch (greedy, same dtype)."""
    import torch

    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    enc = tok(prompts, return_tensors="pt", padding=True)
    kw = dict(do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=None)
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(**enc, max_new_tokens=1, min_new_tokens=1, **kw)
        t1 = time.perf_counter()
        model.generate(**enc, max_new_tokens=max_tokens, min_new_tokens=max_tokens, **kw)
        t2 = time.perf_counter()
    ttft = t1 - t0
    decode_time = (t2 - t1) - ttft
    return {"decode_tok_s": len(prompts) * (max_tokens - 1) / decode_time, "ttft_s": ttft, "total_s": t2 - t1}


def load_hf_reference(model_source: str, dtype):
    """transformers model + tokenizer on the same weights (GGUF or HF directory)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from pagoda.node_agent.models.loader import resolve_source

    hf_logging.set_verbosity_error()
    kind, path = resolve_source(model_source)
    if kind == "gguf":
        kw = {"gguf_file": path.name}
        path = path.parent
    else:
        kw = {}
    tok = AutoTokenizer.from_pretrained(str(path), **kw)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, **kw).eval()
    return model, tok


def cmd_bench_decode(a: argparse.Namespace) -> int:
    from pagoda.node_agent.cli.main import engine_config_from_args
    from pagoda.node_agent.engine.llm_engine import LLMEngine

    cfg = engine_config_from_args(a)
    engine = LLMEngine(cfg)
    rows = []
    print(f"{'engine':<14}{'conc':>6}{'decode tok/s':>14}{'TTFT s':>10}")
    for c in a.concurrency:
        prompts = bench_prompts(c, salt=f"c{c}-")
        r = run_pagoda_decode(engine, prompts, a.max_tokens)
        rows.append({"engine": "pagoda", "concurrency": c, **r})
        print(f"{'pagoda':<14}{c:>6}{r['decode_tok_s']:>14.1f}{r['ttft_s']:>10.3f}", flush=True)
    if not a.no_baseline:
        model, tok = load_hf_reference(cfg.model, engine.dtype)
        for c in a.concurrency:
            r = run_hf_decode(model, tok, bench_prompts(c, salt=f"c{c}-"), a.max_tokens)
            rows.append({"engine": "transformers", "concurrency": c, **r})
            print(f"{'transformers':<14}{c:>6}{r['decode_tok_s']:>14.1f}{r['ttft_s']:>10.3f}", flush=True)
    ratios = {}
    for c in a.concurrency:
        p = [r for r in rows if r["engine"] == "pagoda" and r["concurrency"] == c]
        h = [r for r in rows if r["engine"] == "transformers" and r["concurrency"] == c]
        if p and h:
            ratios[str(c)] = p[0]["decode_tok_s"] / h[0]["decode_tok_s"]
    if ratios:
        print(
            "pagoda/transformers decode throughput: "
            + ", ".join(f"c{c}: {v:.2f}x" for c, v in ratios.items())
        )
    result = {
        "bench": "decode",
        "model": cfg.model,
        "dtype": str(engine.dtype),
        "max_tokens": a.max_tokens,
        "formats": cfg.formats.as_dict(),
        "rows": rows,
        "speedup_vs_transformers": ratios,
    }
    write_result(
        a.json,
        result,
        lambda path: plot_lines(
            path,
            rows,
            key="engine",
            x="concurrency",
            y="decode_tok_s",
            title=f"decode throughput ({cfg.model}, {engine.dtype})",
            ylabel="aggregate decode tokens/s",
        ),
    )
    return 0


def write_result(json_path: str | None, result: dict, plot: Callable[[Path], None]) -> None:
    if not json_path:
        return
    path = Path(json_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    png = path.with_suffix(".png")
    plot(png)
    print(f"wrote {path} and {png}")


def plot_lines(path: Path, rows: list[dict], key: str, x: str, y: str, title: str, ylabel: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name in dict.fromkeys(r[key] for r in rows):
        pts = sorted((r[x], r[y]) for r in rows if r[key] == name)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=str(name))
    ax.set_xscale("log", base=2)
    ax.set_xlabel(x)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_bench_parser(sub, add_engine_args: Callable[[argparse.ArgumentParser], None]) -> None:
    b = sub.add_parser("bench", help="benchmarks (JSON + PNG)")
    bs = b.add_subparsers(dest="bench", required=True)
    d = bs.add_parser("decode", help="aggregate decode tok/s and TTFT vs transformers generate")
    add_engine_args(d)
    d.add_argument("--concurrency", type=parse_int_list, default=[1, 8, 16, 32, 64])
    d.add_argument("--max-tokens", type=int, default=64)
    d.add_argument("--json", default=None, help="write results here (and a PNG beside it)")
    d.add_argument("--no-baseline", action="store_true", help="skip the transformers baseline")
    d.set_defaults(func=cmd_bench_decode)
    from pagoda.node_agent.bench.integrity import add_integrity_bench_parser

    add_integrity_bench_parser(bs, add_engine_args)
    from pagoda.node_agent.bench.formats import add_format_bench_parsers

    add_format_bench_parsers(bs, add_engine_args)
