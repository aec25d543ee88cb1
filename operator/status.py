"""Aggregation of the node agents' reports into per-pool figures and the mismatch-rate window.

Each agent writes its report (``pagoda.agent_report.AgentReport``) as an annotation of its own Pod;
every report is read through ``from_annotation``, which tolerates older and malformed reports. The
CR status carries the pool sums and at most N agents, worst first (``worst``), so it stays small
whatever the number of pods. Everything here is pure: the reconciler passes the pods and the clock.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pagoda.agent_report import REPORT_ANNOTATION, AgentReport, format_time, from_annotation, parse_time
from pagoda.vocabulary import WEIGHT_FORMATS

from .spec import POOLS

POOL_LABEL = "pagoda.dev/pool"  # as children.POOL_LABEL
FORMATS_LABEL = "pagoda.dev/formats"  # as children.FORMATS_LABEL: the pod's format generation
# Set by the LeaderWorkerSet controller on the pods of a multi-node pool (as in children).
WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
SET_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"

Obj = dict[str, Any]
Reports = Mapping[str, AgentReport]


@dataclass
class Agents:
    """The agents' reports split by freshness."""

    fresh: dict[str, AgentReport] = field(default_factory=dict)
    stale: dict[str, AgentReport] = field(default_factory=dict)


def reports_of(
    pods: list[Obj], now: dt.datetime | None = None, stale_after_s: float | None = None
) -> dict[str, AgentReport]:
    """The reports the pods carry in their annotation. An engine pod (prefill or decode) older than
    ``stale_after_s`` without a readable report counts as a report with no time, hence stale: an
    agent that cannot write (RBAC, admission policy) shows up instead of vanishing. Other pods
    without one (starting, or the router, which does not report) are left out."""
    out: dict[str, AgentReport] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        name = meta.get("name")
        if not isinstance(name, str) or _worker(meta):
            continue  # a multi-node replica reports through its leader only
        report = from_annotation((meta.get("annotations") or {}).get(REPORT_ANNOTATION))
        if report is None and now is not None and stale_after_s is not None:
            pool = (meta.get("labels") or {}).get(POOL_LABEL)
            created = parse_time(meta.get("creationTimestamp"))
            if pool in POOLS and created is not None and (now - created).total_seconds() > stale_after_s:
                report = AgentReport(version=0, pool=pool)
        if report is not None:
            out[name] = report
    return out


def _worker(meta: Obj) -> bool:
    """A worker pod of a multi-node replica (LWS worker index above 0): it serves no API."""
    return (meta.get("labels") or {}).get(WORKER_INDEX_LABEL, "0") != "0"


def _pod_ready(pod: Obj) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def incomplete_groups(pods: list[Obj], set_name: str, size: int) -> list[tuple[str, int]]:
    """The groups of LeaderWorkerSet ``set_name`` that have pods but fewer than ``size`` ready, as
    (group name, ready pods), by group index. A group is named after its leader pod (``set-N``)."""
    ready: dict[int, int] = {}
    for pod in pods:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        index = labels.get(GROUP_INDEX_LABEL)
        if labels.get(SET_NAME_LABEL) != set_name or not str(index).isdigit():
            continue
        ready[int(index)] = ready.get(int(index), 0) + int(_pod_ready(pod))
    return [(f"{set_name}-{i}", n) for i, n in sorted(ready.items()) if n < size]


def alive_at(
    reports: Reports, renewed: Mapping[str, dt.datetime], now: dt.datetime
) -> dict[str, AgentReport]:
    """The reports with each agent's last sign of life: the later of its report's time and its
    Lease's ``renewTime`` (pagoda/agent_lease.py; never later than ``now``). An agent without a
    Lease keeps its report's time; a pod without a readable report stays without a time."""
    out = dict(reports)
    for pod, report in reports.items():
        when, lease = report.last_report_time, renewed.get(pod)
        if when is not None and lease is not None and lease > when:
            out[pod] = dataclasses.replace(report, last_report_time=min(lease, now))
    return out


