"""Decode benchmark (``pagoda bench decode``): aggregate decode tok/s and TTFT of Pagoda beside
transformers ``generate`` (same weights and dtype) and llama.cpp (llama-cpp-python, same GGUF,
single stream), measured with the common method (``common.py``): warm-up, interleaved repeats,
medians with spread, paired ratios.

What is timed, per engine:
- Pagoda: only decode steps in which all ``c`` sequences decode (no prefill, recompute or pool
  migration in the step); each sequence gets enough tokens that at least ``max_tokens`` such
  steps run although prefill is chunked.
- transformers: one padded batch of ``c`` prompts; ``generate`` of ``max_tokens`` (EOS ignored)
  minus a 1-token ``generate`` of the same batch (its prefill), over ``c * (max_tokens - 1)``.
- llama.cpp: one stream, the same prompt token ids; the time from the first generated token to
  the last over ``max_tokens - 1`` tokens (EOS masked by a logits processor), same thread count.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import time
from pathlib import Path

from pagoda.node_agent.bench.common import (
    Log,
    Variant,
    bench_prompts,
    echo,
    engine_factory,
    environment,
    paired_ratio,
    run_interleaved,
    set_threads,
    summarize,
)
from pagoda.node_agent.bench.stepping import run_steps, tokens_to_hold_batch
from pagoda.node_agent.engine.config import EngineConfig
from pagoda.node_agent.engine.source_formats import resolve_weight_formats

LLAMACPP = "llama.cpp"
LLAMACPP_INSTALL = (
    "pip install 'pagoda[llamacpp]' (or: pip install llama-cpp-python); "
    "it builds llama.cpp from source, about 8 minutes on 2 cores"
)
TP1 = "pagoda-tp1"  # the same engine on one rank: the baseline of --tensor-parallel > 1
DENSE_HEAD = "pagoda-dense-head"  # the same engine with a dense decode LM head
BASELINES = ("transformers", LLAMACPP, TP1, DENSE_HEAD)
# the done-when: (name, pagoda concurrency, baseline, baseline concurrency, target)
TARGETS = (
    ("pagoda_c1_vs_llamacpp_single_stream", 1, LLAMACPP, 1, 0.5),
    ("pagoda_c16_vs_transformers_c16", 16, "transformers", 16, 3.0),
    ("pagoda_c16_vs_llamacpp_single_stream", 16, LLAMACPP, 1, 2.0),
)
FIGURES = ("decode_tok_s", "ttft_s")


def with_threads(n: int, fn, *args):
    """``fn(*args)`` with torch using ``n`` CPU threads on this process."""
    import torch

    torch.set_num_threads(n)
    return fn(*args)


def run_pagoda_decode(engine, prompts: list, max_tokens: int) -> dict:
    """All prompts at once; tok/s over the decode steps that hold every sequence, median TTFT.

    ``max_tokens`` is the number of full-batch decode steps wanted: each sequence is given enough
    extra tokens to cover the decode steps the first ones take while later prompts still prefill."""
    lens = [len(engine.tokenize(p)) for p in prompts]
    hold = tokens_to_hold_batch(engine, max(lens), len(prompts), max_tokens)
    trace = run_steps(engine, prompts, hold)
    return {**trace.full_batch_rate(len(prompts)), "ttft_s": trace.median_ttft(), "total_s": trace.total_s}


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
    tok_s = len(prompts) * (max_tokens - 1) / decode_time if decode_time > 0 else 0.0
    return {"decode_tok_s": tok_s, "ttft_s": ttft, "total_s": t2 - t1}


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


# ---------------------------------------------------------------- llama.cpp


def llamacpp_unavailable(model_source: str) -> dict | None:
    """Why the llama.cpp baseline cannot run (a row's status and detail), or None when it can."""
    from pagoda.node_agent.models.loader import resolve_source

    if importlib.util.find_spec("llama_cpp") is None:
        return {"status": "not installed", "install": LLAMACPP_INSTALL}
    kind, _ = resolve_source(model_source)
    if kind != "gguf":
        return {
            "status": "needs a GGUF source",
            "detail": f"{model_source} is a Hugging Face directory; llama.cpp runs GGUF files only",
        }
    return None


def load_llamacpp(model_source: str, threads: int, n_ctx: int):
    """llama-cpp-python's ``Llama`` on the model's GGUF, CPU only, ``threads`` threads."""
    from llama_cpp import Llama

    from pagoda.node_agent.models.loader import resolve_source

    _, path = resolve_source(model_source)
    return Llama(
        model_path=str(path),
        n_threads=threads,
        n_threads_batch=threads,
        n_ctx=n_ctx,
        n_gpu_layers=0,
        seed=0,
        verbose=False,
    )


def run_llamacpp_decode(llm, prompt_ids: list[int], max_tokens: int) -> dict:
    """One greedy stream of exactly ``max_tokens`` tokens (EOS masked); decode tok/s after the first."""
    import numpy as np
    from llama_cpp import LogitsProcessorList

    eos = llm.token_eos()

    def no_eos(_ids, logits):
        logits[eos] = -np.inf
        return logits

    llm.reset()  # no prefix reuse from an earlier run
    n, t_first, last = 0, 0.0, 0.0
    t0 = time.perf_counter()
    for _ in llm.generate(prompt_ids, temp=0.0, logits_processor=LogitsProcessorList([no_eos])):
        last = time.perf_counter()
        n += 1
        if n == 1:
            t_first = last
        if n >= max_tokens:
            break
    span = last - t_first
    return {"decode_tok_s": (n - 1) / span if span > 0 else 0.0, "ttft_s": t_first - t0, "total_s": last - t0}


# ---------------------------------------------------------------- the bench


def _row(engine: str, c: int, runs: list[dict], **extra) -> dict:
    return {"engine": engine, "concurrency": c, "status": "ok", **extra, **summarize(runs, FIGURES)}


def _targets(runs: dict[str, list[dict]], rows: list[dict]) -> dict:
    """The done-when ratios (paired per repeat) with their targets; unmeasured ones say why."""
    status = {(r["engine"], r["concurrency"]): r["status"] for r in rows}
    out = {}
    for name, pc, base, bc, target in TARGETS:
        p, b = runs.get(f"pagoda c{pc}"), runs.get(f"{base} c{bc}")
        if p is None:
            out[name] = {"target": target, "status": f"not measured: add {pc} to --concurrency"}
        elif b is None:
            why = status.get((base, bc), "skipped")
            out[name] = {"target": target, "status": f"not measured: {base} {why}"}
        else:
            r = paired_ratio([x["decode_tok_s"] for x in p], [x["decode_tok_s"] for x in b])
            out[name] = {"target": target, **r, "met": r["median"] >= target}
    return out


def bench_decode(
    cfg: EngineConfig,
    concurrency: list[int],
    max_tokens: int = 64,
    baselines: tuple[str, ...] = BASELINES,
    repeats: int = 3,
    threads: int | None = None,
    log: Log = echo,
) -> dict:
    """Pagoda at each concurrency beside the ``baselines`` (transformers at the same concurrencies,
    llama.cpp single stream), interleaved per repeat; the JSON-ready result."""
    import torch

    unknown = [b for b in baselines if b not in BASELINES]
    if unknown:
        raise ValueError(f"unknown baseline(s) {unknown}; use {', '.join(BASELINES)}")
    if max_tokens < 2:
        raise ValueError("max_tokens must be at least 2 (decode is timed after the first token)")
    tp = cfg.parallel.tensor_parallel
    if TP1 in baselines and tp == 1:
        raise ValueError(f"the {TP1} baseline compares against --tensor-parallel > 1")
    set_threads(threads)
    nthreads = torch.get_num_threads()
    make = engine_factory(cfg)
    engine = make()
    # every configuration gets the whole machine: a rank of a host shares its threads with the others
    rank_threads = max(1, nthreads // (tp // cfg.parallel.nodes))
    torch.set_num_threads(nthreads)
    variants: list[Variant] = []
    rows: list[dict] = []
    tp1 = (
        make(parallel=dataclasses.replace(cfg.parallel, tensor_parallel=1, nodes=1))
        if TP1 in baselines
        else None
    )
    if DENSE_HEAD in baselines and (tp > 1 or cfg.decode_lm_head == "dense"):
        raise ValueError(f"the {DENSE_HEAD} baseline compares a packed --decode-lm-head, on one rank")
    dense_head = make(decode_lm_head="dense") if DENSE_HEAD in baselines else None
    if LLAMACPP in baselines:
        why = llamacpp_unavailable(cfg.model)
        if why:
            rows.append({"engine": LLAMACPP, "concurrency": 1, "single_stream": True, **why})
            log(f"{LLAMACPP}: {why['status']} ({why.get('install') or why.get('detail')})")
        else:
            ids = {r: engine.tokenize(bench_prompts(1, salt=f"c1-r{r}-")[0]) for r in range(-1, repeats)}
            n_ctx = max(len(x) for x in ids.values()) + max_tokens + 64
            llm = load_llamacpp(cfg.model, nthreads, n_ctx)
            variants.append(Variant(f"{LLAMACPP} c1", lambda r: run_llamacpp_decode(llm, ids[r], max_tokens)))
    hf_model, hf_tok = (
        load_hf_reference(cfg.model, engine.dtype) if "transformers" in baselines else (None, None)
    )
    for c in concurrency:

        def prompts(r: int, c: int = c) -> list[str]:
            return bench_prompts(c, salt=f"c{c}-r{r}-")

        variants.append(
            Variant(
                f"pagoda c{c}",
                lambda r, c=c, p=prompts: with_threads(
                    rank_threads, run_pagoda_decode, engine, p(r), max_tokens
                ),
                warm=lambda p=prompts: with_threads(rank_threads, run_pagoda_decode, engine, p(-1), 2),
            )
        )
        if dense_head is not None:
            variants.append(
                Variant(
                    f"{DENSE_HEAD} c{c}",
                    lambda r, p=prompts: run_pagoda_decode(dense_head, p(r), max_tokens),
                    warm=lambda p=prompts: run_pagoda_decode(dense_head, p(-1), 2),
                )
            )
        if tp1 is not None:
            variants.append(
                Variant(
                    f"{TP1} c{c}",
                    lambda r, p=prompts: with_threads(nthreads, run_pagoda_decode, tp1, p(r), max_tokens),
                    warm=lambda p=prompts: with_threads(nthreads, run_pagoda_decode, tp1, p(-1), 2),
                )
            )
        if hf_model is not None:
            variants.append(
                Variant(
                    f"transformers c{c}",
                    lambda r, p=prompts: run_hf_decode(hf_model, hf_tok, p(r), max_tokens),
                    warm=lambda p=prompts: run_hf_decode(hf_model, hf_tok, p(-1), 2),
                )
            )
    log(f"{len(variants)} variants, {repeats} repeat(s) each, {nthreads} threads")
    try:
        runs = run_interleaved(variants, repeats, log)
    finally:
        engine.close()  # a tensor-parallel replica's other ranks stop here
    for v in variants:
        name, c = v.name.rsplit(" c", 1)
        extra = {"single_stream": True} if name == LLAMACPP else {}
        if name in ("pagoda", TP1, DENSE_HEAD):
            extra["window_steps"] = min(x["window_steps"] for x in runs[v.name])
        rows.append(_row(name, int(c), runs[v.name], **extra))
    log(f"{'engine':<14}{'conc':>6}{'decode tok/s':>14}{'min-max':>18}{'TTFT s':>10}")
    for r in rows:
        if r["status"] == "ok":
            mm = f"{r['decode_tok_s_min']:.1f}-{r['decode_tok_s_max']:.1f}"
            log(
                f"{r['engine']:<14}{r['concurrency']:>6}{r['decode_tok_s']:>14.1f}{mm:>18}{r['ttft_s']:>10.3f}"
            )
    ratios: dict[str, dict] = {"pagoda_vs_transformers": {}, "pagoda_vs_llamacpp_single_stream": {}}
    if tp1 is not None:
        ratios["pagoda_vs_pagoda_tp1"] = {}
    if dense_head is not None:
        ratios["pagoda_vs_pagoda_dense_head"] = {}
    for c in concurrency:
        p = [x["decode_tok_s"] for x in runs[f"pagoda c{c}"]]
        if dense_head is not None:
            d = [x["decode_tok_s"] for x in runs[f"{DENSE_HEAD} c{c}"]]
            ratios["pagoda_vs_pagoda_dense_head"][f"c{c}"] = paired_ratio(p, d)
        if tp1 is not None:
            ratios["pagoda_vs_pagoda_tp1"][f"c{c}"] = paired_ratio(
                p, [x["decode_tok_s"] for x in runs[f"{TP1} c{c}"]]
            )
        if f"transformers c{c}" in runs:
            h = [x["decode_tok_s"] for x in runs[f"transformers c{c}"]]
            ratios["pagoda_vs_transformers"][f"c{c}"] = paired_ratio(p, h)
        if f"{LLAMACPP} c1" in runs:
            lc = [x["decode_tok_s"] for x in runs[f"{LLAMACPP} c1"]]
            ratios["pagoda_vs_llamacpp_single_stream"][f"c{c}"] = paired_ratio(p, lc)
    targets = _targets(runs, rows)
    for name, t in targets.items():
        if "median" in t:
            log(f"{name}: {t['median']:.2f}x (target {t['target']}x, {'met' if t['met'] else 'NOT met'})")
        else:
            log(f"{name}: {t['status']}")
    return {
        "bench": "decode",
        **environment(),
        "model": cfg.model,
        "dtype": str(engine.dtype),
        "formats": resolve_weight_formats(cfg).formats.as_dict(),  # auto weights as run
        "tensor_parallel": tp,
        "threads_per_rank": rank_threads,
        "max_tokens": max_tokens,
        "repeats": repeats,
        "method": "warm-up per variant, then repeats interleaved across every engine and concurrency; "
        "rows: median, min, max; ratios paired per repeat. Pagoda: decode steps holding all c "
        "sequences; transformers: generate(max_tokens) minus generate(1); llama.cpp: one stream",
        "rows": rows,
        "ratios": ratios,
        "targets": targets,
    }


def plot_decode(path: Path, result: dict) -> None:
    """Pagoda and transformers over concurrency (min-max bars); llama.cpp's single stream as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ok = [r for r in result["rows"] if r["status"] == "ok"]
    for name in ("pagoda", "transformers"):
        pts = sorted((r["concurrency"], r) for r in ok if r["engine"] == name)
        if not pts:
            continue
        xs = [c for c, _ in pts]
        ys = [r["decode_tok_s"] for _, r in pts]
        err = [[y - r["decode_tok_s_min"] for y, (_, r) in zip(ys, pts, strict=True)],
               [r["decode_tok_s_max"] - y for y, (_, r) in zip(ys, pts, strict=True)]]  # fmt: skip
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=name)
    lc = [r for r in result["rows"] if r["engine"] == LLAMACPP]
    if lc and lc[0]["status"] == "ok":
        ax.axhline(lc[0]["decode_tok_s"], linestyle="--", color="gray", label="llama.cpp, one stream")
    elif lc:
        ax.plot([], [], " ", label=f"llama.cpp: {lc[0]['status']}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("aggregate decode tokens/s")
    ax.set_title(f"decode ({result['dtype']}, {result['threads']} threads, median of {result['repeats']})")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
