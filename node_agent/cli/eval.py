"""``pagoda eval``: quality of decode weight/KV formats against the float32 reference (offline), or of
one live server against another (``--remote URL --reference URL``: cli/eval_remote.py)."""

from __future__ import annotations

import argparse

from pagoda.node_agent.bench.common import write_result
from pagoda.node_agent.bench.evaluate import DEFAULT_FORMATS, EVAL_PROMPTS, bench_eval, plot_eval
from pagoda.node_agent.cli.engine_args import add_engine_args, engine_config_from_args
from pagoda.node_agent.cli.eval_remote import add_remote_args
from pagoda.node_agent.engine.config import KV_SCALE_GRANULARITIES, PhaseFormats


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


def parse_granularities(text: str) -> list[str]:
    """'per-head,per-token-k' -> the FP8 KV scale granularities, each validated."""
    out = [g.strip() for g in text.split(",") if g.strip()]
    bad = [g for g in out if g not in KV_SCALE_GRANULARITIES]
    if not out or bad:
        raise argparse.ArgumentTypeError(
            f"unknown granularity {bad[:1] or text!r}; accepted: {', '.join(KV_SCALE_GRANULARITIES)}"
        )
    return out


def parse_baseline(text: str) -> str:
    """A format entry to compare every row with, or "none"."""
    if text != "none":
        parse_format_list(text)
    return text


def cmd_eval(a: argparse.Namespace) -> int:
    if getattr(a, "remote", None):
        from pagoda.node_agent.cli.eval_remote import cmd_eval_remote

        return cmd_eval_remote(a)
    if a.tools:
        return cmd_eval_tools(a)
    entries = a.formats
    if a.prefill_weights or a.prefill_kv:  # the prefill flags apply to every short entry
        pre = f"{a.prefill_weights or 'bf16'}/{a.prefill_kv or 'bf16'}"
        entries = [e if e.count("/") == 3 else f"{pre}/{e}" for e in entries]
        for e in entries:
            PhaseFormats.parse(e)
    result = bench_eval(
        engine_config_from_args(a),
        entries,
        max_new_tokens=a.max_new_tokens or 24,
        num_prompts=a.num_prompts or len(EVAL_PROMPTS),
        max_text_tokens=a.max_text_tokens,
        threads=a.threads,
        baseline=None if a.baseline == "none" else a.baseline,
        kv_granularities=a.kv_scale_granularities,
    )
    write_result(a.json, result, lambda p: plot_eval(p, result), eval_command(a))
    return 0


def eval_command(a: argparse.Namespace) -> str:
    """The ``pagoda eval`` command line that produced ``a`` (flags that differ from the defaults)."""
    from pagoda.node_agent.cli.bench import command_line

    return command_line(a, ["pagoda", "eval"], getattr(a, "eval_parser", None))


def cmd_eval_tools(a: argparse.Namespace) -> int:
    """``pagoda eval --tools``: tool-call validity and exact-match per format, constrained or not."""
    from pagoda.node_agent.bench.common import engine_factory, set_threads
    from pagoda.node_agent.bench.tool_eval import plot_tool_eval, run_tool_eval
    from pagoda.node_agent.bench.tool_suite import CASES

    set_threads(a.threads)
    cfg = engine_config_from_args(a)
    result = run_tool_eval(
        engine_factory(cfg),
        a.formats,
        max_tokens=a.max_new_tokens or 256,
        num_cases=min(a.num_prompts or len(CASES), len(CASES)),
        kv_memory=cfg.kv_memory or 64 << 20,
    )
    result["model"] = cfg.model
    write_result(a.json, result, lambda p: plot_tool_eval(p, result), eval_command(a))
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
    e.add_argument(
        "--baseline",
        type=parse_baseline,
        default="bf16/bf16",
        help="also compare every row with this entry's run (default bf16/bf16: FP8 KV against bf16 KV); none",
    )
    e.add_argument(
        "--kv-scale-granularities",
        type=parse_granularities,
        default=None,
        help=f"run each FP8 KV entry once per FP8 KV scale granularity ({', '.join(KV_SCALE_GRANULARITIES)})",
    )
    e.add_argument(
        "--tools",
        action="store_true",
        help="score tool calls instead: validity and exact-match on the project's tool-call suite, "
        "with the grammar (tool_choice=required) and without, for each --formats entry "
        "(--max-new-tokens defaults to 256, --num-prompts to the whole suite)",
    )
    e.add_argument("--max-new-tokens", type=int, default=None, help="default 24 (--tools: 256)")
    e.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help=f"default {len(EVAL_PROMPTS)} (--tools: the whole suite)",
    )
    e.add_argument("--max-text-tokens", type=int, default=None, help="score only this many text tokens")
    e.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 is steadier when shared)")
    e.add_argument("--json", default=None, help="write results here (and a PNG bar chart beside it)")
    add_remote_args(e)
    e.set_defaults(func=cmd_eval, eval_parser=e)
