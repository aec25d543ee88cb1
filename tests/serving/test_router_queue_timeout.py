"""A worker's queue timeout reaches the client through the router intact: the 503, its code
``queue_timeout``, the worker's message and its Retry-After (router, prefill and decode workers in
this process, the prefill worker with one seat and a short maximum queue time)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pagoda.node_agent.serving.api.metrics import metric_sum

from .apps import serve_args
from .live import LiveServer, metrics

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # ~25 s on an idle 2-core machine

TOKEN = "router-queue-timeout-test-token-0123"
MAX_QUEUE_TIME = 1.0
BURST = 24
PROMPT = "Tell me about the lighthouse keepers of the northern coast, their storms and ships. " * 3


@pytest.fixture(scope="module")
def routed(make_engine, tmp_path_factory) -> Iterator[dict[str, Any]]:
    from pagoda.node_agent.cli.serve import build_app

    token_file = tmp_path_factory.mktemp("token") / "token"
    token_file.write_text(TOKEN)
    common = ["--internal-token-file", str(token_file), "--tenant-secret", "s"]
    servers: dict[str, LiveServer] = {}
    try:
        queue = ["--max-queue-time", str(MAX_QUEUE_TIME), "--tenant-queue-share", "1"]
        prefill = make_engine(kv_memory=16 << 20, max_num_seqs=1, max_model_len=256)
        servers["prefill"] = LiveServer(
            build_app(serve_args("--role", "prefill", *common, *queue), engine=prefill)
        )
        decode = make_engine(kv_memory=32 << 20, max_num_seqs=BURST, max_model_len=256)
        dec_args = serve_args("--role", "decode", "--kv-port", "0", *common)
        servers["decode"] = LiveServer(build_app(dec_args, engine=decode))
        for s in servers.values():
            s.start()
        ends = ["--prefill-endpoints", servers["prefill"].url, "--decode-endpoints", servers["decode"].url]
        servers["router"] = LiveServer(build_app(serve_args("--role", "router", *common, *ends))).start()
        urls = {r: s.url for r, s in servers.items()}
        with httpx.Client() as c:  # the router has found both workers ready
            for _ in range(200):
                if c.get(urls["router"] + "/ready").status_code == 200:
                    break
                time.sleep(0.05)
        yield urls
    finally:
        for s in reversed(list(servers.values())):
            s.stop()


async def _one(client: httpx.AsyncClient, i: int, stream: bool) -> dict[str, Any]:
    body = {"model": "smollm2-135m", "prompt": f"{i}. {PROMPT}", "max_tokens": 2, "temperature": 0}
    body["stream"] = stream
    r = await client.post("/v1/completions", json=body)
    out: dict[str, Any] = {"status": r.status_code, "retry_after": r.headers.get("retry-after"), "i": i}
    if r.status_code != 200:
        out["error"] = r.json()["error"]
    return out


async def _burst(url: str) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        return await asyncio.gather(*[_one(client, i, stream=i % 2 == 1) for i in range(BURST)])


def test_a_workers_queue_timeout_passes_through_the_router_intact(routed) -> None:
    results = asyncio.run(_burst(routed["router"]))
    timed_out = [r for r in results if r["status"] == 503]
    assert timed_out, results  # one seat, 24 prefills at once: the later ones outwait 1 s
    for r in results:
        assert r["status"] in (200, 429, 503), r  # never the router's 500 or 502 for a worker's refusal
    for r in timed_out:
        err = r["error"]
        assert err["code"] == "queue_timeout" and "waited" in err["message"], r
        assert "maximum queue time is 1s" in err["message"], r
        assert r["retry_after"] is not None and int(r["retry_after"]) >= 1, r
    assert {r["i"] % 2 for r in timed_out} == {0, 1} or len(timed_out) == 1, results  # both kinds
    pre = metrics(routed["prefill"])
    assert metric_sum(pre, "pagoda_queue_refusals_total", reason="timeout") == len(timed_out)
    for _ in range(10):  # and the stack serves on (the router's view of decode room may lag a poll)
        ok = httpx.post(
            routed["router"] + "/v1/completions",
            json={"model": "smollm2-135m", "prompt": "Hello", "max_tokens": 2},
            timeout=60,
        )
        if ok.status_code != 429:
            break
        time.sleep(float(ok.headers["retry-after"]))
    assert ok.status_code == 200, ok.text
