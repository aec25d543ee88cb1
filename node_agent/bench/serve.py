"""``pagoda bench serve``: drive a live server with N concurrent streaming clients.

By default it starts ``pagoda serve`` (single process) and then ``pagoda serve --disaggregated``
with the same engine flags, runs a shared-prefix and a unique-prompt workload at every
concurrency against each, and reports throughput, TTFT p50/p95, ITL p50/p95 and the prefix-cache
hit rate (cached / prompt tokens, from ``usage``) as JSON and a PNG. ``--url`` benches a server
that is already running instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Callable

from pagoda.node_agent.bench.decode import bench_prompts, parse_int_list, plot_lines, write_result

SHARED_PREAMBLE = (
    "You are the help desk of a maritime museum. Visitors ask about lighthouses, their keepers, "
    "the lenses, the fog signals and the ships that relied on them. Answer in one friendly "
    "paragraph, mention one concrete detail, and never invent dates or names. "
)
ENGINE_FLAGS = {
    "model": "--model", "dtype": "--dtype", "device": "--device", "prefill_weights": "--prefill-weights",
    "prefill_kv": "--prefill-kv", "decode_weights": "--decode-weights", "decode_kv": "--decode-kv",
    "kv_memory": "--kv-memory", "page_size": "--page-size", "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens", "max_model_len": "--max-model-len",
    "integrity": "--integrity", "kernels": "--kernels",
}  # fmt: skip


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def workload(kind: str, n: int, tag: str) -> list[str]:
    if kind == "shared-prefix":
        return [f"{SHARED_PREAMBLE}Question {i}: {p}" for i, p in enumerate(bench_prompts(n, salt=tag))]
    return bench_prompts(n, salt=tag)


async def one_request(client, model: str, prompt: str, max_tokens: int) -> dict:
    """One streaming completion; TTFT and the gaps between content chunks, tokens from usage."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    first, last, gaps, usage = None, None, [], None
    async with client.stream("POST", "/v1/completions", json=body, headers={"X-Pagoda-Tenant": "bench"}) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            msg = json.loads(line[6:])
            if "error" in msg:
                return {"error": msg["error"].get("message", "error")}
            now = time.perf_counter()
            if msg.get("usage"):
                usage = msg["usage"]
            if msg.get("choices") and msg["choices"][0].get("text"):
                if first is None:
                    first = now
                else:
                    gaps.append(now - last)
                last = now
    if first is None or usage is None:
        return {"error": "no tokens"}
    return {"ttft": first - t0, "gaps": gaps, "end": last, "tokens": usage["completion_tokens"],
            "prompt": usage["prompt_tokens"], "cached": usage["prompt_tokens_details"]["cached_tokens"]}  # fmt: skip


