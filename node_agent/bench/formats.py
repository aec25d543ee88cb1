"""Format benchmarks (``pagoda bench kv`` and ``pagoda bench weights``): what the per-phase formats
buy, measured.

bench kv: for one KV byte budget, the exact capacity (pages, tokens, sequences) of a bf16 and an
fp8_e4m3 pool, and aggregate decode tok/s at several concurrencies with prompts sized so that bf16
runs out of pages at the top concurrency while fp8 still holds every sequence. Only pure decode
steps are timed: prefill chunks, and the recompute of preempted sequences (prefill too), run
outside the measured window.

bench weights: decode tok/s (several concurrencies; decode steps holding every sequence) and
prefill tok/s (prefill steps) for dense bf16 (true 2-byte bfloat16, whatever the compute dtype),
fp8 and int4 weights, plus resident weight bytes; ratios against bf16 are paired per repeat.

Both use the common method (``common.py``): warm-up, interleaved repeats, median and spread.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from pagoda.node_agent.bench.common import (
    Log,
    Variant,
    bench_prompts,
    echo,
    engine_factory,
    environment,
    paired_ratio,
    plot_lines,
    run_interleaved,
    set_threads,
    summarize,
)
from pagoda.node_agent.bench.decode import run_pagoda_decode
from pagoda.node_agent.bench.stepping import run_steps
from pagoda.node_agent.engine.config import EngineConfig, PhaseFormats
from pagoda.node_agent.engine.kv_setup import kv_components, token_scaled_components
from pagoda.node_agent.kv.formats import TOKEN_SCALE_BYTES
from pagoda.node_agent.kv.pool import KVPagePool, storage_dtype
from pagoda.node_agent.params import SamplingParams
from pagoda.vocabulary import KV_CACHE_FORMATS, STORED
from pagoda.vocabulary import WEIGHT_FORMATS as ALL_WEIGHT_FORMATS

# `bench weights` compares the formats a dense source is converted to (``stored`` is the source's own)
WEIGHT_FORMATS = tuple(f for f in ALL_WEIGHT_FORMATS if f != STORED)

DEFAULT_KV_BUDGET = 64 << 20
TRUE_BF16 = torch.bfloat16
# the 1-byte KV formats, each compared with bf16, by the short name their JSON ratios carry
ONE_BYTE_KV = {"fp8_e4m3": "fp8", "int8": "int8"}


def one_byte_kv_ratios(runs: dict[str, list[dict]], concurrency: list[int], figure: str) -> dict:
    """Each 1-byte KV format's ``figure`` over bf16's, paired per repeat, per concurrency
    (``runs`` keyed "FORMAT cC")."""
    return {
        f: {
            f"c{c}": paired_ratio(
                [x[figure] for x in runs[f"{f} c{c}"]], [x[figure] for x in runs[f"bf16 c{c}"]]
            )
            for c in concurrency
        }
        for f in ONE_BYTE_KV
    }


FILLER = (
    " The tide came in slowly over the flat grey sand, filling the channels one by one while the "
    "gulls waited on the posts of the old pier for the fishing boats to return before nightfall."
)


def refuse_parallel(cfg: EngineConfig) -> None:
    """These benches hold several engines at once; a process holds one tensor-parallel replica."""
    if cfg.parallel.tensor_parallel > 1:
        raise ValueError(
            "this bench compares several engines in one process, and a process holds one "
            "tensor-parallel replica: run it with --tensor-parallel 1 (bench decode takes it)"
        )


def kv_capacity(cfg, budget: int, page_size: int, kv_format: str, granularity: str = "per-token-k") -> dict:
    """Exact capacity of a KV pool of ``budget`` bytes (tags and scales, static or per token by
    ``granularity`` and the format, included), with bf16 as a true 2-byte type whatever the compute
    dtype.
    Per-layer figures follow ``kv_components(cfg)`` (K and V per KV head, or whatever components the
    model's attention stores, e.g. an MLA latent); ``bytes_per_token_per_layer`` counts values only."""
    dt = storage_dtype(kv_format, TRUE_BF16)
    comps = kv_components(cfg)
    scaled = token_scaled_components(kv_format, granularity, comps)
    pages = KVPagePool.pages_for_budget(budget, cfg.num_layers, page_size, comps, dt, scaled, kv_format)
    per_page = KVPagePool.bytes_per_page(cfg.num_layers, page_size, comps, dt, scaled, kv_format)
    elem = torch.empty((), dtype=dt).element_size()
    per_comp = {name: int(torch.Size(shape).numel()) * elem for name, shape in comps.items()}
    return {
        "pages": pages,
        "tokens": pages * page_size,
        "bytes_per_page": per_page,
        "bytes_per_token": per_page / page_size,
        "bytes_per_token_per_layer": sum(per_comp.values()),
        "component_bytes_per_token_per_layer": per_comp,
        "token_scale_bytes_per_token_per_layer": sum(comps[c][0] for c in scaled) * TOKEN_SCALE_BYTES,
    }


def capacity_over_bf16(caps: dict) -> dict[str, float]:
    """Each 1-byte pool's tokens over bf16's, by format."""
    bf16 = max(1, caps["bf16"]["tokens"])
    return {f: caps[f]["tokens"] / bf16 for f in ONE_BYTE_KV}


def ratio_keys(kind: str, by_format: dict) -> dict:
    """Per-format values under their JSON keys, ``<kind>_ratio_<fp8|int8>_vs_bf16``."""
    return {f"{kind}_ratio_{ONE_BYTE_KV[f]}_vs_bf16": v for f, v in by_format.items()}


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
    """``bench kv --capacity-only``: bf16 vs fp8_e4m3 vs int8 per-token bytes and capacity under the budget
    (default 64 MiB) from the model's config alone: no weights loaded, no decode run."""
    mc = model_config_of(cfg.model)
    budget, ps = cfg.kv_memory or DEFAULT_KV_BUDGET, cfg.page_size
    max_len = min(cfg.max_model_len or mc.max_position, mc.max_position)
    caps = {f: kv_capacity(mc, budget, ps, f, cfg.kv_scale_granularity) for f in KV_CACHE_FORMATS}
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
        **ratio_keys("capacity", capacity_over_bf16(caps)),
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

    decode_tok_s: tokens of pure decode steps over their time (prefill chunks and the recompute of
    preempted sequences are prefill steps, left out of the window); the mean batch of those steps,
    preemptions and the largest decode batch tell how much of the workload the pool held at once."""
    trace = run_steps(engine, prompts, max_tokens)
    rate = trace.decode_rate()
    return {
        "decode_tok_s": rate["decode_tok_s"],
        "window_steps": rate["window_steps"],
        "window_mean_batch": rate["window_mean_batch"],
        "total_s": trace.total_s,
        "preemptions": sum(st.preemptions for st in trace.steps),
        "peak_running": max((st.decode_tokens for st in trace.window()), default=0),
    }


# ---------------------------------------------------------------- bench kv


def bench_kv(
    cfg: EngineConfig,
    concurrency: list[int],
    max_tokens: int = 24,
    pages_per_seq: int | None = None,
    threads: int | None = 1,
    log: Log = echo,
    repeats: int = 3,
) -> dict:
    """bf16 vs fp8_e4m3 vs int8 KV under the budget ``cfg.kv_memory`` (default 64 MiB); the JSON-ready
    result.

    ``pages_per_seq`` defaults to filling 85% of the smaller 1-byte pool at the top concurrency; ``repeats``
    timed runs per (format, concurrency), interleaved."""
    set_threads(threads)
    refuse_parallel(cfg)
    make = engine_factory(dataclasses.replace(cfg, enable_prefix_caching=False))
    budget = cfg.kv_memory or DEFAULT_KV_BUDGET
    probe = make(formats=PhaseFormats.reference(), kv_memory=1 << 20)
    mc, ps = probe.model_config, cfg.page_size
    caps = {f: kv_capacity(mc, budget, ps, f, cfg.kv_scale_granularity) for f in KV_CACHE_FORMATS}
    # the design default: a bf16 prefill pool (prefill_kv_fraction of the budget) + a 1-byte decode pool
    default = EngineConfig()
    split_decode = kv_capacity(
        mc,
        budget - int(budget * default.prefill_kv_fraction),
        ps,
        default.formats.decode_kv,
        cfg.kv_scale_granularity,
    )
    cmax = max(concurrency)
    small = min(caps[f]["pages"] for f in ONE_BYTE_KV)
    pages_per_seq = pages_per_seq or max(1, int(0.85 * small / cmax))
    seq_tokens = pages_per_seq * ps
    max_tokens = min(max_tokens, seq_tokens // 2)
    prompt_tokens = seq_tokens - max_tokens
    for f in KV_CACHE_FORMATS:
        caps[f]["max_seqs"] = caps[f]["pages"] // pages_per_seq
    over_bf16 = capacity_over_bf16(caps)
    log(f"KV budget {budget / 2**20:.1f} MiB, page {ps} tokens, {seq_tokens} tokens per sequence")
    comps = ", ".join(f"{n} {tuple(s)}" for n, s in kv_components(mc).items())
    log(f"  per token and layer: {comps} x {mc.num_layers} layers")
    for f in KV_CACHE_FORMATS:
        c = caps[f]
        log(
            f"  {f:<9} {c['bytes_per_token_per_layer']:>6} B/token/layer {c['bytes_per_token']:>9.1f} B/token "
            f"{c['pages']:>6} pages {c['tokens']:>8} tokens  max {c['max_seqs']} sequences"
        )
    shown = ", ".join(f"{ONE_BYTE_KV[f]} {r:.3f}x" for f, r in over_bf16.items())
    log(
        f"  capacity over bf16: {shown} (split bf16 prefill + {default.formats.decode_kv} decode: "
        f"{split_decode['tokens']} decode tokens)"
    )
    engines = {}
    for f in KV_CACHE_FORMATS:
        # a bf16 pool on a float32-compute CPU stores 4-byte pages: give it the page count a true
        # 2-byte bf16 pool holds in the budget, so both engines hold what the budget buys
        dt = probe.dtype
        per_page = KVPagePool.bytes_per_page(mc.num_layers, ps, kv_components(mc), dt)
        mem = budget if (f != "bf16" or dt == TRUE_BF16) else caps[f]["pages"] * per_page
        kv = PhaseFormats("bf16", f, "bf16", f)
        engines[f] = make(formats=kv, kv_memory=mem, max_num_seqs=max(cmax, 1))
        assert engines[f].decode_pool.num_pages == caps[f]["pages"], (f, engines[f].decode_pool.num_pages)
    del probe
    variants = []
    for c in concurrency:
        for f in KV_CACHE_FORMATS:

            def prompts(r: int, f: str = f, c: int = c) -> list[list[int]]:
                return sized_prompts(engines[f], c, prompt_tokens, salt=f"kv{c}-r{r}-")

            variants.append(
                Variant(
                    f"{f} c{c}",
                    lambda r, f=f, p=prompts: run_queued_decode(engines[f], p(r), max_tokens),
                    warm=lambda f=f, p=prompts: run_queued_decode(engines[f], p(-1), 2),
                )
            )
    runs = run_interleaved(variants, repeats, log)
    rows = []
    log(
        f"{'kv':<10}{'conc':>6}{'decode tok/s':>14}{'min-max':>16}{'mean batch':>12}{'preempt':>9}{'peak':>6}"
    )
    for c in concurrency:
        for f in KV_CACHE_FORMATS:
            rs = runs[f"{f} c{c}"]
            r = {
                "kv": f,
                "concurrency": c,
                **summarize(rs, ("decode_tok_s", "window_mean_batch", "total_s")),
                "window_steps": min(x["window_steps"] for x in rs),
                "preemptions": max(x["preemptions"] for x in rs),
                "peak_running": min(x["peak_running"] for x in rs),
            }
            rows.append(r)
            mm = f"{r['decode_tok_s_min']:.1f}-{r['decode_tok_s_max']:.1f}"
            log(
                f"{f:<10}{c:>6}{r['decode_tok_s']:>14.1f}{mm:>16}{r['window_mean_batch']:>12.1f}"
                f"{r['preemptions']:>9}{r['peak_running']:>6}"
            )
    ratio_rows = one_byte_kv_ratios(runs, concurrency, "decode_tok_s")
    return {
        "bench": "kv",
        **environment(),
        "model": cfg.model,
        "dtype": str(engines["bf16"].dtype),
        "repeats": repeats,
        "method": "pure decode steps only (prefill and recompute outside the window); warm-up, then "
        "repeats interleaved bf16/fp8/int8 per concurrency; median, min, max; ratio paired per repeat",
        "kv_budget_bytes": budget,
        "page_size": ps,
        "prompt_tokens": prompt_tokens,
        "max_tokens": max_tokens,
        "capacity_tokens": {f: caps[f]["tokens"] for f in KV_CACHE_FORMATS},
        "kv_components": {n: list(s) for n, s in kv_components(mc).items()},
        "num_layers": mc.num_layers,
        "bytes_per_token_per_layer": {f: caps[f]["bytes_per_token_per_layer"] for f in KV_CACHE_FORMATS},
        "capacity": caps,
        **ratio_keys("capacity", over_bf16),
        "split_default_decode_capacity_tokens": split_decode["tokens"],
        "rows": rows,
        **ratio_keys("decode", ratio_rows),
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
    """Dense bf16 vs fp8 vs int4 weights: decode and prefill tok/s, resident bytes; the JSON-ready
    result. The dense engine computes in true bfloat16 (2-byte weights, as on a GPU), fp8 and int4
    in the configured dtype (each row names its dtype); ``repeats`` timed runs per point, interleaved."""
    set_threads(threads)
    refuse_parallel(cfg)
    make = engine_factory(dataclasses.replace(cfg, enable_prefix_caching=False))
    kv_mem = cfg.kv_memory or 256 << 20
    seats = max(max(concurrency), prefill_prompts)
    engines = {
        f: make(
            formats=PhaseFormats(f, "bf16", f, "bf16"),
            kv_memory=kv_mem,
            max_num_seqs=seats,
            **({"dtype": "bfloat16"} if f == "bf16" else {}),
        )
        for f in WEIGHT_FORMATS
    }
    points = [(f"decode_c{c}", c) for c in concurrency] + [("prefill", prefill_tokens)]
    variants = []
    for point, c in points:
        for f in WEIGHT_FORMATS:
            e = engines[f]
            if point == "prefill":

                def run(r: int, e=e) -> dict:
                    ps = sized_prompts(e, prefill_prompts, prefill_tokens, salt=f"p-r{r}-")
                    return {"tok_s": _prefill_tok_s(e, ps)}

            else:

                def run(r: int, e=e, c=c) -> dict:
                    out = run_pagoda_decode(e, bench_prompts(c, salt=f"w{c}-r{r}-"), max_tokens)
                    return {"tok_s": out["decode_tok_s"]}

            warm = (
                None if point == "prefill" else (lambda e=e, c=c: run_pagoda_decode(e, bench_prompts(c), 2))
            )
            variants.append(Variant(f"{f} {point}", run, warm))
    runs = run_interleaved(variants, repeats, log)
    rows = []
    log(f"{'weights':<9}{'dtype':<16}{'phase':<9}{'conc':>6}{'tok/s':>10}{'min-max':>16}")
    for point, c in points:
        phase = "prefill" if point == "prefill" else "decode"
        for f in WEIGHT_FORMATS:
            dt = str(engines[f].dtype)
            row = {"weights": f, "dtype": dt, "phase": phase, "concurrency": c}
            rows.append({**row, **summarize(runs[f"{f} {point}"], ("tok_s",))})
            mm = f"{rows[-1]['tok_s_min']:.1f}-{rows[-1]['tok_s_max']:.1f}"
            log(f"{f:<9}{dt:<16}{phase:<9}{c:>6}{rows[-1]['tok_s']:>10.1f}{mm:>16}")
    sizes = weight_byte_figures(engines)
    speed = {}
    for point, _ in points:
        dense = [x["tok_s"] for x in runs[f"bf16 {point}"]]
        speed[point] = {
            f: paired_ratio([x["tok_s"] for x in runs[f"{f} {point}"]], dense)
            for f in WEIGHT_FORMATS
            if f != "bf16"
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
        "speed vs dense bf16 (median of paired ratios): "
        + ", ".join(
            f"{k}: " + "/".join(f"{f} {v['median']:.2f}x" for f, v in d.items()) for k, d in speed.items()
        )
    )
    return {
        "bench": "weights",
        **environment(),
        "model": cfg.model,
        "dtype": {f: str(e.dtype) for f, e in engines.items()},
        "max_tokens": max_tokens,
        "repeats": repeats,
        "prefill_prompts": prefill_prompts,
        "method": "dense = true bfloat16; decode: steps holding every sequence; prefill: prefill steps; "
        "warm-up, then repeats interleaved bf16/fp8/int4 per point; median, min, max; ratios paired per repeat",
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
        title=f"decode tok/s by weight format ({result['threads']} threads)",
        ylabel="aggregate decode tokens/s",
    )
