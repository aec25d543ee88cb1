"""Format benchmarks (``pagoda bench kv`` and ``pagoda bench weights``): what the per-phase formats
buy, measured.

bench kv: for one KV byte budget, the exact capacity (pages, tokens, sequences) of a bf16 and an
fp8_e4m3 pool, and aggregate decode tok/s at several concurrencies with prompts sized so that bf16
runs out of pages at the top concurrency while fp8 still holds every sequence.

bench weights: decode tok/s (several concurrencies) and prefill tok/s for bf16, fp8 and int4
weights, plus resident weight bytes; ratios against dense are measured in the same run.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path

import torch

from pagoda.node_agent.bench.common import Log, bench_prompts, echo, engine_factory, plot_lines, set_threads
from pagoda.node_agent.bench.decode import run_pagoda_decode
from pagoda.node_agent.engine.config import EngineConfig, PhaseFormats
from pagoda.node_agent.engine.kv_pool import KVPagePool
from pagoda.node_agent.engine.kv_setup import kv_components
from pagoda.node_agent.engine.sequence import SamplingParams
from pagoda.vocabulary import KV_CACHE_FORMATS, WEIGHT_FORMATS

DEFAULT_KV_BUDGET = 64 << 20
TRUE_BF16 = torch.bfloat16
FILLER = (
    " The tide came in slowly over the flat grey sand, filling the channels one by one while the "
    "gulls waited on the posts of the old pier for the fishing boats to return before nightfall."
)


def kv_capacity(cfg, budget: int, page_size: int, kv_format: str) -> dict:
    """Exact capacity of a KV pool of ``budget`` bytes (tags and FP8 scales included), with bf16 as
    a true 2-byte type whatever the compute dtype. Per-layer figures follow ``kv_components(cfg)``
    (K and V per KV head, or whatever components the model's attention stores, e.g. an MLA latent)."""
    dt = TRUE_BF16 if kv_format == "bf16" else torch.float8_e4m3fn
    comps = kv_components(cfg)
    pages = KVPagePool.pages_for_budget(budget, cfg.num_layers, page_size, comps, dt)
    per_page = KVPagePool.bytes_per_page(cfg.num_layers, page_size, comps, dt)
    elem = torch.empty((), dtype=dt).element_size()
    per_comp = {name: int(torch.Size(shape).numel()) * elem for name, shape in comps.items()}
    return {
        "pages": pages,
        "tokens": pages * page_size,
        "bytes_per_page": per_page,
        "bytes_per_token": per_page / page_size,
        "bytes_per_token_per_layer": sum(per_comp.values()),
        "component_bytes_per_token_per_layer": per_comp,
    }


def model_config_of(source: str):
    """The model's config without its weights (a Hugging Face directory's config.json; a GGUF loads)."""
    import json

    from pagoda.node_agent.models.config import config_from_hf
    from pagoda.node_agent.models.loader import load_model, resolve_source

    kind, path = resolve_source(source)
    if kind == "hf-dir" and (path / "config.json").exists():
        return config_from_hf(json.loads((path / "config.json").read_text()))
    return load_model(source).config


def bench_kv_capacity(cfg: EngineConfig, log: Log = echo) -> dict:
    """``bench kv --capacity-only``: bf16 vs fp8_e4m3 per-token bytes and capacity under the budget
    (default 64 MiB) from the model's config alone: no weights loaded, no decode run."""
    mc = model_config_of(cfg.model)
    budget, ps = cfg.kv_memory or DEFAULT_KV_BUDGET, cfg.page_size
    max_len = min(cfg.max_model_len or mc.max_position, mc.max_position)
    caps = {f: kv_capacity(mc, budget, ps, f) for f in KV_CACHE_FORMATS}
    comps = ", ".join(f"{n} {tuple(s)}" for n, s in kv_components(mc).items())
    log(
        f"KV budget {budget / 2**20:.1f} MiB, page {ps} tokens; per token and layer: {comps} x {mc.num_layers} layers"
    )
    for f in KV_CACHE_FORMATS:
        c = caps[f]
        c["max_len_sequences"] = c["tokens"] // max_len
        log(
            f"  {f:<9} {c['bytes_per_token_per_layer']:>6} B/token/layer {c['bytes_per_token']:>9.1f} B/token "
            f"{c['pages']:>8} pages {c['tokens']:>9} tokens  {c['max_len_sequences']} x {max_len}-token sequences"
        )
    return {
        "bench": "kv",
        "mode": "capacity",
        "model": cfg.model,
        "kv_budget_bytes": budget,
        "page_size": ps,
        "max_model_len": max_len,
        "num_layers": mc.num_layers,
        "kv_components": {n: list(s) for n, s in kv_components(mc).items()},
        "bytes_per_token_per_layer": {f: caps[f]["bytes_per_token_per_layer"] for f in KV_CACHE_FORMATS},
        "capacity_tokens": {f: caps[f]["tokens"] for f in KV_CACHE_FORMATS},
        "capacity": caps,
        "capacity_ratio_fp8_vs_bf16": caps["fp8_e4m3"]["tokens"] / max(1, caps["bf16"]["tokens"]),
    }


def sized_prompts(engine, n: int, tokens: int, salt: str) -> list[list[int]]:
    """n distinct prompts of exactly ``tokens`` token ids (a bench prompt padded with filler)."""
    filler = engine.tokenize(FILLER * 8)
    out = []
    for p in bench_prompts(n, salt=salt):
        ids = engine.tokenize(p)[:tokens]
        out.append((ids + filler * (1 + tokens // len(filler)))[:tokens])
    return out


def run_queued_decode(engine, prompts: list[list[int]], max_tokens: int) -> dict:
    """Submit all prompts at once and step to the end (queueing and preemption included).
    decode_tok_s = tokens after each request's first / time from the first token to the end."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    pre0 = engine.scheduler.num_preemptions
    t0 = time.perf_counter()
    for p in prompts:
        engine.add_request(p, params)
    first_at: float | None = None
    peak = 0
    while engine.has_unfinished():
        outs = engine.step()
        peak = max(peak, sum(1 for s in engine.scheduler.running if not s.needs_prefill))
        if outs and first_at is None:
            first_at = time.perf_counter()
    end = time.perf_counter()
    decode_tokens = len(prompts) * (max_tokens - 1)
    span = end - (first_at or t0)
    return {
        "decode_tok_s": decode_tokens / span if span > 0 else 0.0,
        "total_s": end - t0,
        "preemptions": engine.scheduler.num_preemptions - pre0,
        "peak_running": peak,
    }


# ---------------------------------------------------------------- bench kv


def bench_kv(
    cfg: EngineConfig,
    concurrency: list[int],
    max_tokens: int = 24,
    pages_per_seq: int | None = None,
    threads: int | None = 1,
    log: Log = echo,
) -> dict:
    """bf16 vs fp8_e4m3 KV under the budget ``cfg.kv_memory`` (default 64 MiB); the JSON-ready result.

    ``pages_per_seq`` defaults to filling 85% of the fp8 pool at the top concurrency."""
    set_threads(threads)
    make = engine_factory(dataclasses.replace(cfg, enable_prefix_caching=False))
    budget = cfg.kv_memory or DEFAULT_KV_BUDGET
    probe = make(formats=PhaseFormats.reference(), kv_memory=1 << 20)
    mc, ps = probe.model_config, cfg.page_size
    caps = {f: kv_capacity(mc, budget, ps, f) for f in KV_CACHE_FORMATS}
    # the design default: a bf16 prefill pool (prefill_kv_fraction of the budget) + an fp8 decode pool
    frac = EngineConfig().prefill_kv_fraction
    split_decode = kv_capacity(mc, budget - int(budget * frac), ps, "fp8_e4m3")
    cmax = max(concurrency)
    pages_per_seq = pages_per_seq or max(1, int(0.85 * caps["fp8_e4m3"]["pages"] / cmax))
    seq_tokens = pages_per_seq * ps
    max_tokens = min(max_tokens, seq_tokens // 2)
    prompt_tokens = seq_tokens - max_tokens
    for f in KV_CACHE_FORMATS:
        caps[f]["max_seqs"] = caps[f]["pages"] // pages_per_seq
    ratio = caps["fp8_e4m3"]["tokens"] / caps["bf16"]["tokens"]
    log(f"KV budget {budget / 2**20:.1f} MiB, page {ps} tokens, {seq_tokens} tokens per sequence")
    comps = ", ".join(f"{n} {tuple(s)}" for n, s in kv_components(mc).items())
    log(f"  per token and layer: {comps} x {mc.num_layers} layers")
    for f in KV_CACHE_FORMATS:
        c = caps[f]
        log(
            f"  {f:<9} {c['bytes_per_token_per_layer']:>6} B/token/layer {c['bytes_per_token']:>9.1f} B/token "
            f"{c['pages']:>6} pages {c['tokens']:>8} tokens  max {c['max_seqs']} sequences"
        )
    log(
        f"  fp8/bf16 capacity: {ratio:.3f}x (split bf16 prefill + fp8 decode: {split_decode['tokens']} decode tokens)"
    )
    engines = {}
    for f in KV_CACHE_FORMATS:
        # a bf16 pool on a float32-compute CPU stores 4-byte pages: give it the page count a true
        # 2-byte bf16 pool holds in the budget, so both engines hold what the budget buys
        dt = probe.dtype
        per_page = KVPagePool.bytes_per_page(mc.num_layers, ps, kv_components(mc), dt)
        mem = budget if (f == "fp8_e4m3" or dt == TRUE_BF16) else caps[f]["pages"] * per_page
        kv = PhaseFormats("bf16", f, "bf16", f)
        engines[f] = make(formats=kv, kv_memory=mem, max_num_seqs=max(cmax, 1))
        assert engines[f].pool.num_pages == caps[f]["pages"], (f, engines[f].pool.num_pages)
    del probe
    rows = []
    log(f"{'kv':<10}{'conc':>6}{'decode tok/s':>14}{'preempt':>9}{'peak run':>10}{'total s':>9}")
    for c in concurrency:
        for f in KV_CACHE_FORMATS:
            prompts = sized_prompts(engines[f], c, prompt_tokens, salt=f"kv{c}-")
            r = run_queued_decode(engines[f], prompts, max_tokens)
            rows.append({"kv": f, "concurrency": c, **r})
            log(
                f"{f:<10}{c:>6}{r['decode_tok_s']:>14.1f}{r['preemptions']:>9}{r['peak_running']:>10}"
                f"{r['total_s']:>9.1f}"
            )
    return {
        "bench": "kv",
        "model": cfg.model,
        "dtype": str(engines["bf16"].dtype),
        "threads": torch.get_num_threads(),
        "kv_budget_bytes": budget,
        "page_size": ps,
        "prompt_tokens": prompt_tokens,
        "max_tokens": max_tokens,
        "capacity_tokens": {f: caps[f]["tokens"] for f in KV_CACHE_FORMATS},
        "kv_components": {n: list(s) for n, s in kv_components(mc).items()},
        "num_layers": mc.num_layers,
        "bytes_per_token_per_layer": {f: caps[f]["bytes_per_token_per_layer"] for f in KV_CACHE_FORMATS},
        "capacity": caps,
        "capacity_ratio_fp8_vs_bf16": ratio,
        "split_default_decode_capacity_tokens": split_decode["tokens"],
        "rows": rows,
    }


def plot_kv(path: Path, result: dict) -> None:
    plot_lines(
        path,
        result["rows"],
        key="kv",
        x="concurrency",
        y="decode_tok_s",
        title=f"decode tok/s under a {result['kv_budget_bytes'] / 2**20:.0f} MiB KV budget",
        ylabel="aggregate decode tokens/s",
    )


# ---------------------------------------------------------------- bench weights


def _prefill_tok_s(engine, prompts: list[list[int]]) -> float:
    """Prompt tokens per second of prefill steps alone (one output token each)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    n0, s0 = engine.stats.prefill_tokens, engine.stats.step_seconds["prefill"]
    for p in prompts:
        engine.add_request(p, params)
    engine.run_until_done()
    return (engine.stats.prefill_tokens - n0) / (engine.stats.step_seconds["prefill"] - s0)


def weight_byte_figures(engines: dict) -> dict:
    """Resident bytes per format, and the same parameter counts as a true 2-byte bf16 model."""
    out = {"weight_bytes": {}, "linear_weight_bytes": {}}
    for f, e in engines.items():
        wb = e.model.weight_bytes()
        out["weight_bytes"][f] = wb["total"]
        out["linear_weight_bytes"][f] = wb["linear"]
    dense = engines["bf16"]
    elem = dense.dtype.itemsize
    out["true_bf16_linear_bytes"] = out["linear_weight_bytes"]["bf16"] // elem * 2
    out["true_bf16_weight_bytes"] = out["weight_bytes"]["bf16"] // elem * 2
    out["int4_linear_ratio_vs_dense"] = (
        out["linear_weight_bytes"]["int4"] / out["linear_weight_bytes"]["bf16"]
    )
    out["int4_linear_ratio_vs_true_bf16"] = out["linear_weight_bytes"]["int4"] / out["true_bf16_linear_bytes"]
    return out


def bench_weights(
    cfg: EngineConfig,
    concurrency: list[int],
    max_tokens: int = 32,
    prefill_tokens: int = 256,
    prefill_prompts: int = 4,
    repeats: int = 3,
    threads: int | None = 1,
    log: Log = echo,
) -> dict:
    """bf16 vs fp8 vs int4 weights: decode and prefill tok/s, resident bytes; the JSON-ready result.

    ``repeats``: medians over this many runs at concurrency 1 and for prefill."""
    set_threads(threads)
    make = engine_factory(dataclasses.replace(cfg, enable_prefix_caching=False))
    kv_mem = cfg.kv_memory or 256 << 20
    engines = {
        f: make(formats=PhaseFormats(f, "bf16", f, "bf16"), kv_memory=kv_mem, max_num_seqs=max(concurrency))
        for f in WEIGHT_FORMATS
    }
    rows = []
    log(f"{'weights':<9}{'phase':<9}{'conc':>6}{'tok/s':>10}")

    def record(f: str, phase: str, c: int, vals: list[float]) -> None:
        rows.append({"weights": f, "phase": phase, "concurrency": c, "tok_s": statistics.median(vals)})
        log(f"{f:<9}{phase:<9}{c:>6}{rows[-1]['tok_s']:>10.1f}")

    for c in concurrency:
        reps = repeats if c == 1 else 1  # medians where a run is cheap
        vals: dict[str, list[float]] = {f: [] for f in WEIGHT_FORMATS}
        for i in range(reps):
            for f in WEIGHT_FORMATS:  # interleaved, so drift of a shared machine hits all alike
                r = run_pagoda_decode(engines[f], bench_prompts(c, salt=f"w{c}-{i}-"), max_tokens)
                vals[f].append(r["decode_tok_s"])
        for f in WEIGHT_FORMATS:
            record(f, "decode", c, vals[f])
    pvals: dict[str, list[float]] = {f: [] for f in WEIGHT_FORMATS}
    for i in range(repeats):
        for f in WEIGHT_FORMATS:
            prompts = sized_prompts(engines[f], prefill_prompts, prefill_tokens, salt=f"p{i}-")
            pvals[f].append(_prefill_tok_s(engines[f], prompts))
    for f in WEIGHT_FORMATS:
        record(f, "prefill", prefill_tokens, pvals[f])
    sizes = weight_byte_figures(engines)
    speed = {}
    for phase, c in [("decode", c) for c in concurrency] + [("prefill", prefill_tokens)]:
        by = {r["weights"]: r["tok_s"] for r in rows if r["phase"] == phase and r["concurrency"] == c}
        speed[f"{phase}_c{c}" if phase == "decode" else phase] = {
            f: by[f] / by["bf16"] for f in WEIGHT_FORMATS if f != "bf16"
        }
    mib = 2**20
    log("weight bytes (MiB, whole model / blocks' linear layers):")
    for f in WEIGHT_FORMATS:
        log(f"  {f:<5} {sizes['weight_bytes'][f] / mib:8.1f} / {sizes['linear_weight_bytes'][f] / mib:8.1f}")
    log(
        f"int4 linear bytes: {sizes['int4_linear_ratio_vs_dense']:.3f}x of dense {engines['bf16'].dtype}, "
        f"{sizes['int4_linear_ratio_vs_true_bf16']:.3f}x of a true 2-byte bf16"
    )
    log(
        "speed vs dense: "
        + ", ".join(f"{k}: " + "/".join(f"{f} {v:.2f}x" for f, v in d.items()) for k, d in speed.items())
    )
    return {
        "bench": "weights",
        "model": cfg.model,
        "dtype": str(engines["bf16"].dtype),
        "threads": torch.get_num_threads(),
        "max_tokens": max_tokens,
        "repeats": repeats,
        "prefill_prompts": prefill_prompts,
        "rows": rows,
        "speedup_vs_dense": speed,
        **sizes,
    }


def plot_weights(path: Path, result: dict) -> None:
    plot_lines(
        path,
        [r for r in result["rows"] if r["phase"] == "decode"],
        key="weights",
        x="concurrency",
        y="tok_s",
        title=f"decode tok/s by weight format ({result['dtype']} compute)",
        ylabel="aggregate decode tokens/s",
    )
