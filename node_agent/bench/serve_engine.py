"""What ``pagoda bench serve`` sets beside a server's own figures: the engine's step time during a
point (read off the server's ``/metrics``), so the per-token host cost shows as client ITL minus
engine step; and the ``engine`` mode, the same engine stepped in the bench's own process with no
HTTP at all (``bench decode``'s full-batch decode rate), so a server's streaming rate can be read
as a share of its engine's in one run."""

from __future__ import annotations

from collections.abc import Callable

from pagoda.node_agent.bench.common import Variant, paired_ratio, spread
from pagoda.node_agent.serving.api.metrics import metric_sum, parse_metrics

ENGINE_MODE = "engine"
ENGINE_FIGURES = ("decode_tok_s", "decode_step_s", "ttft_s")


def step_counters(metrics_text: str) -> dict[str, float]:
    """The engine's decode steps (its decode pass of a step) and their seconds, from a Pagoda
    server's ``/metrics`` (``{}`` from a server without them: a router, llama-server)."""
    m = parse_metrics(metrics_text)
    names = {"steps": "pagoda_step_timed_total", "step_s": "pagoda_step_actual_seconds_total"}
    if not all(any(k.startswith(n + "{") and 'phase="decode"' in k for k in m) for n in names.values()):
        return {}
    return {key: metric_sum(m, name, phase="decode") for key, name in names.items()}


async def read_counters(client) -> dict[str, float]:
    """``step_counters`` of the server behind ``client``; ``{}`` when it has none or does not say."""
    try:
        r = await client.get("/metrics")
    except Exception:
        return {}
    return step_counters(r.text) if r.status_code == 200 else {}


def host_cost(before: dict, after: dict, gaps: list[float]) -> dict:
    """The engine's mean decode step over a point and the clients' mean inter-token gap beside it.
    The gap beyond the step is what the serving path adds to every token, plus, from two streams
    up, the prefill passes of other requests that ran between two decode steps (None without
    engine counters)."""
    steps = after.get("steps", 0.0) - before.get("steps", 0.0)
    if not before or not after or steps <= 0 or not gaps:
        return {
            "engine_step_s": None,
            "itl_mean_s": sum(gaps) / len(gaps) if gaps else None,
            "host_cost_s": None,
        }
    step = (after["step_s"] - before["step_s"]) / steps
    mean = sum(gaps) / len(gaps)
    return {"engine_step_s": step, "itl_mean_s": mean, "host_cost_s": mean - step}


def engine_variants(
    make_engine: Callable[[], object],
    workload: Callable[[str, int, str], list[str]],
    concurrency: list[int],
    max_tokens: int,
) -> list[Variant]:
    """One variant per workload and concurrency: ``c`` prompts stepped together in this process,
    timed over the decode steps that hold all ``c`` (as ``bench decode``)."""
    from pagoda.node_agent.bench.decode import run_pagoda_decode

    holder: dict[str, object] = {}

    def engine():
        if "engine" not in holder:
            holder["engine"] = make_engine()
        return holder["engine"]

    out = []
    for kind in ("shared-prefix", "unique"):
        for c in concurrency:

            def run(r: int, kind=kind, c=c) -> dict:
                return run_pagoda_decode(engine(), workload(kind, c, f"e{c}-r{r}-"), max_tokens)

            def warm(kind=kind, c=c) -> None:
                run_pagoda_decode(engine(), workload(kind, c, f"warm-e{c}-"), 2)

            out.append(Variant(f"{ENGINE_MODE}/{kind}/{c}", run, warm))
    return out


def stream_versus_engine(rows: list[dict]) -> list[dict]:
    """Each server mode's streaming rate (concurrency / client ITL p50, per repeat) over the engine's
    decode rate at the same workload and concurrency, paired repeat by repeat."""
    by = {(r["mode"], r["workload"], r["concurrency"]): r for r in rows}
    out = []
    for (mode, kind, c), r in by.items():
        e = by.get((ENGINE_MODE, kind, c))
        if mode == ENGINE_MODE or e is None or "itl_p50_s_runs" not in r:
            continue
        stream = [c / x if x else 0.0 for x in r["itl_p50_s_runs"]]
        out.append({"mode": mode, "versus": ENGINE_MODE, "workload": kind, "concurrency": c,
                    "stream_tok_s": spread(stream)["median"],
                    "stream_over_engine": paired_ratio(stream, e["decode_tok_s_runs"])})  # fmt: skip
    return out
