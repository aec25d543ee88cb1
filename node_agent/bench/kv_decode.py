"""``pagoda bench kv --decode-heavy``: the KV-bound scenario. Short prompts, long outputs, and a KV
budget in which a 1-byte format holds every stream of the top concurrency at its full length while
bf16 holds about half of them (a true 2-byte bf16: on a float32-compute CPU the bf16 engine gets the
pages a 2-byte pool holds, as in ``bench kv``).

Unlike ``bench kv`` (pure decode steps only), the whole run is timed: admission queueing, the
decode steps, the preemptions and the recompute they cause. Per format and concurrency it reports
aggregate output tok/s (all output tokens over the run's wall time), preemptions, recomputed
prompt tokens, the mean decode batch, and queueing (time from submission to the first token,
median and max).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pagoda.node_agent.bench.common import (
    Log,
    Variant,
    echo,
    engine_factory,
    environment,
    plot_lines,
    run_interleaved,
    set_threads,
    summarize,
)
from pagoda.node_agent.bench.formats import (
    ONE_BYTE_KV,
    TRUE_BF16,
    kv_capacity,
    one_byte_kv_ratios,
    ratio_keys,
    refuse_parallel,
    sized_prompts,
)
from pagoda.node_agent.bench.stepping import run_steps
from pagoda.node_agent.engine.config import EngineConfig, PhaseFormats
from pagoda.node_agent.engine.kv_setup import kv_components
from pagoda.node_agent.kv.pool import KVPagePool
from pagoda.vocabulary import KV_CACHE_FORMATS

FIGURES = ("output_tok_s", "total_s", "preemptions", "recompute_tokens", "mean_decode_batch")


def decode_heavy_budget(mc, streams: int, seq_tokens: int, page_size: int, granularity: str) -> int:
    """KV bytes in which each 1-byte format holds ``streams`` sequences of ``seq_tokens`` tokens (and
    the 1% admission watermark), no more than needed: bf16 then holds about half of them."""
    pages = -(-seq_tokens // page_size) * streams
    pages = int(pages * 1.02) + 2
    per_page = 0
    for f in ONE_BYTE_KV:
        per_page = max(per_page, kv_capacity(mc, 1 << 30, page_size, f, granularity)["bytes_per_page"])
    return int(pages * per_page) + 1


def run_decode_heavy(engine, prompts: list[list[int]], max_tokens: int) -> dict:
    """Submit every prompt at once and step to the end; the whole run is the measurement."""
    trace = run_steps(engine, prompts, max_tokens)
    decode_steps = [s for s in trace.steps if s.decode_tokens]
    out_tokens = len(prompts) * max_tokens
    ttft = sorted(trace.ttft_s)
    return {
        "output_tok_s": out_tokens / trace.total_s if trace.total_s > 0 else 0.0,
        "total_s": trace.total_s,
        "preemptions": sum(s.preemptions for s in trace.steps),
        "recompute_tokens": sum(s.prefill_tokens for s in trace.steps) - sum(len(p) for p in prompts),
        "mean_decode_batch": sum(s.decode_tokens for s in decode_steps) / max(1, len(decode_steps)),
        "queue_p50_s": ttft[len(ttft) // 2] if ttft else 0.0,
        "queue_max_s": ttft[-1] if ttft else 0.0,
    }


def _engines(make, mc, budget: int, cfg: EngineConfig, dtype, cmax: int) -> tuple[dict, dict]:
    """One engine per KV format on one pool of ``budget`` bytes (bf16 as a true 2-byte type)."""
    ps = cfg.page_size
    caps = {f: kv_capacity(mc, budget, ps, f, cfg.kv_scale_granularity) for f in KV_CACHE_FORMATS}
    engines = {}
    for f in KV_CACHE_FORMATS:
        per_page = KVPagePool.bytes_per_page(mc.num_layers, ps, kv_components(mc), dtype)
        mem = budget if (f != "bf16" or dtype == TRUE_BF16) else caps[f]["pages"] * per_page
        engines[f] = make(formats=PhaseFormats("bf16", f, "bf16", f), kv_memory=mem, max_num_seqs=cmax)
    return engines, caps


def bench_kv_decode_heavy(
    cfg: EngineConfig,
    concurrency: list[int],
    prompt_tokens: int = 16,
    max_tokens: int = 128,
    threads: int | None = 1,
    log: Log = echo,
    repeats: int = 2,
) -> dict:
    """bf16 vs fp8_e4m3 vs int8 KV, decode-heavy and KV-bound at the top concurrency; the JSON-ready
    result (``cfg.kv_memory`` overrides the budget sized from the workload)."""
    set_threads(threads)
    refuse_parallel(cfg)
    make = engine_factory(dataclasses.replace(cfg, enable_prefix_caching=False))
    probe = make(formats=PhaseFormats.reference(), kv_memory=1 << 20)
    mc, dtype, cmax = probe.model_config, probe.dtype, max(concurrency)
    seq_tokens = prompt_tokens + max_tokens
    budget = cfg.kv_memory or decode_heavy_budget(
        mc, cmax, seq_tokens, cfg.page_size, cfg.kv_scale_granularity
    )
    del probe
    engines, caps = _engines(make, mc, budget, cfg, dtype, cmax)
    held = {f: engines[f].decode_pool.num_pages // -(-seq_tokens // cfg.page_size) for f in engines}
    log(f"KV budget {budget / 2**20:.2f} MiB; {prompt_tokens}-token prompts + {max_tokens} new tokens")
    log("  full-length sequences held: " + ", ".join(f"{f} {n}" for f, n in held.items()))
    variants = []
    for c in concurrency:
        for f in KV_CACHE_FORMATS:

            def run(r: int, f: str = f, c: int = c) -> dict:
                prompts = sized_prompts(engines[f], c, prompt_tokens, salt=f"kvd{c}-r{r}-")
                return run_decode_heavy(engines[f], prompts, max_tokens)

            variants.append(Variant(f"{f} c{c}", run, warm=lambda f=f: run_decode_heavy(
                engines[f], sized_prompts(engines[f], 2, prompt_tokens, "kvd-warm-"), 4)))  # fmt: skip
    runs = run_interleaved(variants, repeats, log)
    rows = []
    log(
        f"{'kv':<10}{'conc':>6}{'out tok/s':>11}{'preempt':>9}{'recompute':>11}{'batch':>7}{'queue p50/max s':>17}"
    )
    for c in concurrency:
        for f in KV_CACHE_FORMATS:
            rs = runs[f"{f} c{c}"]
            r = {"kv": f, "concurrency": c, **summarize(rs, FIGURES)}
            r.update(summarize(rs, ("queue_p50_s", "queue_max_s")))
            rows.append(r)
            log(
                f"{f:<10}{c:>6}{r['output_tok_s']:>11.1f}{r['preemptions']:>9.0f}{r['recompute_tokens']:>11.0f}"
                f"{r['mean_decode_batch']:>7.1f}{r['queue_p50_s']:>9.2f} / {r['queue_max_s']:.2f}"
            )
    ratios = one_byte_kv_ratios(runs, concurrency, "output_tok_s")
    return {
        "bench": "kv-decode-heavy",
        **environment(),
        "model": cfg.model,
        "dtype": str(dtype),
        "repeats": repeats,
        "method": "whole runs timed (queueing, preemption and recompute included); all prompts submitted "
        "at once; warm-up, then repeats interleaved bf16/fp8/int8 per concurrency; median, min, max; "
        "ratios paired per repeat",
        "kv_budget_bytes": budget,
        "page_size": cfg.page_size,
        "prompt_tokens": prompt_tokens,
        "max_tokens": max_tokens,
        "capacity_tokens": {f: caps[f]["tokens"] for f in KV_CACHE_FORMATS},
        "full_length_sequences_held": held,
        "rows": rows,
        **ratio_keys("output", ratios),
    }


def plot_kv_decode_heavy(path: Path, result: dict) -> None:
    plot_lines(
        path,
        result["rows"],
        key="kv",
        x="concurrency",
        y="output_tok_s",
        title=f"decode-heavy, KV-bound: output tok/s ({result['kv_budget_bytes'] / 2**20:.1f} MiB KV)",
        ylabel="aggregate output tokens/s (whole run)",
    )
