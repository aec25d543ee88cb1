"""When a pool's KV mismatch rate stops being known.

The rate is mismatches per check since the window began; with no new checks the previous rate
stands (``status.window``), which alone would keep a burst on a pod that then went away (or a pool
with no traffic) ``KVIntegrityDegraded=True`` for as long as nothing is checked. So once a whole
window (``spec.integrity.windowSeconds``) has passed without a single new check in a pool, its rate
is unknown: ``status.POOL.mismatchRate`` is left out and the condition turns ``Unknown``
(``NoRecentChecks``) until checks resume. The time of each pool's last check stays in the
operator's memory (the window snapshot), not in the status: it would be written on every pass.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from pagoda.agent_report import AgentReport, format_time, parse_time

from .spec import POOLS

Obj = dict[str, Any]

LAST_CHECKS = "lastChecks"  # key of the window snapshot: pool -> time of its last new check
SEEN = "seenChecks"  # key of the window snapshot: pod -> its checks counter at the last pass


def checked_pools(snapshot: Obj | None, fresh: dict[str, AgentReport]) -> tuple[set[str], dict[str, int]]:
    """The pools whose fresh agents made checks since the previous pass, and the counters to keep.
    An agent seen for the first time (or after an operator restart) with checks counts as checking."""
    seen: dict[str, int] = (snapshot or {}).get(SEEN) or {}
    out: set[str] = set()
    for pod, report in fresh.items():
        current = report.integrity.checks
        if current > 0 and current != seen.get(pod):  # grew, or restarted with new checks
            out.add(report.pool)
    return out, {pod: r.integrity.checks for pod, r in fresh.items()}


def decay(
    rates: dict[str, float],
    checked: set[str],
    snapshot_in: Obj | None,
    previous: dict[str, float | None],
    now: dt.datetime,
    window_s: float,
) -> tuple[dict[str, float | None], dict[str, str]]:
    """Per pool the rate, or None once a full window passed without checks; and the last-check
    times to keep. ``previous`` is the rate in the status (None: unknown already, e.g. before an
    operator restart); a rate from before a restart, without a last-check time, starts its window
    now."""
    last: dict[str, str] = dict((snapshot_in or {}).get(LAST_CHECKS) or {})
    out: dict[str, float | None] = {}
    for pool in POOLS:
        when = parse_time(last.get(pool))
        if pool in checked:
            last[pool] = format_time(now)
            out[pool] = rates[pool]
        elif when is None:
            if previous.get(pool) is None:
                out[pool] = None
            else:
                if rates[pool] > 0:
                    last[pool] = format_time(now)
                out[pool] = rates[pool]
        else:
            out[pool] = None if (now - when).total_seconds() >= window_s else rates[pool]
    return out, last
