"""A live uvicorn server in a background thread, and small HTTP helpers for the serving tests."""

from __future__ import annotations

import threading
import time

import httpx
import uvicorn

from pagoda.node_agent.serving.api.metrics import metric_sum, parse_metrics
from pagoda.node_agent.serving.launch import free_port


class LiveServer:
    """Runs an ASGI app on 127.0.0.1:<free port> until ``stop``."""

    def __init__(self, app) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn-test", daemon=True)

    def start(self, timeout: float = 30) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)


def metrics(url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(url + "/metrics", timeout=10).text)


def wait_idle(url: str, timeout: float = 20) -> dict[str, float]:
    """Wait until no page is used and nothing runs or waits; returns the last metrics."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        busy = (
            metric_sum(m, "pagoda_kv_pages_used")
            + metric_sum(m, "pagoda_running_sequences")
            + metric_sum(m, "pagoda_waiting_sequences")
        )
        if busy == 0 or time.monotonic() > deadline:
            return m
        time.sleep(0.1)
