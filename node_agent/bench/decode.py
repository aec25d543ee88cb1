"""Decode benchmark: aggregate decode tok/s and TTFT against transformers ``generate`` on the same weights."""

from __future__ import annotations

import time
from pathlib import Path

from pagoda.node_agent.bench.common import Log, bench_prompts, echo, plot_lines
from pagoda.node_agent.engine.config import EngineConfig


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


def bench_decode(
    cfg: EngineConfig, concurrency: list[int], max_tokens: int = 64, baseline: bool = True, log: Log = echo
) -> dict:
    """Pagoda (and, with ``baseline``, transformers) at each concurrency; the JSON-ready result."""
    from pagoda.node_agent.engine.llm_engine import LLMEngine

    engine = LLMEngine(cfg)
    rows = []
    log(f"{'engine':<14}{'conc':>6}{'decode tok/s':>14}{'TTFT s':>10}")
    for c in concurrency:
        prompts = bench_prompts(c, salt=f"c{c}-")
        r = run_pagoda_decode(engine, prompts, max_tokens)
        rows.append({"engine": "pagoda", "concurrency": c, **r})
        log(f"{'pagoda':<14}{c:>6}{r['decode_tok_s']:>14.1f}{r['ttft_s']:>10.3f}")
    if baseline:
        model, tok = load_hf_reference(cfg.model, engine.dtype)
        for c in concurrency:
            r = run_hf_decode(model, tok, bench_prompts(c, salt=f"c{c}-"), max_tokens)
            rows.append({"engine": "transformers", "concurrency": c, **r})
            log(f"{'transformers':<14}{c:>6}{r['decode_tok_s']:>14.1f}{r['ttft_s']:>10.3f}")
    ratios = {}
    for c in concurrency:
        p = [r for r in rows if r["engine"] == "pagoda" and r["concurrency"] == c]
        h = [r for r in rows if r["engine"] == "transformers" and r["concurrency"] == c]
        if p and h:
            ratios[str(c)] = p[0]["decode_tok_s"] / h[0]["decode_tok_s"]
    if ratios:
        log(
            "pagoda/transformers decode throughput: "
            + ", ".join(f"c{c}: {v:.2f}x" for c, v in ratios.items())
        )
    return {
        "bench": "decode",
        "model": cfg.model,
        "dtype": str(engine.dtype),
        "max_tokens": max_tokens,
        "formats": cfg.formats.as_dict(),
        "rows": rows,
        "speedup_vs_transformers": ratios,
    }


def plot_decode(path: Path, result: dict) -> None:
    plot_lines(
        path,
        result["rows"],
        key="engine",
        x="concurrency",
        y="decode_tok_s",
        title=f"decode throughput ({result['model']}, {result['dtype']})",
        ylabel="aggregate decode tokens/s",
    )
