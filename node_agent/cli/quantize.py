"""``pagoda quantize``: write an INT4 or FP8 checkpoint, print the shrink figures and optionally
measure it (``--eval``) against the source's float32 weights."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pagoda.kernels.int4 import SUPPORTED_GROUPS
from pagoda.node_agent.cli.engine_args import DEFAULT_MODEL
from pagoda.node_agent.models.int4_quant import ZERO_KINDS, layer_group_size
from pagoda.node_agent.models.quantize import QUANT_FORMATS, format_report, quantize_checkpoint

EVAL_ENTRY = "int4/bf16"  # decode weights as stored, dense KV: the weights' own loss


def group_size_arg(text: str) -> int | None:
    """'auto' -> None (each layer's largest allowed group dividing K); else an integer, checked
    against the supported groups before any work (exit status 2 naming them)."""
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be auto or one of {', '.join(map(str, SUPPORTED_GROUPS))}, got {text!r}"
        ) from None


def _calibration(source: str, loaded, tokenizer) -> tuple[dict, int]:
    """Gram matrices of every linear's inputs on the built-in calibration text (dense float32)."""
    from pagoda.node_agent.engine.calibration import linear_input_grams
    from pagoda.node_agent.engine.config import EngineConfig, PhaseFormats
    from pagoda.node_agent.engine.llm_engine import LLMEngine

    cfg = EngineConfig(
        model=source, dtype="float32", formats=PhaseFormats.reference(), kv_memory=16 << 20, max_model_len=256
    )
    engine = LLMEngine(cfg, loaded=loaded, tokenizer=tokenizer)
    return linear_input_grams(engine)


def _evaluate(source: str, out: str, a: argparse.Namespace) -> dict:
    """``pagoda eval``'s figures for the written checkpoint's INT4 decode weights, with the float32
    reference built from the source (an eval of the checkpoint alone would compare it with its own
    dequantization)."""
    from pagoda.node_agent.bench.common import engine_factory
    from pagoda.node_agent.bench.evaluate import EVAL_PROMPTS, format_table, run_eval
    from pagoda.node_agent.engine.config import EngineConfig, PhaseFormats

    trust = a.trust_remote_code
    ref = engine_factory(EngineConfig(model=source, trust_remote_code=trust))
    ckpt = engine_factory(
        EngineConfig(model=out, kernel_backend=a.eval_kernel_backend, trust_remote_code=trust)
    )

    def make(**kw):
        return (ref if kw.get("formats") == PhaseFormats.reference() else ckpt)(**kw)

    result = run_eval(make, [a.eval_formats], dtype="float32", prompts=EVAL_PROMPTS)
    result["model"], result["reference_model"] = out, source
    print(format_table(result))
    return result


def cmd_quantize(a: argparse.Namespace) -> int:
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    loaded = tokenizer = grams = None
    tokens = 0
    if a.calibrate:
        if a.weights != "int4":
            raise ValueError("--calibrate applies to --weights int4 only")
        if a.group_size is not None:
            layer_group_size(2 * a.group_size, a.group_size)  # a bad value fails before any loading
        from pagoda.node_agent.models.loader import load_model
        from pagoda.node_agent.models.tokenizer import Tokenizer

        loaded = load_model(a.model)
        tokenizer = Tokenizer(loaded.tokenizer_dir, loaded.gguf_file, a.trust_remote_code)
        grams, tokens = _calibration(a.model, loaded, tokenizer)
    report = quantize_checkpoint(
        a.model,
        a.weights,
        a.out,
        a.group_size,
        progress=not a.no_progress,
        loaded=loaded,
        tokenizer=tokenizer,
        float_zero=a.zero == "float",
        calibration=grams,
        calibration_tokens=tokens,
        requantize=a.requantize,
    )
    print(format_report(report))
    result = report.as_dict()
    if a.eval:
        result["eval"] = _evaluate(a.model, a.out, a)
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2))
    return 0


def add_quantize_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``pagoda quantize``."""
    q = sub.add_parser("quantize", help="write an INT4 or FP8 checkpoint that --model DIR loads")
    q.add_argument("--model", default=DEFAULT_MODEL, help="source: builtin://NAME, a .gguf file or DIR")
    q.add_argument("--weights", choices=QUANT_FORMATS, required=True)
    q.add_argument(
        "--group-size",
        type=group_size_arg,
        default=None,
        help="INT4 group: auto (default; per layer the largest of 128/64/32 dividing K) or 32/64/128/256 "
        "forced on every layer (it must divide each K)",
    )
    q.add_argument("--zero", choices=ZERO_KINDS, default="int", help="INT4 zero points: int (0..15) or float")
    q.add_argument(
        "--calibrate",
        action="store_true",
        help="INT4: per group, pick the clip ratio that minimises the output error on the built-in "
        "calibration text's activations",
    )
    q.add_argument(
        "--requantize",
        action="store_true",
        help="quantize weights the source already holds in the target format again from their "
        "dequantized values (default: write them through unchanged)",
    )
    q.add_argument("--out", required=True, help="output directory")
    q.add_argument("--json", default=None, help="also write the report here")
    q.add_argument(
        "--eval",
        action="store_true",
        help="then score the checkpoint's INT4 decode weights against the source's float32 weights "
        "(pagoda eval's KL / top-1 / greedy agreement)",
    )
    q.add_argument("--eval-formats", default=EVAL_ENTRY, help=f"the eval entry (default {EVAL_ENTRY})")
    q.add_argument(
        "--eval-kernel-backend",
        default=None,
        help="kernel backend of the checkpoint's engine in --eval (default: the engine's; 'reference' "
        "dequantizes to float32, isolating the weights' own error from the fast path's arithmetic)",
    )
    q.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 is steadier when shared)")
    q.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="--calibrate / --eval: a trust decision, as for serve: run a tokenizer that is Python code "
        "in the model directory",
    )
    q.add_argument("--no-progress", action="store_true")
    q.set_defaults(func=cmd_quantize)
