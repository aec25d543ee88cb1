"""Integrity benchmark (``pagoda bench integrity``): decode throughput and p95 inter-token latency
with the KV tag check on (``enforce``) and off, interleaved on one engine (same weights, same pools,
the formats the flags give: by default the design's), with the common method (``common.py``).

The measured window holds the batch at the stated concurrency: every sequence is given enough
tokens to outlast the prefill of the others, and only decode steps in which all ``c`` sequences
decode are timed (no prefill, recompute or migration in them). The check's own time per window step
is measured directly and split into host time (the tracker's own work outside the kernel: building
whatever inputs the engine did not hand it, reading the mask) and device time (the
``check_page_tags`` kernel call itself; on CUDA the call is synchronized before and after so its
time is the device's). Block tables the engine builds once per step for the model and the check
alike are a cost of the step in both modes, not of the check.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

import pagoda.node_agent.engine.integrity as integrity_mod
from pagoda.node_agent.bench.common import (
    Log,
    Variant,
    echo,
    engine_factory,
    environment,
    paired_ratio,
    plot_lines,
    random_token_prompts,
    run_interleaved,
    set_threads,
    summarize,
)
from pagoda.node_agent.bench.stepping import run_steps, tokens_to_hold_batch
from pagoda.node_agent.engine.config import EngineConfig
from pagoda.node_agent.engine.integrity import make_tracker
from pagoda.node_agent.engine.source_formats import resolve_weight_formats

MODES = ("enforce", "off")
FIGURES = (
    "decode_tok_s",
    "itl_p95_s",
    "step_s",
    "check_s_per_step",
    "check_host_s_per_step",
    "check_device_s_per_step",
    "check_share_pct",
)


def p95(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.95 * len(xs)))] if xs else 0.0


class CheckTimer:
    """Times the tracker's whole check and, inside it, the tag-check kernel call, per engine step."""

    def __init__(self, tracker) -> None:
        self.tracker = tracker
        self.check_s = self.kernel_s = 0.0
        self.checks = self.kernel_calls = 0

    def take(self) -> dict:
        """This step's times (the probe ``run_steps`` calls after every step); resets them."""
        out = {"check_s": self.check_s, "kernel_s": self.kernel_s, "checks": self.checks}
        out["kernel_calls"] = self.kernel_calls
        self.check_s = self.kernel_s = 0.0
        self.checks = self.kernel_calls = 0
        return out

    def __enter__(self) -> CheckTimer:
        check, kernel = self.tracker.check, integrity_mod.check_page_tags

        def timed_check(*args, **kw):
            t = time.perf_counter()
            try:
                return check(*args, **kw)
            finally:
                self.check_s += time.perf_counter() - t
                self.checks += 1

        def timed_kernel(pages, tags, counts, tag_table, **kw):
            cuda = tag_table.is_cuda
            if cuda:
                torch.cuda.synchronize(tag_table.device)
            t = time.perf_counter()
            out = kernel(pages, tags, counts, tag_table, **kw)
            if cuda:
                torch.cuda.synchronize(tag_table.device)
            self.kernel_s += time.perf_counter() - t
            self.kernel_calls += 1
            return out

        self.tracker.check = timed_check
        integrity_mod.check_page_tags = timed_kernel
        self._kernel = kernel
        return self

    def __exit__(self, *exc) -> None:
        del self.tracker.check
        integrity_mod.check_page_tags = self._kernel


