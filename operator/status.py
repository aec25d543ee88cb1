"""Aggregation of the node agents' reports into per-pool figures and the mismatch-rate window.

Agents patch ``status.agents.<pod>`` (shape: ``pagoda.agent_report.AgentReport``); every report is
read through ``AgentReport.from_status``, which tolerates older and malformed reports. Everything
here is pure: the reconciler passes the current status, the live pod names and the clock.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pagoda.agent_report import AgentReport, format_time, parse_time

from .spec import POOLS

Obj = dict[str, Any]
Reports = Mapping[str, AgentReport]


@dataclass
class Agents:
    """The agents split by freshness, and the status patch that keeps ``status.agents`` tidy."""

    fresh: dict[str, AgentReport] = field(default_factory=dict)
    stale: dict[str, AgentReport] = field(default_factory=dict)
    pruned: list[str] = field(default_factory=list)
    patch: Obj = field(default_factory=dict)


def classify(agents: Any, pods: set[str] | None, now: dt.datetime, stale_after_s: float) -> Agents:
    """Prune agents of gone pods, mark the ones whose last report is too old as stale."""
    out = Agents()
    for pod, raw in sorted(agents.items() if isinstance(agents, dict) else ()):
        if not isinstance(raw, dict):
            continue
        if pods is not None and pod not in pods:
            out.pruned.append(pod)
            out.patch[pod] = None
            continue
        report = AgentReport.from_status(raw)
        when = report.last_report_time
        stale = when is None or (now - when).total_seconds() > stale_after_s
        (out.stale if stale else out.fresh)[pod] = report
        if report.stale is not stale:
            out.patch[pod] = {"stale": stale}
    return out


def pool_figures(pool: str, fresh: Reports, stale: Reports) -> Obj:
    """Sums over the fresh agents of one pool (stale ones are only counted)."""
    mine = [r for r in fresh.values() if r.pool == pool]
    return {
        "weightBytes": sum(r.weight_bytes for r in mine),
        "kvCapacityTokens": sum(r.kv_capacity_tokens for r in mine),
        "kvUsedTokens": sum(r.kv_used_tokens for r in mine),
        "tokensPerSecond": round(sum((r.tokens_per_second for r in mine), 0.0), 3),
        "runningRequests": sum(r.running_requests for r in mine),
        "waitingRequests": sum(r.waiting_requests for r in mine),
        "integrityChecks": sum(r.integrity.checks for r in mine),
        "integrityMismatches": sum(r.integrity.mismatches for r in mine),
        "requestsAborted": sum(r.integrity.requests_aborted for r in mine),
        "integrityPagesAudited": sum(r.integrity.pages_audited for r in mine),
        "integrityChecksumMismatches": sum(r.integrity.checksum_mismatches for r in mine),
        "reportingAgents": len(mine),
        "readyAgents": sum(1 for r in mine if r.ready),
        "staleAgents": sum(1 for r in stale.values() if r.pool == pool),
    }


def _delta(current: int, base: int) -> int:
    """Counter growth since the snapshot; a smaller value means the agent restarted."""
    return current - base if current >= base else current


def window(
    snapshot: Obj | None,
    fresh: Reports,
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
            if report.pool != pool:
                continue
            prior = base.get(pod) or {}
            checks += _delta(report.integrity.checks, int(prior.get("checks", 0)))
            mismatches += _delta(report.integrity.mismatches, int(prior.get("mismatches", 0)))
        rates[pool] = round(mismatches / checks, 9) if checks > 0 else previous_rates.get(pool, 0.0)
    current = {
        pod: {"checks": r.integrity.checks, "mismatches": r.integrity.mismatches} for pod, r in fresh.items()
    }
    if start is None or (now - start).total_seconds() >= window_s:
        return rates, {"startTime": format_time(now), "counters": current}
    known = set(fresh) if known is None else known
    kept = {pod: c for pod, c in base.items() if pod in known}
    return rates, {"startTime": snapshot["startTime"], "counters": kept}
