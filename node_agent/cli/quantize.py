"""``pagoda quantize``: write an INT4 or FP8 checkpoint and print the shrink figures."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pagoda.node_agent.cli.engine_args import DEFAULT_MODEL
from pagoda.node_agent.models.quantize import QUANT_FORMATS, format_report, quantize_checkpoint


def cmd_quantize(a: argparse.Namespace) -> int:
    report = quantize_checkpoint(a.model, a.weights, a.out, a.group_size, progress=not a.no_progress)
    print(format_report(report))
    if a.json:
        Path(a.json).write_text(json.dumps(report.as_dict(), indent=2))
    return 0


def add_quantize_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``pagoda quantize``."""
    q = sub.add_parser("quantize", help="write an INT4 or FP8 checkpoint that --model DIR loads")
    q.add_argument("--model", default=DEFAULT_MODEL, help="source: builtin://NAME, a .gguf file or DIR")
    q.add_argument("--weights", choices=QUANT_FORMATS, required=True)
    q.add_argument("--group-size", type=int, default=128, help="INT4 group (32/64/128/256; must divide K)")
    q.add_argument("--out", required=True, help="output directory")
    q.add_argument("--json", default=None, help="also write the size report here")
    q.add_argument("--no-progress", action="store_true")
    q.set_defaults(func=cmd_quantize)
