"""``pagoda eval --tools``: tool-call validity and exact-match per phase format pair, with the
reply constrained by its grammar and without.

Each case of the suite (tool_suite.py) goes through the serving path's own pieces: the chat plan
(template or generic system prompt, the grammar), the engine, and the reply reader (the family's
parser). ``tool_choice`` is ``required``; "unconstrained" drops the grammar and parses free text.
A reply is valid when it holds at least one call and every call names an offered function with
arguments valid against its schema; exact-match compares the first call with the expected one.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from pagoda.node_agent.bench.common import EngineFactory, echo
from pagoda.node_agent.bench.tool_suite import CASES, ToolCase, exact_match
from pagoda.node_agent.engine.config import PhaseFormats
from pagoda.node_agent.params import SamplingParams
from pagoda.node_agent.serving.api.backend import ChatFormat
from pagoda.node_agent.serving.api.chat_output import ChatReader, call_valid
from pagoda.node_agent.serving.api.chat_plan import ChatPlan, plan_chat
from pagoda.node_agent.serving.api.protocol import ChatCompletionRequest
from pagoda.node_agent.serving.worker.chat_format import chat_format_of

MODES = ("constrained", "unconstrained")


def case_request(case: ToolCase, max_tokens: int) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {
            "model": "eval",
            "messages": [{"role": "user", "content": case.prompt}],
            "tools": case.tool_dicts(),
            "tool_choice": "required",
            "max_tokens": max_tokens,
            "temperature": 0.0,
        }
    )


def score_reply(case: ToolCase, plan: ChatPlan, fmt: ChatFormat, text: str) -> tuple[bool, bool]:
    """(valid, exact-match) of one reply."""
    reader = ChatReader(plan, fmt)
    reader.feed(text)
    reader.finish()
    calls = reader.calls
    valid = bool(calls) and reader.tools is not None and reader.tools.invalid == 0
    valid = valid and all(call_valid(c, reader.tools.functions) for c in calls)
    if not calls:
        return valid, False
    try:
        args = json.loads(calls[0]["function"]["arguments"])
    except ValueError:
        return valid, False
    return valid, isinstance(args, dict) and exact_match(case, calls[0]["function"]["name"], args)


def run_mode(engine, fmt: ChatFormat, mode: str, cases: list[ToolCase], max_tokens: int) -> dict[str, Any]:
    """Every case in one batch on ``engine``; the validity and exact-match rates."""
    plans: dict[str, tuple[ToolCase, ChatPlan]] = {}
    for case in cases:
        req = case_request(case, max_tokens)
        plan = plan_chat(req, fmt)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        params.guided = plan.guided if mode == "constrained" else None
        plans[engine.add_request(plan.prompt, params, chat=True)] = (case, plan)
    t0 = time.perf_counter()
    final = engine.run_until_done()
    seconds = time.perf_counter() - t0
    valid = exact = 0
    failures: list[dict[str, str]] = []
    for rid, (case, plan) in plans.items():
        ok, same = score_reply(case, plan, fmt, final[rid].text)
        valid += ok
        exact += same
        if not ok and len(failures) < 3:
            failures.append({"prompt": case.prompt, "reply": final[rid].text[:300]})
    n = len(cases)
    return {
        "mode": mode,
        "cases": n,
        "valid": valid,
        "validity": valid / n,
        "exact": exact,
        "exact_match": exact / n,
        "seconds": round(seconds, 2),
        "failures": failures,
    }


def run_tool_eval(
    make_engine: EngineFactory,
    entries: list[str],
    max_tokens: int = 256,
    num_cases: int = len(CASES),
    modes: tuple[str, ...] = MODES,
    kv_memory: int = 64 << 20,
    log: Callable[[str], None] = echo,
) -> dict[str, Any]:
    """One row per (format entry, mode)."""
    rows = []
    cases = CASES[:num_cases]
    for entry in entries:
        engine = make_engine(formats=PhaseFormats.parse(entry), kv_memory=kv_memory)
        fmt = chat_format_of(engine)
        for mode in modes:
            row = {
                "formats": entry,
                "tool_parser": fmt.tool_parser,
                **run_mode(engine, fmt, mode, cases, max_tokens),
            }
            log(
                f"{entry:>14} {mode:>13}: valid {row['valid']}/{row['cases']} ({100 * row['validity']:.1f}%), "
                f"exact {row['exact']}/{row['cases']} ({100 * row['exact_match']:.1f}%) in {row['seconds']} s"
            )
            rows.append(row)
        engine.close()
        del engine
    return {"kind": "eval-tools", "max_tokens": max_tokens, "rows": rows}


def plot_tool_eval(path, result: dict[str, Any]) -> None:
    """Validity and exact-match per format entry and mode (bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [f"{r['formats']}\n{r['mode']}" for r in rows]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(rows)), 4))
    ax.bar([x - 0.2 for x in xs], [100 * r["validity"] for r in rows], 0.4, label="valid calls %")
    ax.bar([x + 0.2 for x in xs], [100 * r["exact_match"] for r in rows], 0.4, label="exact match %")
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylim(0, 105)
    ax.set_title("Tool-call validity per format (tool_choice=required)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
