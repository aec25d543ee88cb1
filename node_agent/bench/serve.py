"""Serving benchmark (``pagoda bench serve``): drive a live server with N concurrent streaming clients.

By default it starts ``pagoda serve`` (single process) and ``pagoda serve --disaggregated`` with
the same engine flags, both kept up for the whole bench, runs a shared-prefix and a unique-prompt
workload at every concurrency against each, and reports throughput, TTFT p50/p95, ITL p50/p95 and
the prefix-cache hit rate (cached / prompt tokens, from ``usage``), with the common method
(``common.py``): a warm-up request per point, repeats interleaved across the modes, medians with
spread. ``url`` benches a server that is already running instead.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from pagoda.node_agent.bench import llama_server as llama_server_mod
from pagoda.node_agent.bench import serve_engine
from pagoda.node_agent.bench.common import (
    Log,
    Variant,
    bench_prompts,
    echo,
    environment,
    paired_ratio,
    plot_lines,
    run_interleaved,
    summarize,
)
from pagoda.node_agent.serving import launch

SHARED_PREAMBLE = (
    "You are the help desk of a maritime museum. Visitors ask about lighthouses, their keepers, "
    "the lenses, the fog signals and the ships that relied on them. Answer in one friendly "
    "paragraph, mention one concrete detail, and never invent dates or names. "
)
MODES = ("single", "disaggregated")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def eos_token_ids(model_source: str) -> list[int]:
    """The tokens that end a generation of ``model_source`` (its GGUF metadata, else config.json and
    generation_config.json). The bench bans them (``logit_bias`` -100) beside ``ignore_eos``:
    llama-server implements ``ignore_eos`` as such a ban, Pagoda (as vLLM) only does not stop at
    them, and a sampled end-of-turn token has no text, so two tokens share the chunk after it and
    the streams would differ in what they generate, not in speed."""
    from pagoda.node_agent.models.loader import resolve_source

    kind, path = resolve_source(model_source)
    ids: set[int] = set()
    if kind == "gguf":
        import gguf

        reader = gguf.GGUFReader(str(path))
        for key in (
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.eom_token_id",
        ):
            f = reader.fields.get(key)
            if f is not None:
                ids.add(int(f.contents()))
        return sorted(ids)
    for name in ("config.json", "generation_config.json"):
        f = path / name
        v = json.loads(f.read_text()).get("eos_token_id") if f.is_file() else None
        ids.update(
            t for t in (v if isinstance(v, list) else [v]) if isinstance(t, int) and not isinstance(t, bool)
        )
    return sorted(ids)


def workload(kind: str, n: int, tag: str) -> list[str]:
    if kind == "shared-prefix":
        return [f"{SHARED_PREAMBLE}Question {i}: {p}" for i, p in enumerate(bench_prompts(n, salt=tag))]
    return bench_prompts(n, salt=tag)


class StreamTally:
    """What one streamed completion showed: TTFT, the gaps between content chunks, and ``usage``.

    Pagoda sends ``usage`` (with cached tokens) in a last chunk; a server that does not is counted
    one token per content chunk, with no cached tokens."""

    def __init__(self, t0: float) -> None:
        self.t0, self.first, self.last = t0, None, None
        self.gaps: list[float] = []
        self.chunks = 0
        self.usage: dict | None = None
        self.error: str | None = None

    def line(self, line: str, now: float) -> None:
        if not line.startswith("data: ") or line == "data: [DONE]":
            return
        msg = json.loads(line[6:])
        if "error" in msg:
            err = msg["error"]
            self.error = err.get("message", "error") if isinstance(err, dict) else str(err)
            return
        if msg.get("usage"):
            self.usage = msg["usage"]
        if msg.get("choices") and msg["choices"][0].get("text"):
            self.chunks += 1
            if self.first is None:
                self.first = now
            else:
                self.gaps.append(now - self.last)
            self.last = now

    def result(self) -> dict:
        if self.error is not None:
            return {"error": self.error}
        if self.first is None:
            return {"error": "no tokens"}
        u = self.usage or {}
        tokens = u.get("completion_tokens") or self.chunks
        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        tpot = (self.last - self.first) / (tokens - 1) if tokens > 1 else 0.0
        return {"ttft": self.first - self.t0, "gaps": self.gaps, "end": self.last, "tokens": tokens,
                "prompt": u.get("prompt_tokens") or 0, "cached": cached, "tpot": tpot}  # fmt: skip


async def one_request(client, model: str, prompt: str, max_tokens: int, extra: dict | None = None) -> dict:
    """One streaming completion; TTFT and the gaps between content chunks, tokens from usage.
    ``extra``: more body fields (the workload's ``logit_bias``)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}  # fmt: skip
    import httpx

    tally = StreamTally(time.perf_counter())
    for attempt in (0, 1):
        try:
            async with client.stream(
                "POST", "/v1/completions", json=body, headers={"X-Pagoda-Tenant": "bench"}
            ) as r:
                if r.status_code != 200:
                    return {"error": f"HTTP {r.status_code}"}
                async for line in r.aiter_lines():
                    tally.line(line, time.perf_counter())
            return tally.result()
        except httpx.RemoteProtocolError:
            # a kept-alive connection the server had closed (llama-server closes one after a few
            # requests): nothing was answered on it, so it is sent once more on a new connection
            if attempt or tally.first is not None:
                raise
    return tally.result()


async def run_point(
    url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int, extra: dict | None = None
) -> dict:
    import httpx

    queue = list(prompts)
    results: list[dict] = []

    async def worker(c) -> None:
        while queue:
            results.append(await one_request(c, model, queue.pop(0), max_tokens, extra))

    async with httpx.AsyncClient(base_url=url, timeout=300) as c:
        before = await serve_engine.read_counters(c)
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(c) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        after = await serve_engine.read_counters(c)
    ok = [r for r in results if "error" not in r]
    ttft = [r["ttft"] for r in ok]
    itl = [g for r in ok for g in r["gaps"]]
    prompt = sum(r["prompt"] for r in ok)
    return {
        "requests": len(results), "errors": len(results) - len(ok),
        "throughput_tok_s": sum(r["tokens"] for r in ok) / wall if wall else 0.0,
        "ttft_p50_s": percentile(ttft, 0.5), "ttft_p95_s": percentile(ttft, 0.95),
        "itl_p50_s": percentile(itl, 0.5), "itl_p95_s": percentile(itl, 0.95), "itl_p99_s": percentile(itl, 0.99),
        "tpot_p50_s": percentile([r["tpot"] for r in ok], 0.5),
        "prefix_hit_rate": sum(r["cached"] for r in ok) / prompt if prompt else 0.0, "wall_s": wall,
        **serve_engine.host_cost(before, after, itl),
    }  # fmt: skip


POINT_FIGURES = (
    "throughput_tok_s",
    "ttft_p50_s",
    "ttft_p95_s",
    "itl_p50_s",
    "itl_p95_s",
    "itl_p99_s",
    "tpot_p50_s",
    "prefix_hit_rate",
    "wall_s",
)
HOST_FIGURES = ("engine_step_s", "itl_mean_s", "host_cost_s")  # where the server reports its steps


def point_variants(
    mode: str,
    url: str,
    model: str,
    concurrency: list[int],
    num_requests: int,
    max_tokens: int,
    extra: dict | None = None,
) -> list[Variant]:
    """One variant per workload and concurrency against the server at ``url``. Its warm-up seeds the
    shared preamble with one short request (not a measured prompt); each repeat sends fresh prompts
    (with the body fields ``extra``)."""
    out = []
    for kind in ("shared-prefix", "unique"):
        for c in concurrency:
            n = max(num_requests, c)

            def run(r: int, kind=kind, c=c, n=n) -> dict:
                prompts = workload(kind, n, tag=f"{mode[0]}{c}-r{r}-")
                return asyncio.run(run_point(url, model, prompts, c, max_tokens, extra))

            def warm(kind=kind, c=c) -> None:
                asyncio.run(run_point(url, model, workload(kind, 1, tag=f"warm-{mode[0]}{c}-"), 1, 2, extra))

            out.append(Variant(f"{mode}/{kind}/{c}", run, warm))
    return out


def bench_serve(
    model: str,
    engine_argv: list[str],
    concurrency: list[int],
    num_requests: int = 32,
    max_tokens: int = 32,
    modes: list[str] | tuple[str, ...] = MODES,
    url: str | None = None,
    start_timeout: float = 600,
    log: Log = echo,
    repeats: int = 3,
    llama_server: str | None = None,
    llama_server_threads: int | None = None,
    llama_server_args: Sequence[str] = (),
    make_engine: Callable[[], object] | None = None,
) -> dict:
    """Start ``pagoda serve ENGINE_ARGV`` in each of ``modes`` (or use ``url``) and bench it.

    Every server runs for the whole bench, so the modes are interleaved point by point (an idle
    server only answers health polls). ``model`` is the engine's model source; ``engine_argv`` the
    engine flags the servers get. The ``llama-server`` mode runs llama.cpp's server on the same GGUF
    (``llama_server`` names its binary, ``llama_server_args`` are appended to its command line); when
    it cannot run, the result says why instead. The ``engine`` mode steps ``make_engine()`` in this
    process (no server; serve_engine.py)."""
    bad = [m for m in modes if m not in (*MODES, llama_server_mod.MODE, serve_engine.ENGINE_MODE)]
    if bad:
        raise ValueError(
            f"--modes: unknown mode(s) {bad}; use single, disaggregated, llama-server and/or engine"
        )
    if serve_engine.ENGINE_MODE in modes and make_engine is None:
        raise ValueError(
            "--modes engine steps the engine in this process: it needs the engine flags, not --url"
        )
    served = model.rstrip("/").rsplit("/", 1)[-1].removesuffix(".gguf")
    point = {"concurrency": concurrency, "num_requests": num_requests, "max_tokens": max_tokens}
    banned = eos_token_ids(model)  # ignore_eos as llama-server has it: the end tokens are never sampled
    extra = {"logit_bias": {str(t): -100 for t in banned}} if banned else None
    procs = []
    baselines: list[dict] = []
    try:
        urls = {}
        if url:
            urls["external"] = url.rstrip("/")
        else:
            for mode in modes:
                if mode == serve_engine.ENGINE_MODE:
                    continue
                port = launch.free_port()
                if mode == llama_server_mod.MODE:
                    why = llama_server_mod.unavailable(model, llama_server)
                    threads = llama_server_threads or llama_server_mod.default_threads()
                    if why is not None:
                        log(f"llama-server: {why['status']} ({why.get('install') or why.get('detail')})")
                        baselines.append({"mode": mode, **why})
                        continue
                    binary = llama_server_mod.find_binary(llama_server)
                    gguf = llama_server_mod.gguf_file(model)
                    cmd = llama_server_mod.command(
                        binary, gguf, port, threads, max(concurrency), extra=llama_server_args
                    )
                    procs.append(llama_server_mod.start(cmd, port, start_timeout))
                    shown = [gguf.name if a == str(gguf) else a for a in cmd[1:]]  # no local paths in results
                    baselines.append({"mode": mode, "status": "ran", "threads": threads, "command": shown})
                else:
                    procs.append(
                        launch.start_server(engine_argv, port, mode == "disaggregated", start_timeout)
                    )
                urls[mode] = f"http://127.0.0.1:{port}"
        by_mode = {m: point_variants(m, u, served, **point, extra=extra) for m, u in urls.items()}
        if serve_engine.ENGINE_MODE in modes and make_engine is not None:
            by_mode[serve_engine.ENGINE_MODE] = serve_engine.engine_variants(
                make_engine, workload, concurrency, max_tokens
            )
        # interleave: every (workload, concurrency) point runs once per mode, mode after mode
        variants = [v for group in zip(*by_mode.values(), strict=True) for v in group]
        runs = run_interleaved(variants, repeats, log)
    finally:
        launch.stop(procs, timeout=30)
    log(f"{'mode':<14}{'workload':<14}{'conc':>5}{'tok/s':>10}{'TTFT50':>9}{'TTFT95':>9}{'ITL50':>9}"
        f"{'ITL95':>9}{'ITL99':>9}{'hit':>8}{'err':>5}")  # fmt: skip
    rows: list[dict] = []
    for v in variants:
        mode, kind, c = v.name.split("/")
        rs = runs[v.name]
        if mode == serve_engine.ENGINE_MODE:
            r = summarize(rs, serve_engine.ENGINE_FIGURES)
            r["throughput_tok_s"] = r[
                "decode_tok_s"
            ]  # plotted beside the servers: its full-batch decode rate
            rows.append(
                {"mode": mode, "workload": kind, "series": f"{mode}/{kind}", "concurrency": int(c), **r}
            )
            log(
                f"{mode:<14}{kind:<14}{c:>5}  decode {r['decode_tok_s']:.1f} tok/s, step {r['decode_step_s']:.4f} s"
            )
            continue
        host = HOST_FIGURES if all(x.get("engine_step_s") is not None for x in rs) else ()
        r = {"requests": sum(x["requests"] for x in rs), "errors": sum(x["errors"] for x in rs),
             **summarize(rs, (*POINT_FIGURES, *host))}  # fmt: skip
        rows.append({"mode": mode, "workload": kind, "series": f"{mode}/{kind}", "concurrency": int(c), **r})
        log(
            f"{mode:<14}{kind:<14}{c:>5}{r['throughput_tok_s']:>10.1f}{r['ttft_p50_s']:>9.3f}"
            f"{r['ttft_p95_s']:>9.3f}{r['itl_p50_s']:>9.3f}{r['itl_p95_s']:>9.3f}{r['itl_p99_s']:>9.3f}"
            f"{r['prefix_hit_rate']:>8.2f}{r['errors']:>5}"
            + (
                f"  engine step {r['engine_step_s']:.4f} s, host {r['host_cost_s']:+.4f} s/token"
                if host
                else ""
            )
        )
    env = {
        **environment(),
        "threads": None,
        "threads_note": "each server process runs with torch's default threads; llama-server gets the same count",
    }
    return {"bench": "serve", **env, "model": model, "max_tokens": max_tokens, "num_requests": num_requests,
            "repeats": repeats, "engine_args": engine_argv, "eos_banned": banned, "rows": rows, "baselines": baselines,
            "versus": versus(rows), "stream_versus_engine": serve_engine.stream_versus_engine(rows),
            "method": "all servers up for the whole bench; warm-up per point, then repeats interleaved across "
            "modes point by point; median, min, max; errors and requests summed over repeats"}  # fmt: skip


VERSUS = ("throughput_tok_s", "ttft_p50_s", "ttft_p95_s", "itl_p50_s", "itl_p95_s", "itl_p99_s")


def versus(rows: list[dict], base: str = llama_server_mod.MODE) -> list[dict]:
    """Each Pagoda mode over the ``base`` mode at the same workload and concurrency, paired repeat by
    repeat (the repeats are interleaved): median and spread per figure (throughput: higher is
    better; latencies: lower is better)."""
    by = {(r["mode"], r["workload"], r["concurrency"]): r for r in rows}
    out = []
    for (mode, kind, c), r in by.items():
        b = by.get((base, kind, c))
        if mode in (base, serve_engine.ENGINE_MODE) or b is None:
            continue
        ratios = {k: paired_ratio(r[f"{k}_runs"], b[f"{k}_runs"]) for k in VERSUS}
        out.append({"mode": mode, "versus": base, "workload": kind, "concurrency": c, **ratios})
    return out


def plot_serve(path: Path, result: dict) -> None:
    plot_lines(path, result["rows"], key="series", x="concurrency", y="throughput_tok_s",
               title=f"pagoda serve throughput ({result['model']})", ylabel="generated tokens/s (all clients)")  # fmt: skip