async def run_point(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    import httpx

    queue = list(prompts)
    results: list[dict] = []

    async def worker(c) -> None:
        while queue:
            results.append(await one_request(c, model, queue.pop(0), max_tokens))

    async with httpx.AsyncClient(base_url=url, timeout=300) as c:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(c) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    ttft = [r["ttft"] for r in ok]
    itl = [g for r in ok for g in r["gaps"]]
    prompt = sum(r["prompt"] for r in ok)
    return {
        "requests": len(results), "errors": len(results) - len(ok),
        "throughput_tok_s": sum(r["tokens"] for r in ok) / wall if wall else 0.0,
        "ttft_p50_s": percentile(ttft, 0.5), "ttft_p95_s": percentile(ttft, 0.95),
        "itl_p50_s": percentile(itl, 0.5), "itl_p95_s": percentile(itl, 0.95),
        "prefix_hit_rate": sum(r["cached"] for r in ok) / prompt if prompt else 0.0, "wall_s": wall,
    }  # fmt: skip


def engine_argv(a: argparse.Namespace) -> list[str]:
    out: list[str] = []
    for dest, flag in ENGINE_FLAGS.items():
        v = getattr(a, dest, None)
        if v not in (None, "", False):
            out += [flag, str(v)]
    if getattr(a, "no_prefix_caching", False):
        out.append("--no-prefix-caching")
    return out


def start_server(a: argparse.Namespace, mode: str, port: int) -> subprocess.Popen:
    from pagoda.node_agent.cli.serve import wait_ready

    cmd = [
        sys.executable,
        "-P",
        "-m",
        "pagoda.node_agent.cli.main",
        "serve",
        "--port",
        str(port),
        *engine_argv(a),
    ]
    if mode == "disaggregated":
        cmd.append("--disaggregated")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    wait_ready(f"http://127.0.0.1:{port}", [proc], timeout=a.start_timeout)
    if mode == "disaggregated":
        time.sleep(1.0)  # the router's first health poll
    return proc


def bench_mode(a: argparse.Namespace, mode: str, url: str, model: str) -> list[dict]:
    rows = []
    for kind in ("shared-prefix", "unique"):
        for c in a.concurrency:
            n = max(a.num_requests, c)
            prompts = workload(kind, n, tag=f"{mode[0]}{c}-")
            warm = workload(kind, 1, tag=f"warm-{mode[0]}{c}-")  # seeds the shared preamble, not a prompt
            asyncio.run(run_point(url, model, warm, 1, 2))
            r = asyncio.run(run_point(url, model, prompts, c, a.max_tokens))
            row = {"mode": mode, "workload": kind, "series": f"{mode}/{kind}", "concurrency": c, **r}
            rows.append(row)
            print(
                f"{mode:<14}{kind:<14}{c:>5}{r['throughput_tok_s']:>10.1f}{r['ttft_p50_s']:>9.3f}"
                f"{r['ttft_p95_s']:>9.3f}{r['itl_p50_s']:>9.3f}{r['itl_p95_s']:>9.3f}{r['prefix_hit_rate']:>8.2f}"
                f"{r['errors']:>5}",
                flush=True,
            )
    return rows


def cmd_bench_serve(a: argparse.Namespace) -> int:
    from pagoda.node_agent.cli.serve import free_port

    model = a.model.rstrip("/").rsplit("/", 1)[-1].removesuffix(".gguf")
    print(f"{'mode':<14}{'workload':<14}{'conc':>5}{'tok/s':>10}{'TTFT50':>9}{'TTFT95':>9}{'ITL50':>9}"
          f"{'ITL95':>9}{'hit':>8}{'err':>5}")  # fmt: skip
    rows: list[dict] = []
    bad = [m for m in a.modes if m not in ("single", "disaggregated")]
    if bad:
        raise ValueError(f"--modes: unknown mode(s) {bad}; use single and/or disaggregated")
    if a.url:
        rows += bench_mode(a, "external", a.url.rstrip("/"), model)
    else:
        for mode in a.modes:
            port = free_port()
            proc = start_server(a, mode, port)
            try:
                rows += bench_mode(a, mode, f"http://127.0.0.1:{port}", model)
            finally:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    result = {"bench": "serve", "model": a.model, "max_tokens": a.max_tokens, "num_requests": a.num_requests,
              "engine_args": engine_argv(a), "rows": rows}  # fmt: skip
    write_result(a.json, result, lambda path: plot_lines(
        path, rows, key="series", x="concurrency", y="throughput_tok_s",
        title=f"pagoda serve throughput ({a.model})", ylabel="generated tokens/s (all clients)"))  # fmt: skip
    return 0


def add_bench_serve_parser(bench_sub, add_engine_args: Callable[[argparse.ArgumentParser], None]) -> None:
    s = bench_sub.add_parser("serve", help="live server: throughput, TTFT, ITL, prefix hit rate (both modes)")
    add_engine_args(s)
    s.add_argument("--concurrency", type=parse_int_list, default=[1, 8, 32])
    s.add_argument(
        "--num-requests", type=int, default=32, help="requests per point (at least the concurrency)"
    )
    s.add_argument("--max-tokens", type=int, default=32)
    s.add_argument("--modes", type=lambda t: [m.strip() for m in t.split(",")], default=["single", "disaggregated"],
                   help="single,disaggregated")  # fmt: skip
    s.add_argument("--url", default=None, help="bench this running server instead of starting one")
    s.add_argument("--start-timeout", type=float, default=600)
    s.add_argument("--json", default=None, help="write results here (and a PNG beside it)")
    s.set_defaults(func=cmd_bench_serve)
