"""Aggregation of the node agents' reports into per-pool figures and the mismatch-rate window.

Agents patch ``status.agents.<pod>`` (shape in the README, "Agent contract"). Everything here is pure:
the reconciler passes the current status, the live pod names and the clock.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from .spec import POOLS

Obj = dict[str, Any]

SUMMED = (
    "weightBytes",
    "kvCapacityTokens",
    "kvUsedTokens",
    "tokensPerSecond",
    "runningRequests",
    "waitingRequests",
)


def parse_time(value: Any) -> dt.datetime | None:
    """An RFC 3339 timestamp as an aware datetime, or None when absent or malformed."""
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.UTC)


def format_time(value: dt.datetime) -> str:
    """RFC 3339 in UTC with a Z suffix, seconds precision (as Kubernetes writes it)."""
    return value.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Agents:
    """The agents split by freshness, and the status patch that keeps ``status.agents`` tidy."""

    fresh: dict[str, Obj] = field(default_factory=dict)
    stale: dict[str, Obj] = field(default_factory=dict)
    pruned: list[str] = field(default_factory=list)
    patch: Obj = field(default_factory=dict)


def classify(agents: Obj, pods: set[str] | None, now: dt.datetime, stale_after_s: float) -> Agents:
    """Prune agents of gone pods, mark the ones whose last report is too old as stale."""
    out = Agents()
    for pod, report in sorted((agents or {}).items()):
        if not isinstance(report, dict):
            continue
        if pods is not None and pod not in pods:
            out.pruned.append(pod)
            out.patch[pod] = None
            continue
        when = parse_time(report.get("lastReportTime"))
        stale = when is None or (now - when).total_seconds() > stale_after_s
        (out.stale if stale else out.fresh)[pod] = report
        if report.get("stale") is not stale:
            out.patch[pod] = {"stale": stale}
    return out


def _counter(report: Obj, name: str) -> int:
    return int((report.get("integrity") or {}).get(name, 0) or 0)


def pool_figures(pool: str, fresh: dict[str, Obj], stale: dict[str, Obj]) -> Obj:
    """Sums over the fresh agents of one pool (stale ones are only counted)."""
    mine = {pod: r for pod, r in fresh.items() if r.get("pool") == pool}
    figures: Obj = {key: 0 for key in SUMMED}
    figures["tokensPerSecond"] = 0.0
    for report in mine.values():
        for key in SUMMED:
            figures[key] += report.get(key, 0) or 0
    figures["tokensPerSecond"] = round(float(figures["tokensPerSecond"]), 3)
    figures["integrityChecks"] = sum(_counter(r, "checks") for r in mine.values())
    figures["integrityMismatches"] = sum(_counter(r, "mismatches") for r in mine.values())
    figures["requestsAborted"] = sum(_counter(r, "requestsAborted") for r in mine.values())
    figures["reportingAgents"] = len(mine)
    figures["readyAgents"] = sum(1 for r in mine.values() if r.get("ready"))
    figures["staleAgents"] = sum(1 for r in stale.values() if r.get("pool") == pool)
    return figures


def _delta(current: int, base: int) -> int:
    """Counter growth since the snapshot; a smaller value means the agent restarted."""
    return current - base if current >= base else current


def window(
    snapshot: Obj | None,
    fresh: dict[str, Obj],
    now: dt.datetime,
    window_s: float,
    previous_rates: dict[str, float],
    known: set[str] | None = None,
) -> tuple[dict[str, float], Obj]:
    """Mismatch rate per pool since the snapshot, and the snapshot to store.

    rate = delta mismatches / delta checks of the fresh agents since the snapshot; with no new
    checks the previous rate stands. When the snapshot is older than the window it is replaced
    by the current counters (after the rate over the full window was taken). ``known`` are the
    agents still present (fresh or stale); baselines of the others are dropped.
    """
    snapshot = snapshot or {}
    start = parse_time(snapshot.get("startTime"))
    base: Obj = snapshot.get("counters") or {}
    rates: dict[str, float] = {}
    for pool in POOLS:
        checks = mismatches = 0
        for pod, report in fresh.items():
            if report.get("pool") != pool:
                continue
            prior = base.get(pod) or {}
            checks += _delta(_counter(report, "checks"), int(prior.get("checks", 0)))
            mismatches += _delta(_counter(report, "mismatches"), int(prior.get("mismatches", 0)))
        rates[pool] = round(mismatches / checks, 9) if checks > 0 else previous_rates.get(pool, 0.0)
    current = {
        pod: {"checks": _counter(r, "checks"), "mismatches": _counter(r, "mismatches")}
        for pod, r in fresh.items()
    }
    if start is None or (now - start).total_seconds() >= window_s:
        return rates, {"startTime": format_time(now), "counters": current}
    known = set(fresh) if known is None else known
    kept = {pod: c for pod, c in base.items() if pod in known}
    return rates, {"startTime": snapshot["startTime"], "counters": kept}