def run_once(engine, tracker, prompts: list[list[int]], max_tokens: int) -> dict:
    """Run the prompts to the end with ``tracker`` installed; figures over the full-batch window."""
    engine.integrity = tracker
    with CheckTimer(tracker) as timer:
        trace = run_steps(engine, prompts, max_tokens, probe=timer.take)
    trace.full_batch_rate(len(prompts))  # refuses a run that never held the whole batch
    window = trace.window(batch=len(prompts))
    n = len(window)
    secs = sum(s.seconds for s in window)
    check = sum(s.extra["check_s"] for s in window)
    kernel = sum(s.extra["kernel_s"] for s in window)
    checks = sum(s.extra["checks"] for s in window)
    seen = sum(s.extra["kernel_calls"] for s in window)
    return {
        "decode_tok_s": sum(s.decode_tokens for s in window) / secs if secs > 0 else 0.0,
        "itl_p95_s": p95([s.seconds for s in window]),  # every sequence gets one token per window step
        "step_s": secs / n if n else 0.0,
        "window_steps": n,
        "check_s_per_step": check / n if n else 0.0,
        "check_device_s_per_step": kernel / n if n else 0.0,
        "check_host_s_per_step": (check - kernel) / n if n else 0.0,
        "check_share_pct": 100 * check / secs if secs > 0 else 0.0,
        # enforce checks every step; a check whose kernel was never seen is reported, not hidden
        "kernel_observed": seen > 0 or checks == 0 or tracker.mode == "off",
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
    """enforce vs off at each concurrency on one engine (prefix caching off); the JSON-ready result.

    ``output_len``: decode steps timed per run with all sequences running."""
    set_threads(threads)
    cfg = dataclasses.replace(cfg, enable_prefix_caching=False)  # every repetition recomputes the prompts
    engine = engine_factory(cfg)()
    trackers = {m: make_tracker(m, cfg.kernel_backend) for m in MODES}
    vocab = engine.model_config.vocab_size
    variants = []
    for c in concurrency:
        hold = tokens_to_hold_batch(engine, input_len, c, output_len)
        for m in MODES:
            variants.append(
                Variant(
                    f"{m} c{c}",
                    lambda r, m=m, c=c, hold=hold: run_once(
                        engine,
                        trackers[m],
                        random_token_prompts(c, input_len, vocab, seed=1000 * c + r),
                        hold,
                    ),
                    # short prompts: the decode shapes at this batch, without a full prefill
                    warm=lambda m=m, c=c: run_once(
                        engine, trackers[m], random_token_prompts(c, 16, vocab, -c), 3
                    ),
                )
            )
    runs = run_interleaved(variants, repeats, log)
    engine.integrity = make_tracker(cfg.integrity, cfg.kernel_backend)
    rows: list[dict] = []
    log(
        f"{'mode':<9}{'conc':>5}{'decode tok/s':>14}{'min-max':>16}{'p95 ITL s':>11}{'overhead %':>12}"
        f"{'check ms/step (host + device)':>32}"
    )
    for c in concurrency:
        off = runs[f"off c{c}"]
        for m in MODES:
            rs = runs[f"{m} c{c}"]
            kept = paired_ratio([x["decode_tok_s"] for x in rs], [x["decode_tok_s"] for x in off])
            itl = paired_ratio([x["itl_p95_s"] for x in rs], [x["itl_p95_s"] for x in off])
            row = {
                "mode": m,
                "concurrency": c,
                **summarize(rs, FIGURES),
                "window_steps": min(x["window_steps"] for x in rs),
                # throughput lost vs off, per paired repeat: 1 - enforce/off as a percentage
                "overhead_pct": 100 * (1 - kept["median"]),
                "overhead_pct_min": 100 * (1 - kept["max"]),
                "overhead_pct_max": 100 * (1 - kept["min"]),
                "itl_p95_overhead_pct": 100 * (itl["median"] - 1),
                "kernel_observed": all(x["kernel_observed"] for x in rs),
            }
            rows.append(row)
            mm = f"{row['decode_tok_s_min']:.1f}-{row['decode_tok_s_max']:.1f}"
            chk = (
                f"{1e3 * row['check_s_per_step']:.3f} ({1e3 * row['check_host_s_per_step']:.3f} + "
                f"{1e3 * row['check_device_s_per_step']:.3f}), {row['check_share_pct']:.2f}%"
            )
            log(
                f"{m:<9}{c:>5}{row['decode_tok_s']:>14.1f}{mm:>16}{row['itl_p95_s']:>11.4f}"
                f"{row['overhead_pct']:>12.2f}{chk:>32}"
            )
            if not row["kernel_observed"]:
                log("  warning: the tag-check kernel call was not observed; device time reads 0")
    return {
        "bench": "integrity",
        **environment(),
        "model": cfg.model,
        "dtype": str(engine.dtype),
        "formats": resolve_weight_formats(cfg).formats.as_dict(),  # auto weights as run
        "input_len": input_len,
        "output_len": output_len,
        "repeats": repeats,
        "method": "window: decode steps with all c sequences running (no prefill, recompute or migration); "
        "warm-up, then repeats interleaved enforce/off; median, min, max; overhead_pct = 1 - enforce/off "
        "paired per repeat; check time split into host (inputs) and device (kernel call) time",
        "rows": rows,
    }


def plot_integrity(path: Path, result: dict) -> None:
    plot_lines(
        path,
        result["rows"],
        key="mode",
        x="concurrency",
        y="decode_tok_s",
        title=f"decode with integrity enforce vs off ({result['input_len']} in, {result['output_len']} timed steps)",
        ylabel="aggregate decode tokens/s",
    )
