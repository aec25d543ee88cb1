"""The cost of one tenant's flood of huge prompts to another tenant's token stream.

A live ``pagoda serve`` process (role both) streams ``max_tokens`` tokens to one client
while another sends waves of ``flood`` concurrent prompts of ``prompt_bytes`` bytes (completions
and chat), one wave after the other until the stream ends. Three variants, run in turn:

- ``alone``: the stream with no flood (the baseline gaps);
- ``refused_by_size``: the flood over the byte limit, refused (413) before any tokenizing;
- ``tokenized``: the byte limit lifted above the flood's size, so every flood prompt is tokenized
  on the tokenizer threads and refused by its token count (400): the worst a prompt inside the
  body limit can cost.

Each of the flood variants also runs as ``..._python_switch`` with ``--gil-switch-interval 0``
(Python's own 5 ms GIL switch interval instead of the server's default), to show what the shorter
interval buys. It reports the streaming client's inter-token gaps (p50, p99, max) and the flood's
answers; ``--variants`` picks some.

    python -P -m pagoda.node_agent.bench.prompt_flood --json docs/bench/prompt_flood.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from pagoda.node_agent.bench.common import echo, environment

MODEL = "builtin://smollm2-135m"
ENGINE_FLAGS = [
    "--dtype",
    "float32",
    "--kv-memory",
    "64MiB",
    "--max-num-seqs",
    "8",
    "--max-model-len",
    "2048",
]


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))] if s else 0.0


def stream_gaps(url: str, max_tokens: int) -> list[float]:
    """Seconds between the stream's token chunks (after the first)."""
    import httpx

    body = {
        "model": MODEL,
        "prompt": "Count to one hundred:",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    times: list[float] = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def flood_until(url: str, stop, flood: int, prompt_bytes: int, out=None) -> dict[int, int]:
    """Waves of ``flood`` concurrent huge prompts until ``stop`` is set; answers counted by status
    (also put on the queue ``out``, when the flood runs in a process of its own)."""
    import httpx

    text = ("All work and no play makes Jack a dull boy. " * (prompt_bytes // 44 + 1))[:prompt_bytes]
    bodies = [
        ("/v1/completions", json.dumps({"model": MODEL, "prompt": text, "max_tokens": 4}).encode()),
        (
            "/v1/chat/completions",
            json.dumps(
                {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": text}]}
            ).encode(),
        ),
    ]
    counts: dict[int, int] = {}
    headers = {"content-type": "application/json", "x-pagoda-tenant": "flood"}
    with (
        httpx.Client(timeout=300, limits=httpx.Limits(max_connections=flood)) as c,
        ThreadPoolExecutor(flood) as pool,
    ):
        while not stop.is_set():
            jobs = [
                pool.submit(c.post, url + p, content=b, headers=headers)
                for p, b in (bodies[i % 2] for i in range(flood))
            ]
            for j in jobs:
                code = j.result().status_code
                counts[code] = counts.get(code, 0) + 1
    if out is not None:
        out.put(counts)
    return counts


def run_variant(url: str, max_tokens: int, flood: int, prompt_bytes: int) -> dict:
    """One stream's gaps with (``flood`` > 0) a flood from another process (its own interpreter, so
    the flood's client work does not share this process's GIL with the server)."""
    ctx = multiprocessing.get_context("spawn")
    stop, out = ctx.Event(), ctx.Queue()
    result: dict = {}
    flooder = None
    if flood:
        flooder = ctx.Process(target=flood_until, args=(url, stop, flood, prompt_bytes, out))
        flooder.start()
        time.sleep(3.0)  # the flood is running
    gaps = stream_gaps(url, max_tokens)
    stop.set()
    if flooder is not None:
        result = out.get(timeout=300)
        flooder.join(60)
    return {
        "tokens": len(gaps) + 1,
        "gap_p50_s": round(statistics.median(gaps), 4),
        "gap_p99_s": round(percentile(gaps, 0.99), 4),
        "gap_max_s": round(max(gaps), 4),
        "flood_answers": {str(k): v for k, v in sorted(result.items())},
        "load_average_1m": round(os.getloadavg()[0], 2),  # a shared machine: what else ran
    }


def variant_flags(name: str, prompt_bytes: int) -> list[str] | None:
    """The server flags of a variant (None: not a variant)."""
    base, _, switch = name.partition("_python")
    if switch not in ("", "_switch") or base not in VARIANTS or (switch and base == "alone"):
        return None
    flags = ["--max-prompt-bytes", str(2 * prompt_bytes)] if base == "tokenized" else []
    return flags + (["--gil-switch-interval", "0"] if switch else [])


VARIANTS = ("alone", "refused_by_size", "tokenized")
ALL_VARIANTS = (*VARIANTS, "refused_by_size_python_switch", "tokenized_python_switch")


def bench_prompt_flood(
    flood: int = 16,
    prompt_bytes: int = 1_000_000,
    max_tokens: int = 48,
    variants: tuple[str, ...] = ALL_VARIANTS,
    log=echo,
) -> dict:
    """The variants, each against a ``pagoda serve`` process of its own."""
    from pagoda.node_agent.serving import launch
    from pagoda.node_agent.serving.api.prompt_limits import default_prompt_bytes

    limit = default_prompt_bytes(int(ENGINE_FLAGS[ENGINE_FLAGS.index("--max-model-len") + 1]))
    out: dict[str, dict] = {}
    for name in variants:
        extra = variant_flags(name, prompt_bytes)
        if extra is None:
            raise ValueError(f"unknown variant {name!r}; known: {', '.join(ALL_VARIANTS)}")
        port = launch.free_port()
        proc = launch.start_server(["--model", MODEL, *ENGINE_FLAGS, *extra], port)
        url = f"http://127.0.0.1:{port}"
        try:
            stream_gaps(url, 4)  # warm-up
            out[name] = run_variant(url, max_tokens, 0 if name == "alone" else flood, prompt_bytes)
            out[name]["server_flags"] = extra
        finally:
            launch.stop([proc])
        log(f"{name}: {out[name]}")
    return {
        "bench": "prompt_flood",
        "flood": flood,
        "prompt_bytes": prompt_bytes,
        "max_tokens": max_tokens,
        "byte_limit": limit,
        "engine_flags": ENGINE_FLAGS,
        "variants": out,
    }


def tokenizer_gil(prompt_bytes: int = 1 << 20) -> dict:
    """How long the built-in tokenizer holds the GIL while encoding ``prompt_bytes`` of text: the
    longest gap a thread ticking every millisecond sees, through the tokenizer the engine uses
    (transformers' fast tokenizer, which encodes as a batch, GIL released) and through the Rust
    tokenizer's single ``encode`` (GIL held)."""
    from pagoda.node_agent.models.loader import load_model
    from pagoda.node_agent.models.tokenizer import Tokenizer

    loaded = load_model(MODEL)
    tok = Tokenizer(loaded.tokenizer_dir, loaded.gguf_file)
    text = ("The quick brown fox jumps over the lazy dog. " * (prompt_bytes // 45 + 1))[:prompt_bytes]
    ways = {
        "engine_tokenizer": lambda: tok.encode(text),
        "rust_single_encode": lambda: tok._tok._tokenizer.encode(text).ids,
    }
    out: dict = {"prompt_bytes": prompt_bytes}
    for name, fn in ways.items():
        stop, gaps = threading.Event(), [0.0]

        def tick(stop=stop, gaps=gaps) -> None:
            last = time.perf_counter()
            while not stop.is_set():
                time.sleep(0.001)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        t = threading.Thread(target=tick)
        t.start()
        t0 = time.perf_counter()
        n = len(fn())
        took = time.perf_counter() - t0
        stop.set()
        t.join()
        out[name] = {"tokens": n, "encode_s": round(took, 3), "max_tick_gap_ms": round(1000 * max(gaps), 1)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flood", type=int, default=16)
    p.add_argument("--prompt-bytes", type=int, default=1_000_000)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--json", default=None)
    p.add_argument(
        "--variants", default=",".join(ALL_VARIANTS), help="comma-separated: " + ", ".join(ALL_VARIANTS)
    )
    p.add_argument("--tokenizer-gil", action="store_true", help="only measure the tokenizer's GIL holding")
    argv = sys.argv[1:] if argv is None else argv
    a = p.parse_args(argv)
    if a.tokenizer_gil:
        print(json.dumps(tokenizer_gil(a.prompt_bytes), indent=2))
        return 0
    names = tuple(v.strip() for v in a.variants.split(",") if v.strip())
    result = bench_prompt_flood(a.flood, a.prompt_bytes, a.max_tokens, names)
    result.update(environment("python -P -m pagoda.node_agent.bench.prompt_flood " + " ".join(argv or [])))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
