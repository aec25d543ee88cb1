"""A live server whose engine sizes steps by time exports the budget's figures and the preemption
counter on /metrics, and serves concurrent streams with them."""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pagoda.node_agent.serving.api.metrics import metric_sum

from .conftest import MODEL, PROMPTS
from .live import LiveServer, metrics, wait_idle

pytestmark = [pytest.mark.serve, pytest.mark.timeout(300)]


def test_budgeted_server_exports_step_figures(make_engine) -> None:
    from pagoda.node_agent.cli.serve import add_serve_args, build_app

    engine = make_engine(kv_memory=24 << 20, max_num_seqs=8, max_model_len=512, itl_target_ms=0.0)
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin://smollm2-135m")
    ap.add_argument("--no-prefix-caching", action="store_true")
    add_serve_args(ap)
    app = build_app(ap.parse_args(["--tenant-secret", "test-secret", "--max-queue", "16"]), engine=engine)
    server = LiveServer(app).start()
    try:

        def ask(prompt: str) -> dict:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}
            r = httpx.post(server.url + "/v1/completions", content=json.dumps(body), timeout=120,
                           headers={"content-type": "application/json"})  # fmt: skip
            assert r.status_code == 200, r.text
            return r.json()

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            replies = list(pool.map(ask, PROMPTS))
        assert all(r["choices"][0]["text"] for r in replies)
        wait_idle(server.url)
        m = metrics(server.url)
        assert metric_sum(m, "pagoda_step_timed_total", phase="decode") > 0
        assert metric_sum(m, "pagoda_step_actual_seconds_total", phase="decode") > 0
        assert metric_sum(m, "pagoda_step_predicted_seconds_total", phase="decode") > 0
        assert any(k.startswith("pagoda_preemptions_total{") for k in m)
        assert metric_sum(m, "pagoda_preemptions_total") == 0
    finally:
        server.stop()