def split(reports: Mapping[str, AgentReport], now: dt.datetime, stale_after_s: float) -> Agents:
    """The reports split into fresh and stale (no report time, or older than ``stale_after_s``)."""
    out = Agents()
    for pod, report in sorted(reports.items()):
        when = report.last_report_time
        stale = when is None or (now - when).total_seconds() > stale_after_s
        (out.stale if stale else out.fresh)[pod] = report
    return out


def _load(report: AgentReport) -> float:
    cap = report.kv_capacity_tokens
    return report.kv_used_tokens / cap if cap > 0 else 0.0


def worst(agents: Agents, limit: int) -> list[str]:
    """At most ``limit`` pods, worst first: stale (oldest report first), then those with integrity
    mismatches (most first), then the most loaded (KV usage, then waiting requests)."""
    epoch = dt.datetime.min.replace(tzinfo=dt.UTC)
    stale = sorted(agents.stale, key=lambda p: (agents.stale[p].last_report_time or epoch, p))

    def bad(r: AgentReport) -> int:
        return r.integrity.mismatches + r.integrity.checksum_mismatches

    fresh = sorted(
        agents.fresh,
        key=lambda p: (-bad(agents.fresh[p]), -_load(agents.fresh[p]), -agents.fresh[p].waiting_requests, p),
    )
    return (stale + fresh)[: max(0, limit)]


def agent_entries(agents: Agents, limit: int) -> Obj:
    """``status.agents``: the worst agents' reports, each with the operator's ``stale`` mark."""
    out: Obj = {}
    for pod in worst(agents, limit):
        stale = pod in agents.stale
        report = (agents.stale if stale else agents.fresh)[pod]
        out[pod] = {**report.to_status(), "stale": stale}
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


def resolved_weights(pool: str, pods: list[Obj], fresh: Reports, generation: str) -> str | None:
    """The weight format the fresh agents of ``pool`` in format generation ``generation`` report for
    their phase: what ``auto`` resolved to on this source. None while none reports one, or when
    they differ (only pods of the serving generation count, not the other pair of a blue/green)."""
    seen: set[str] = set()
    for pod in pods:
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        report = fresh.get(meta.get("name", ""))
        if report is None or report.pool != pool or labels.get(POOL_LABEL) != pool:
            continue
        if labels.get(FORMATS_LABEL) != generation:
            continue
        value = getattr(report.formats, f"{pool}_weights", "")
        if value in WEIGHT_FORMATS:  # a peer's value: only a format the engine can run counts
            seen.add(value)
    return next(iter(seen)) if len(seen) == 1 else None


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


def quality_of(pods: list[Obj], fresh: Reports) -> Obj:
    """``status.quality.pools``: per pool the last continuous-probe figures of its fresh agents
    (``AgentReport.quality``, absent until a probe has succeeded): the worst KL, the lowest
    agreements, the latest probe time, how many agents had figures and their failed probes."""
    out: Obj = {}
    for pod in pods:
        report = fresh.get((pod.get("metadata") or {}).get("name", ""))
        q = report.quality if report is not None and report.pool in POOLS else None
        if q is None or q.probes == 0:
            continue
        entry = out.setdefault(report.pool, {"agents": 0, "failures": 0})
        entry["agents"] += 1
        entry["failures"] += q.failures
        entry["kl"] = round(max(entry.get("kl", 0.0), q.mean_kl), 6)
        entry["top1"] = round(min(entry.get("top1", 1.0), q.top1), 4)
        entry["greedyPrefix"] = round(min(entry.get("greedyPrefix", 1.0), q.greedy_prefix), 4)
        if q.last_probe_time is not None:
            at = format_time(q.last_probe_time)
            if entry.get("at") is None or at > entry["at"]:
                entry["at"] = at
    return out
