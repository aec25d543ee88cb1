"""The ``pagoda`` command line: generate, serve, bench, quantize, eval."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from pagoda.node_agent.engine.config import (
    ConfigError,
    EngineConfig,
    PhaseFormats,
    parse_bytes,
)
from pagoda.node_agent.engine.sequence import RequestError, SamplingParams
from pagoda.node_agent.models.config import ModelLoadError
from pagoda.vocabulary import INTEGRITY_MODES, KV_CACHE_FORMATS, WEIGHT_FORMATS

DEFAULT_MODEL = "builtin://smollm2-135m"


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Flags every command that runs the model shares."""
    p.add_argument(
        "--model", default=DEFAULT_MODEL, help="builtin://NAME, hf-dir:///DIR, a .gguf file or DIR"
    )
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="weights/activations/KV precision (float32 is the reference precision)",
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--prefill-weights", choices=WEIGHT_FORMATS, default=None)
    p.add_argument("--prefill-kv", choices=KV_CACHE_FORMATS, default=None)
    p.add_argument("--decode-weights", choices=WEIGHT_FORMATS, default=None)
    p.add_argument("--decode-kv", choices=KV_CACHE_FORMATS, default=None)
    p.add_argument("--kv-memory", default=None, help="KV cache budget, e.g. 512MiB (default: 1GiB on CPU)")
    p.add_argument("--kv-memory-fraction", type=float, default=0.9, help="of free GPU memory (CUDA)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument(
        "--int4-group-size",
        type=int,
        default=None,
        help="INT4 group size (default: 128 where it divides K, else 64, else 32)",
    )
    p.add_argument("--integrity", choices=INTEGRITY_MODES, default="enforce")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument(
        "--enable-fault-injection",
        action="store_true",
        help="integrity drills and tests only: allow injecting KV faults (never for production)",
    )
    p.add_argument("--kernels", default=None, help="force a kernel backend: reference, cpu or triton")


def engine_config_from_args(a: argparse.Namespace) -> EngineConfig:
    explicit = any(
        getattr(a, n, None) for n in ("prefill_weights", "prefill_kv", "decode_weights", "decode_kv")
    )
    # float32 is the reference precision: dense weights and KV unless formats are asked for
    f = PhaseFormats.reference() if a.dtype == "float32" and not explicit else PhaseFormats()
    for name in ("prefill_weights", "prefill_kv", "decode_weights", "decode_kv"):
        if getattr(a, name, None):
            setattr(f, name, getattr(a, name))
    return EngineConfig(
        model=a.model,
        dtype=a.dtype,
        device=a.device,
        formats=f,
        kv_memory=parse_bytes(a.kv_memory) if a.kv_memory else None,
        kv_memory_fraction=a.kv_memory_fraction,
        page_size=a.page_size,
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
        max_model_len=a.max_model_len,
        integrity=a.integrity,
        int4_group_size=getattr(a, "int4_group_size", None),
        enable_prefix_caching=not a.no_prefix_caching,
        fault_injection=getattr(a, "enable_fault_injection", False),
        kernel_backend=a.kernels,
    )


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

    from pagoda.node_agent.bench import decode as bench_cli
    from pagoda.node_agent.bench import evaluate
    from pagoda.node_agent.models import quantize

    bench_cli.add_bench_parser(sub, add_engine_args)
    quantize.add_quantize_parser(sub, DEFAULT_MODEL)
    evaluate.add_eval_parser(sub, add_engine_args)
    from pagoda.node_agent.cli import serve as serve_cli

    serve_cli.register_serve(sub, add_engine_args)
    serve_cli.register_bench_serve(sub, add_engine_args)
    return ap


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    ap = build_parser()
    a = ap.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if a.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return a.func(a)
    except (ConfigError, ModelLoadError, RequestError, ValueError) as exc:
        print(f"pagoda: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
