"""The ``pagoda`` command line: generate, serve, bench, quantize, eval."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from pagoda.kernels.selector import KernelSelectionError
from pagoda.node_agent.cli.bench import add_bench_parser
from pagoda.node_agent.cli.engine_args import add_engine_args, engine_config_from_args
from pagoda.node_agent.cli.eval import add_eval_parser
from pagoda.node_agent.cli.quantize import add_quantize_parser
from pagoda.node_agent.cli.serve import add_serve_parser
from pagoda.node_agent.engine.config import ConfigError
from pagoda.node_agent.models.config import ModelLoadError
from pagoda.node_agent.params import RequestError, SamplingParams


def cmd_generate(a: argparse.Namespace) -> int:
    from pagoda.node_agent.engine.llm import LLM

    cfg = engine_config_from_args(a)
    params = SamplingParams(
        max_tokens=a.max_tokens,
        temperature=a.temperature,
        top_k=a.top_k,
        top_p=a.top_p,
        seed=a.seed,
        stop=a.stop or [],
    )
    params.validate()
    llm = LLM(config=cfg)
    outs = llm.generate(a.prompt, params, chat=a.chat)
    for prompt, o in zip(a.prompt, outs, strict=True):
        if a.json:
            print(
                json.dumps(
                    {
                        "prompt": prompt,
                        "text": o.text,
                        "token_ids": o.token_ids,
                        "finish_reason": o.finish_reason,
                    }
                )
            )
        else:
            print(f"--- {prompt!r} -> ({o.finish_reason})\n{o.text}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pagoda", description=__doc__)
    ap.add_argument("-v", "--verbose", action="store_true")
    sub = ap.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate text for one or more prompts")
    add_engine_args(g)
    g.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template as a user turn")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt")
    g.set_defaults(func=cmd_generate)

    add_bench_parser(sub)
    add_quantize_parser(sub)
    add_eval_parser(sub)
    add_serve_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    ap = build_parser()
    a = ap.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if a.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("pagoda.kernels.selector").setLevel(logging.INFO)  # the kernel table, once
    try:
        return a.func(a)
    except (ConfigError, ModelLoadError, RequestError, KernelSelectionError, ValueError) as exc:
        print(f"pagoda: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
