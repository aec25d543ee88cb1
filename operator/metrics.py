"""The operator's own Prometheus metrics: reconcile passes by result, their latency, and errors,
served on ``PAGODA_METRICS_PORT`` (the chart's ``operator.metrics.port``) when it is set."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

REGISTRY = CollectorRegistry(auto_describe=True)
PASSES = Counter(
    "pagoda_operator_reconcile",
    "Reconcile passes of ModelDeployments, by trigger and result (ok or error)",
    ["trigger", "result"],
    registry=REGISTRY,
)
LATENCY = Histogram(
    "pagoda_operator_reconcile_seconds",
    "Duration of one reconcile pass of a ModelDeployment",
    ["trigger"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
    registry=REGISTRY,
)
ERRORS = Counter(
    "pagoda_operator_reconcile_errors",
    "Reconcile passes that raised, by exception type",
    ["trigger", "error"],
    registry=REGISTRY,
)


@asynccontextmanager
async def timed(trigger: str) -> AsyncIterator[None]:
    """Count and time one pass; an exception is counted and re-raised."""
    start = time.perf_counter()
    try:
        yield
    except Exception as err:
        PASSES.labels(trigger, "error").inc()
        ERRORS.labels(trigger, type(err).__name__).inc()
        raise
    else:
        PASSES.labels(trigger, "ok").inc()
    finally:
        LATENCY.labels(trigger).observe(time.perf_counter() - start)


def serve(port: int, addr: str = "0.0.0.0") -> None:  # noqa: S104 - a pod's port
    """Serve ``/metrics`` on ``port`` (a background thread of prometheus_client)."""
    start_http_server(port, addr=addr, registry=REGISTRY)
