"""Integrity benchmark (``pagoda bench integrity``): decode throughput and p95 inter-token latency
with the KV tag check on (``enforce``) and off, interleaved in one run on one engine (same weights,
same pool).

Each repetition runs the same workload once per mode, in alternating order (ABBA), switching only
the engine's integrity tracker. Rows report the median over repetitions with min/max spread and
``overhead_pct`` per concurrency. The check's own time per decode step is measured directly too
(``check_share_pct``), which is far less noisy than end-to-end ratios on a busy machine.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path

from pagoda.node_agent.bench.common import Log, echo, plot_lines, random_token_prompts, set_threads
from pagoda.node_agent.engine.config import EngineConfig
from pagoda.node_agent.engine.integrity import make_tracker

MODES = ("enforce", "off")


def p95(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.95 * len(xs)))] if xs else 0.0


def run_once(engine, prompts: list[list[int]], max_tokens: int) -> dict:
    """Run prompts to completion. Decode figures count only tokens after every stream's first."""
    from pagoda.node_agent.engine.sequence import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    tracker = engine.integrity
    check = tracker.check
    spent = [0.0, 0]

    def timed(seqs, pool):
        t = time.perf_counter()
        out = check(seqs, pool)
        spent[0] += time.perf_counter() - t
        spent[1] += 1
        return out

    tracker.check = timed
    first: dict[str, float] = {}
    events: list[tuple[str, float]] = []
    try:
        while engine.has_unfinished():
            outs = engine.step()
            now = time.perf_counter()
            for o in outs:
                first.setdefault(o.request_id, now)
                events.append((o.request_id, now))
    finally:
        del tracker.check
    start = max(first[i] for i in ids)
    last = dict(first)
    gaps: list[float] = []
    stamps = []
    for rid, t in events:
        if t > start:
            gaps.append(t - last[rid])
            stamps.append(t)
        last[rid] = t
    dur = max(stamps) - start if stamps else 0.0
    return {
        "decode_tok_s": len(stamps) / dur if dur > 0 else 0.0,
        "itl_p95_s": p95(gaps),
        "check_s_per_step": spent[0] / spent[1] if spent[1] else 0.0,
        "step_s": dur / len({t for t in stamps}) if stamps else 0.0,
    }


def bench_integrity(
    cfg: EngineConfig,
    concurrency: list[int],
    input_len: int = 512,
    output_len: int = 32,
    repeats: int = 3,
    threads: int | None = None,
    log: Log = echo,
) -> dict:
    """enforce vs off at each concurrency on one engine (prefix caching off); the JSON-ready result."""
    import torch

    from pagoda.node_agent.engine.llm_engine import LLMEngine

    set_threads(threads)
    cfg = dataclasses.replace(cfg, enable_prefix_caching=False)  # every repetition recomputes the prompts
    engine = LLMEngine(cfg)
    trackers = {m: make_tracker(m, cfg.kernel_backend) for m in MODES}
    vocab = engine.model_config.vocab_size
    rows: list[dict] = []
    log(f"{'mode':<9}{'conc':>5}{'decode tok/s':>14}{'spread':>18}{'p95 ITL s':>11}{'overhead %':>12}")
    for c in concurrency:
        prompts = random_token_prompts(c, input_len, vocab, seed=c)
        runs: dict[str, list[dict]] = {m: [] for m in MODES}
        engine.integrity = trackers["off"]
        run_once(engine, prompts[:1], 2)  # warm-up
        for r in range(repeats):
            order = MODES if r % 2 == 0 else MODES[::-1]
            for m in order:
                engine.integrity = trackers[m]
                runs[m].append(run_once(engine, prompts, output_len))
        med = {m: {k: statistics.median(x[k] for x in runs[m]) for k in runs[m][0]} for m in MODES}
        off = med["off"]
        for m in MODES:
            tps = [x["decode_tok_s"] for x in runs[m]]
            row = {
                "mode": m,
                "concurrency": c,
                "decode_tok_s": med[m]["decode_tok_s"],
                "decode_tok_s_min": min(tps),
                "decode_tok_s_max": max(tps),
                "itl_p95_s": med[m]["itl_p95_s"],
                "check_s_per_step": med[m]["check_s_per_step"],
                "check_share_pct": 100 * med[m]["check_s_per_step"] / med[m]["step_s"]
                if med[m]["step_s"]
                else 0.0,
                "overhead_pct": 100 * (off["decode_tok_s"] - med[m]["decode_tok_s"]) / off["decode_tok_s"],
                "itl_p95_overhead_pct": 100 * (med[m]["itl_p95_s"] - off["itl_p95_s"]) / off["itl_p95_s"],
            }
            rows.append(row)
            log(
                f"{m:<9}{c:>5}{row['decode_tok_s']:>14.1f}{f'{min(tps):.1f}-{max(tps):.1f}':>18}"
                f"{row['itl_p95_s']:>11.4f}{row['overhead_pct']:>12.2f}"
                f"  check {1e3 * row['check_s_per_step']:.3f} ms/step ({row['check_share_pct']:.3f}%)"
            )
    return {
        "bench": "integrity",
        "model": cfg.model,
        "dtype": str(engine.dtype),
        "formats": cfg.formats.as_dict(),
        "input_len": input_len,
        "output_len": output_len,
        "repeats": repeats,
        "torch_threads": torch.get_num_threads(),
        "note": "median over repetitions, enforce/off interleaved ABBA on one engine; "
        "overhead_pct = throughput lost vs off; check_share_pct = measured check time / decode step",
        "rows": rows,
    }


def plot_integrity(path: Path, result: dict) -> None:
    plot_lines(
        path,
        result["rows"],
        key="mode",
        x="concurrency",
        y="decode_tok_s",
        title=f"decode with integrity enforce vs off ({result['input_len']} in / {result['output_len']} out)",
        ylabel="aggregate decode tokens/s",
    )
