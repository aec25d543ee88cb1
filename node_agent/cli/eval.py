"""``pagoda eval``: quality of decode weight/KV formats against the float32 reference."""

from __future__ import annotations

import argparse

from pagoda.node_agent.bench.common import write_result
from pagoda.node_agent.bench.evaluate import DEFAULT_FORMATS, EVAL_PROMPTS, bench_eval, plot_eval
from pagoda.node_agent.cli.engine_args import add_engine_args, engine_config_from_args
from pagoda.node_agent.engine.config import PhaseFormats


def parse_format_list(text: str) -> list[str]:
    """'int4/fp8,bf16/bf16' -> entries, each validated."""
    entries = [e.strip() for e in text.split(",") if e.strip()]
    if not entries:
        raise argparse.ArgumentTypeError("no formats given")
    for e in entries:
        try:
            PhaseFormats.parse(e)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc
    return entries


def cmd_eval(a: argparse.Namespace) -> int:
    entries = a.formats
    if a.prefill_weights or a.prefill_kv:  # the prefill flags apply to every short entry
        pre = f"{a.prefill_weights or 'bf16'}/{a.prefill_kv or 'bf16'}"
        entries = [e if e.count("/") == 3 else f"{pre}/{e}" for e in entries]
        for e in entries:
            PhaseFormats.parse(e)
    result = bench_eval(
        engine_config_from_args(a),
        entries,
        max_new_tokens=a.max_new_tokens,
        num_prompts=a.num_prompts,
        max_text_tokens=a.max_text_tokens,
        threads=a.threads,
    )
    write_result(a.json, result, lambda p: plot_eval(p, result))
    return 0


def add_eval_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``pagoda eval``."""
    e = sub.add_parser("eval", help="KL / top-1 / perplexity / greedy agreement of formats vs float32")
    add_engine_args(e)
    e.add_argument(
        "--formats",
        type=parse_format_list,
        default=parse_format_list(DEFAULT_FORMATS),
        help=f"comma-separated DECODE_WEIGHTS/DECODE_KV (or PW/PKV/DW/DKV); default {DEFAULT_FORMATS}",
    )
    e.add_argument("--max-new-tokens", type=int, default=24)
    e.add_argument("--num-prompts", type=int, default=len(EVAL_PROMPTS))
    e.add_argument("--max-text-tokens", type=int, default=None, help="score only this many text tokens")
    e.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 is steadier when shared)")
    e.add_argument("--json", default=None, help="write results here (and a PNG bar chart beside it)")
    e.set_defaults(func=cmd_eval)
