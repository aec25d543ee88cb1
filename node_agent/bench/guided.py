"""Constrained-decoding benchmark (``pagoda bench guided``): the cost per decode step of grammar
masks, with the same requests run with a json_schema constraint and without one, interleaved on one
engine.

Both modes decode the same number of steps: the schema cannot complete within the run (its array
needs more items than the tokens allow) and the unconstrained requests ignore EOS, so every request
runs to ``max_tokens`` in both. Only decode steps with all ``c`` sequences decoding are timed
(``stepping.py``). Inside each such step the mask's own time (filling the batch's bitmask and
applying it to the logits, ``engine/guided/masking.py``) is measured beside the whole step's; the
grammar's other per-token cost (the matcher accepting the sampled token) is in the step time.
The grammar is compiled (and cached) during the warm-up, so no compile falls in a timed run.
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
    paired_ratio,
    plot_lines,
    random_token_prompts,
    run_interleaved,
    set_threads,
    summarize,
)
from pagoda.node_agent.bench.stepping import run_steps, tokens_to_hold_batch
from pagoda.node_agent.engine.config import EngineConfig
from pagoda.node_agent.engine.guided import masking
from pagoda.node_agent.engine.source_formats import resolve_weight_formats

MODES = ("json_schema", "off")
# a record of typed fields, then an array of objects it cannot finish within a bench run
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "title": {"type": "string"},
        "done": {"type": "boolean"},
        "items": {
            "type": "array",
            "minItems": 100000,
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "qty": {"type": "number"}},
                "required": ["name", "qty"],
            },
        },
    },
    "required": ["id", "title", "done", "items"],
}
GUIDED = {"type": "json_schema", "schema": SCHEMA}
FIGURES = ("decode_tok_s", "step_s", "mask_s_per_step", "mask_share_pct")


def _mask_probe() -> dict:
    """The mask time since the last call (``run_steps`` calls it after every step)."""
    s = masking.stats
    out = {"mask_s": s.seconds, "mask_rows": s.rows}
    s.seconds, s.rows, s.calls = 0.0, 0, 0
    return out


def run_once(engine, prompts: list[list[int]], max_tokens: int, guided: dict | None) -> dict:
    """Run the prompts to the end (constrained by ``guided`` or not); figures over the window."""
    _mask_probe()
    trace = run_steps(engine, prompts, max_tokens, probe=_mask_probe, guided=guided)
    trace.full_batch_rate(len(prompts))  # refuses a run that never held the whole batch
    window = trace.window(batch=len(prompts))
    n, secs = len(window), sum(s.seconds for s in window)
    mask = sum(s.extra["mask_s"] for s in window)
    rows = sum(s.extra["mask_rows"] for s in window)
    if guided is not None and rows != n * len(prompts):
        raise RuntimeError(f"{rows} masked rows in {n} window steps of {len(prompts)} constrained sequences")
    return {
        "decode_tok_s": sum(s.decode_tokens for s in window) / secs if secs > 0 else 0.0,
        "step_s": secs / n if n else 0.0,
        "window_steps": n,
        "mask_s_per_step": mask / n if n else 0.0,
        "mask_share_pct": 100 * mask / secs if secs > 0 else 0.0,
    }


def _variants(engine, concurrency: list[int], input_len: int, output_len: int) -> list[Variant]:
    vocab = engine.model_config.vocab_size
    variants = []
    for c in concurrency:
        hold = tokens_to_hold_batch(engine, input_len, c, output_len)
        for m in MODES:
            g = GUIDED if m != "off" else None
            variants.append(
                Variant(
                    f"{m} c{c}",
                    lambda r, c=c, g=g, hold=hold: run_once(
                        engine, random_token_prompts(c, input_len, vocab, seed=1000 * c + r), hold, g
                    ),
                    # short prompts: the decode shapes at this batch (and the grammar's compile)
                    warm=lambda c=c, g=g: run_once(engine, random_token_prompts(c, 8, vocab, -c), 3, g),
                )
            )
    return variants


def bench_guided(
    cfg: EngineConfig,
    concurrency: list[int],
    input_len: int = 32,
    output_len: int = 16,
    repeats: int = 3,
    threads: int | None = None,
    log: Log = echo,
) -> dict:
    """json_schema vs unconstrained at each concurrency on one engine; the JSON-ready result."""
    set_threads(threads)
    cfg = dataclasses.replace(cfg, enable_prefix_caching=False)  # every repetition recomputes the prompts
    engine = engine_factory(cfg)()
    runs = run_interleaved(_variants(engine, concurrency, input_len, output_len), repeats, log)
    rows: list[dict] = []
    log(
        f"{'mode':<13}{'conc':>5}{'step ms':>10}{'min-max':>16}{'mask ms':>10}{'mask %':>8}{'overhead %':>12}"
    )
    for c in concurrency:
        off = runs[f"off c{c}"]
        for m in MODES:
            rs = runs[f"{m} c{c}"]
            slower = paired_ratio([x["step_s"] for x in rs], [x["step_s"] for x in off])
            row = {
                "mode": m,
                "concurrency": c,
                **summarize(rs, FIGURES),
                "window_steps": min(x["window_steps"] for x in rs),
                # decode step time added vs off, per paired repeat: constrained/off - 1, in percent
                "overhead_pct": 100 * (slower["median"] - 1),
                "overhead_pct_min": 100 * (slower["min"] - 1),
                "overhead_pct_max": 100 * (slower["max"] - 1),
            }
            rows.append(row)
            mm = f"{1e3 * row['step_s_min']:.1f}-{1e3 * row['step_s_max']:.1f}"
            log(
                f"{m:<13}{c:>5}{1e3 * row['step_s']:>10.1f}{mm:>16}{1e3 * row['mask_s_per_step']:>10.3f}"
                f"{row['mask_share_pct']:>8.2f}{row['overhead_pct']:>12.2f}"
            )
    return {
        "bench": "guided",
        **environment(),
        "model": cfg.model,
        "dtype": str(engine.dtype),
        "formats": resolve_weight_formats(cfg).formats.as_dict(),  # auto weights as run
        "input_len": input_len,
        "output_len": output_len,
        "repeats": repeats,
        "schema": SCHEMA,
        "method": "window: decode steps with all c sequences running; both modes run every request to "
        "max_tokens (the schema cannot complete, EOS ignored); warm-up (compiles the grammar), then "
        "repeats interleaved json_schema/off; median, min, max; overhead_pct = step_s constrained/off - 1 "
        "paired per repeat; mask_s_per_step = bitmask fill + apply inside the step",
        "rows": rows,
    }


def plot_guided(path: Path, result: dict) -> None:
    plot_lines(
        path,
        [dict(r, step_ms=1e3 * r["step_s"]) for r in result["rows"]],
        key="mode",
        x="concurrency",
        y="step_ms",
        title=f"decode step with a json_schema constraint vs none ({result['output_len']} timed steps)",
        ylabel="decode step (ms)",
    )
