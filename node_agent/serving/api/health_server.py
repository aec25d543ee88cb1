"""The one HTTP endpoint of a tensor-parallel follower host (a rank other than 0): ``GET /health``,
200 while its ranks follow rank 0 and 503 before they joined. It runs on uvicorn with the same
connection limits as every other ``pagoda serve`` server (http_limits.py: head timeout, keep-alive
limit, per-client and total caps), in a background thread, so a silent or trickling peer cannot
hold a thread or a connection of the follower any more than of rank 0's API server."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import uvicorn

from pagoda.node_agent.serving.api.http_limits import HttpLimits, uvicorn_config

Receive = Callable[[], Any]
Send = Callable[[dict[str, Any]], Any]


def health_app(joined: Callable[[], bool]) -> Callable[..., Any]:
    """An ASGI app: ``GET /health`` 200 ``{"status": "ok"}`` when ``joined()``, else 503; any other
    path 404 and any other method on /health 405. Request bodies are never read."""

    async def app(scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        if scope["path"] != "/health":
            code, body = 404, {"error": "not found"}
        elif scope["method"] not in ("GET", "HEAD"):
            code, body = 405, {"error": "method not allowed"}
        elif joined():
            code, body = 200, {"status": "ok"}
        else:
            code, body = 503, {"status": "not ready"}
        raw = json.dumps(body).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
        await send({"type": "http.response.start", "status": code, "headers": headers})
        await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else raw})

    return app


class HealthServer:
    """``health_app`` on ``host:port`` under ``limits`` in a daemon thread, until ``stop``."""

    def __init__(
        self, host: str, port: int, joined: Callable[[], bool], limits: HttpLimits | None = None
    ) -> None:
        config = uvicorn_config(health_app(joined), host, port, "warning", limits, lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="pagoda-health", daemon=True)

    def start(self, timeout_s: float = 30.0) -> HealthServer:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the health server did not start (is the port taken?)")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
