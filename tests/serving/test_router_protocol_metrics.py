"""A router's /metrics carries the inference extension's model-server protocol gauges, summed over
its workers from their /internal/state answers (fake workers: no engine, no network)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from pagoda.node_agent.serving.api.internal_auth import InternalAuth
from pagoda.node_agent.serving.api.metrics import ServeMetrics, metric_sum, parse_metrics
from pagoda.node_agent.serving.router.router import Router, RouterSettings

STATES: dict[str, dict[str, Any]] = {
    "http://p:1": {"ready": True, "kv_capacity_tokens": 4096, "kv_free_tokens": 4096, "running": 1, "waiting": 2},
    "http://d:1": {"ready": True, "kv_capacity_tokens": 1000, "kv_free_tokens": 250, "running": 5, "waiting": 3},
    "http://d:2": {"ready": True, "kv_capacity_tokens": 1000, "kv_free_tokens": 750, "running": 2, "waiting": 0},
    # Down: refuses the internal token; its figures are not counted.
    "http://d:3": {"ready": True, "kv_capacity_tokens": 9000, "kv_free_tokens": 0, "running": 9, "waiting": 9},
}  # fmt: skip


def _router() -> Router:
    settings = RouterSettings(["http://p:1"], ["http://d:1", "http://d:2", "http://d:3"], model_name="smollm")
    router = Router(settings, ServeMetrics("router"), InternalAuth("t" * 32))

    async def send(method: str, url: str, **_: Any) -> httpx.Response:
        worker = url.removesuffix("/internal/state")
        if worker == "http://d:3":
            return httpx.Response(403, json={"error": "bad token"})
        return httpx.Response(200, json=STATES[worker])

    router._client = object()  # type: ignore[assignment]  # _send is replaced: no client is used
    router._send = send  # type: ignore[method-assign]
    return router


def test_the_router_exports_the_protocol_gauges_of_its_ready_workers() -> None:
    router = _router()
    before = parse_metrics(router.metrics.render().decode())
    assert metric_sum(before, "vllm:num_requests_waiting") == 0  # nothing known yet: no load claimed
    asyncio.run(router.poll())
    m = parse_metrics(router.metrics.render().decode())
    assert m['vllm:num_requests_waiting{model_name="smollm"}'] == 2 + 3 + 0
    assert m['vllm:num_requests_running{model_name="smollm"}'] == 1 + 5 + 2
    # KV use over the ready decode workers: (750 + 250) tokens used of 2000.
    assert m['vllm:kv_cache_usage_perc{model_name="smollm"}'] == pytest.approx(0.5)
    assert m['vllm:gpu_cache_usage_perc{model_name="smollm"}'] == pytest.approx(0.5)
    assert m['pagoda_router_worker_ready{pool="router",role="decode",worker="http://d:3"}'] == 0.0


def test_a_worker_going_down_leaves_the_sums() -> None:
    router = _router()
    asyncio.run(router.poll())
    router.decode[0].mark_down("test")
    m = parse_metrics(router.metrics.render().decode())
    assert m['vllm:num_requests_running{model_name="smollm"}'] == 1 + 2
    assert m['vllm:kv_cache_usage_perc{model_name="smollm"}'] == pytest.approx(0.25)
