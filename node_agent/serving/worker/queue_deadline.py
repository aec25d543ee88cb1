"""Admission by deadline: every request is scheduled, queued with an expected wait that fits the
maximum queue time, or refused at once; a queued request that outwaits it ends with an error.

A request counts as *queued* from its submission until its first token (or its end). The expected
wait of a new request is the number queued ahead of it (itself included) divided by the measured
rate at which queued requests leave the queue (first tokens per second over a sliding window).
Before anything has left the queue there is no measurement, and only the queue's size bounds it.
Fairness: one tenant (one cache salt, see serving/api/tenancy.py) may hold at most
``tenant_share`` of the queue's places, so one tenant cannot fill it.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass

from pagoda.node_agent.serving.api.errors import RequestFailed

RATE_WINDOW_S = 20.0  # departures counted over this many seconds
MIN_RETRY_AFTER_S = 1


class QueueFull(RuntimeError):
    """Too many requests in flight; the caller should answer 429 with Retry-After."""

    retry_after_s: float | None = None  # None: the server's default


class QueueRefused(QueueFull):
    """Refused at admission (the queue cannot take it in time); answered 429 with Retry-After."""

    def __init__(self, message: str, retry_after_s: float, reason: str) -> None:
        super().__init__(message)
        self.retry_after_s = max(MIN_RETRY_AFTER_S, math.ceil(retry_after_s))
        self.reason = reason  # "expected_wait" | "tenant_share"


class QueueTimeout(RequestFailed):
    """Waited in the queue longer than the maximum queue time; the request ended unscheduled."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = max(MIN_RETRY_AFTER_S, math.ceil(retry_after_s))


@dataclass
class QueuePolicy:
    """``max_queue_time_s``: None keeps no deadline (the queue is bounded by its size alone)."""

    max_queue_time_s: float | None = None
    tenant_share: float = 0.5

    def validate(self) -> None:
        if self.max_queue_time_s is not None and self.max_queue_time_s <= 0:
            raise ValueError(f"max queue time must be positive, got {self.max_queue_time_s}")
        if not 0 < self.tenant_share <= 1:
            raise ValueError(f"tenant share must be in (0, 1], got {self.tenant_share}")


class DeadlineQueue:
    """Who is queued, per tenant, and how fast the queue drains (thread-safe under the caller's lock)."""

    def __init__(self, policy: QueuePolicy, places: int) -> None:
        policy.validate()
        self.policy = policy
        self.places = max(1, places)
        self.by_tenant: Counter[str] = Counter()
        self.departures: deque[float] = deque()

    @property
    def enabled(self) -> bool:
        return self.policy.max_queue_time_s is not None

    @property
    def depth(self) -> int:
        return sum(self.by_tenant.values())

    def tenant_cap(self) -> int:
        return max(1, int(self.policy.tenant_share * self.places))

    def rate(self, now: float) -> float | None:
        """Queued requests leaving per second over the window (None before the first departure)."""
        while self.departures and now - self.departures[0] > RATE_WINDOW_S:
            self.departures.popleft()
        if not self.departures:
            return None
        span = max(now - self.departures[0], 1.0)
        return len(self.departures) / span

    def expected_wait(self, n: int, now: float) -> float | None:
        """Seconds until ``n`` new requests would leave the queue (None: nothing measured yet)."""
        rate = self.rate(now)
        return None if rate is None else (self.depth + n) / rate

    def admit(self, tenant: str, n: int, now: float) -> None:
        """Take ``n`` places for ``tenant`` or raise QueueRefused (nothing taken)."""
        if not self.enabled:
            self.by_tenant[tenant] += n
            return
        limit = self.policy.max_queue_time_s
        cap = self.tenant_cap()
        if self.by_tenant[tenant] + n > cap:
            wait = self.expected_wait(0, now) or limit
            raise QueueRefused(
                f"this tenant already has {self.by_tenant[tenant]} requests queued (at most {cap} of "
                f"the queue's {self.places} places)",
                wait,
                "tenant_share",
            )
        wait = self.expected_wait(n, now)
        if wait is not None and wait > limit:
            raise QueueRefused(
                f"the expected queue wait is {wait:.1f}s ({self.depth} queued, "
                f"{self.rate(now):.2f} leave per second), over the maximum queue time of {limit:g}s",
                wait - limit,
                "expected_wait",
            )
        self.by_tenant[tenant] += n

    def leave(self, tenant: str, now: float | None = None) -> None:
        """One request of ``tenant`` left the queue: its first token (``now``) or its end (None)."""
        if self.by_tenant[tenant] <= 1:
            self.by_tenant.pop(tenant, None)
        else:
            self.by_tenant[tenant] -= 1
        if now is not None:
            self.departures.append(now)
