"""The Gateway API inference extension's model-server protocol on a router's /metrics.

An ``InferencePool`` over the router pods (``spec.router.gateway``) has its endpoint picker scrape
each member for the protocol's gauges (``vllm:num_requests_waiting`` and the others, the names
the engines export: serving/api/metrics.py). A router holds no engine, so it exports them
summed over the workers it routes to, from what their ``/internal/state`` last said: queued and
running requests over every ready worker, KV-cache use over the ready decode workers (where a
request's KV lives while it generates). Workers marked down count for nothing. No
``vllm:cache_config_info``: the workers' state does not carry their page size. Torch-free.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Protocol

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagoda.node_agent.serving.api.metrics import protocol_gauges


class _Worker(Protocol):
    role: str
    ready: bool
    running: int
    waiting: int
    kv_capacity_tokens: int
    kv_free_tokens: int


def router_gauges(workers: Iterable[_Worker], model: str) -> list[GaugeMetricFamily]:
    """The protocol gauges standing for a router: its ready workers' figures summed."""
    ready = [w for w in workers if w.ready]
    decode = [w for w in ready if w.role == "decode"]
    capacity = sum(w.kv_capacity_tokens for w in decode)
    free = sum(min(w.kv_free_tokens, w.kv_capacity_tokens) for w in decode)
    running, waiting = sum(w.running for w in ready), sum(w.waiting for w in ready)
    return protocol_gauges(model, waiting, running, capacity - free, capacity)


class RouterProtocolCollector(Collector):
    """The protocol gauges of a router, computed at scrape time from its workers."""

    def __init__(self, router: Any, model: str) -> None:
        self.router = router
        self.model = model

    def collect(self) -> Iterator[Metric]:
        yield from router_gauges([*self.router.prefill, *self.router.decode], self.model)
