"""A live ``pagoda serve`` exports the Gateway API inference extension's model-server protocol
metrics (the names an endpoint picker scrapes), mapped from Pagoda's own series."""

from __future__ import annotations

import pytest

from pagoda.node_agent.serving.api.metrics import metric_sum

from .live import metrics, wait_idle

pytestmark = [pytest.mark.serve, pytest.mark.timeout(300)]


def test_the_endpoint_pickers_metrics_follow_pagodas_own(stack) -> None:
    m = wait_idle(stack.url)
    m = metrics(stack.url)
    for name in (
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "vllm:cache_config_info",
    ):
        assert any(key.partition("{")[0] == name for key in m), name
    assert metric_sum(m, "vllm:num_requests_waiting") == metric_sum(m, "pagoda_waiting_sequences")
    assert metric_sum(m, "vllm:num_requests_running") == metric_sum(m, "pagoda_running_sequences")
    capacity = metric_sum(m, "pagoda_kv_capacity_tokens")
    used = metric_sum(m, "pagoda_kv_used_tokens")
    assert capacity > 0
    assert metric_sum(m, "vllm:kv_cache_usage_perc") == pytest.approx(used / capacity)
    assert 0.0 <= metric_sum(m, "vllm:gpu_cache_usage_perc") <= 1.0
    info = [key for key in m if key.startswith("vllm:cache_config_info{")]
    pages = metric_sum(m, "pagoda_kv_pages_total")
    assert len(info) == 1 and f'block_size="{int(capacity // pages)}"' in info[0]
