"""A live decode worker's KV port under hostile peers (in-process prefill and decode workers): idle
and trickling unauthenticated connections do not make a legitimate handoff fail, and pages with
NaN, infinity or absurd values are refused with a clear error, counted, and leave nothing held."""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

from pagoda.node_agent.engine.handoff import KVPayload
from pagoda.node_agent.serving.api.internal_auth import InternalAuth
from pagoda.node_agent.serving.api.metrics import metric_sum
from pagoda.node_agent.serving.worker.kv_limits import KVLimits
from pagoda.node_agent.serving.worker.kv_transport import TcpKVSender, TransferError

from .live import LiveServer, metrics

pytestmark = pytest.mark.timeout(300)

TOKEN = "kv-port-live-test-token-0123456789"
AUTH = InternalAuth(TOKEN)
IDLE = 64


def _app(role: str, engine, token_file) -> object:
    from pagoda.node_agent.cli.serve import add_serve_args, build_app

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin://smollm2-135m")
    ap.add_argument("--no-prefix-caching", action="store_true")
    add_serve_args(ap)
    args = ap.parse_args(["--role", role, "--internal-token-file", str(token_file), "--kv-port", "0"])
    return build_app(args, engine=engine)


@pytest.fixture(scope="module")
def pair(make_engine, tmp_path_factory) -> Iterator[dict[str, Any]]:
    token_file = tmp_path_factory.mktemp("token") / "token"
    token_file.write_text(TOKEN)
    servers, engines = {}, {}
    try:
        for role in ("prefill", "decode"):
            engines[role] = make_engine(kv_memory=16 << 20, max_num_seqs=4, max_model_len=256)
            servers[role] = LiveServer(_app(role, engines[role], token_file)).start()
        yield {"urls": {r: s.url for r, s in servers.items()}, "decode_engine": engines["decode"]}
    finally:
        for s in servers.values():
            s.stop()


def signed(method: str, url: str, path: str, **kw: Any) -> httpx.Response:
    return httpx.request(method, url + path, headers=AUTH.headers(method, path), timeout=60, **kw)


def state(pair: dict[str, Any]) -> dict[str, Any]:
    return signed("GET", pair["urls"]["decode"], "/internal/state").json()


class Parked:
    """A decode request parked on the decode worker (as the router opens one)."""

    def __init__(self, pair: dict[str, Any], client: httpx.Client) -> None:
        path = "/internal/decode"
        req = client.build_request(
            "POST",
            pair["urls"]["decode"] + path,
            json={"params": {"max_tokens": 2, "temperature": 0.0}, "timeout_s": 60},
        )
        req.headers.update(AUTH.headers("POST", path))
        self.resp = client.send(req, stream=True)
        self.lines = self.resp.iter_lines()
        first = json.loads(next(self.lines))
        self.ticket, self.kv_address, self.grant = first["ticket"], first["kv_address"], first["grant"]

    def rest(self) -> list[dict[str, Any]]:
        out = [json.loads(x) for x in self.lines if x.strip()]
        self.resp.close()
        return out


def legit_handoff(pair: dict[str, Any], prompt: str) -> tuple[httpx.Response, list[dict[str, Any]]]:
    """The router's part of one request: park on decode, prefill with the grant, read the stream."""
    with httpx.Client(timeout=60) as c:
        parked = Parked(pair, c)
        body = {
            "prompt": prompt,
            "params": {"max_tokens": 2, "temperature": 0.0},
            "ticket": parked.ticket,
            "kv_address": parked.kv_address,
            "grant": parked.grant,
        }
        r = signed("POST", pair["urls"]["prefill"], "/internal/prefill", json=body)
        return r, parked.rest()


def wait_released(pair: dict[str, Any], timeout: float = 20) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while True:
        counts = state(pair)["kv_receiver"]
        if not any(counts.values()) or time.monotonic() > deadline:
            return counts
        time.sleep(0.05)


def test_idle_and_slow_unauthenticated_connections_do_not_fail_a_legitimate_handoff(pair) -> None:
    host, _, port = state(pair)["kv_address"].rpartition(":")
    idle = [socket.create_connection((host, int(port)), timeout=10) for _ in range(IDLE)]
    slow = [socket.create_connection((host, int(port)), timeout=10) for _ in range(8)]
    try:
        for s in slow:  # the start of a KV frame, and then nothing more
            s.sendall(b"PGKV\x02\x01")
        for prompt in ("The capital of France is", "def fibonacci(n):"):
            r, lines = legit_handoff(pair, prompt)
            assert r.status_code == 200 and r.json()["status"] == "handed_off", r.text
            assert lines and lines[-1]["chunk"]["finished"], lines[-1:]
        held = state(pair)["kv_receiver"]
        assert held["handoffs"] == 0 and held["reserved_pages"] == 0  # the idle ones hold no slot
    finally:
        for s in idle + slow:
            s.close()
    assert wait_released(pair) == {"connections": 0, "unauthenticated": 0, "handoffs": 0, "reserved_pages": 0}
    m = metrics(pair["urls"]["decode"])
    evicted = metric_sum(m, "pagoda_kv_transfer_failures_total", reason="evicted")
    assert evicted >= IDLE + 8 - 32  # over 32 unauthenticated from one peer, the oldest were closed


def poisoned(engine, value: float) -> KVPayload:
    lim = KVLimits.for_engine(engine)
    ids = list(range(10, 10 + lim.page_size + 3))  # two pages
    n = -(-len(ids) // lim.page_size)
    g = torch.Generator().manual_seed(0)
    layers = [
        {c: torch.randn(n, lim.page_size, *shape, generator=g) for c, shape in lim.component_shapes.items()}
        for _ in range(lim.num_layers)
    ]
    layers[-1]["v"][n - 1, 2, 0, 1] = value  # one value of one page of one request
    return KVPayload("poisoned", ids, 42, lim.page_size, "bf16", layers)


@pytest.mark.parametrize(
    "value,reason", [(float("nan"), "non_finite"), (float("inf"), "non_finite"), (3e38, "out_of_range")]
)
def test_non_finite_or_out_of_range_pages_are_refused_counted_and_released(pair, value, reason) -> None:
    url = pair["urls"]["decode"]
    before = metric_sum(metrics(url), "pagoda_kv_transfer_failures_total", reason=reason)
    free = state(pair)["kv_free_tokens"]
    with httpx.Client(timeout=60) as c:
        parked = Parked(pair, c)
        payload = poisoned(pair["decode_engine"], value)
        with pytest.raises(TransferError, match="KV pages hold"):
            asyncio.run(TcpKVSender(AUTH).send(parked.kv_address, parked.ticket, payload))
        lines = parked.rest()
    err = lines[-1]["error"]
    assert err["code"] == "kv_transfer_failed" and "KV pages hold" in err["message"], err
    after = metric_sum(metrics(url), "pagoda_kv_transfer_failures_total", reason=reason)
    assert after - before == 1
    assert wait_released(pair)["reserved_pages"] == 0 and state(pair)["kv_free_tokens"] == free
    r, lines = legit_handoff(pair, "Once upon a time")  # and the worker still serves
    assert r.status_code == 200 and lines[-1]["chunk"]["finished"]


WARM_UP, ROUNDS = 6, 60
RSS_MARGIN = 48 << 20  # bytes: keeping one payload a round would pass it (the test checks that)


def _refused_round(pair, value: float) -> None:
    with httpx.Client(timeout=60) as c:
        parked = Parked(pair, c)
        with pytest.raises(TransferError, match="KV pages hold"):
            asyncio.run(
                TcpKVSender(AUTH).send(
                    parked.kv_address, parked.ticket, poisoned(pair["decode_engine"], value)
                )
            )
        assert parked.rest()[-1]["error"]["code"] == "kv_transfer_failed"


def test_repeated_poisoned_handoffs_are_all_counted_and_memory_does_not_grow(pair) -> None:
    """Many NaN / infinity / out-of-range handoffs in a row: each refused and counted, no page left
    reserved or in use, and this process's RSS (both workers run in it) flat after a warm-up."""
    import gc

    import psutil

    url, values = pair["urls"]["decode"], (float("nan"), float("-inf"), -3e38)
    reasons = ("non_finite", "out_of_range")

    def refused() -> float:
        m = metrics(url)
        return sum(metric_sum(m, "pagoda_kv_transfer_failures_total", reason=r) for r in reasons)

    free = state(pair)["kv_free_tokens"]
    for k in range(WARM_UP):
        _refused_round(pair, values[k % 3])
    gc.collect()
    proc = psutil.Process()
    rss_warm, before = proc.memory_info().rss, refused()
    for k in range(ROUNDS):
        _refused_round(pair, values[k % 3])
    gc.collect()
    grown = proc.memory_info().rss - rss_warm
    assert refused() - before == ROUNDS
    assert wait_released(pair)["reserved_pages"] == 0 and state(pair)["kv_free_tokens"] == free
    assert metric_sum(metrics(url), "pagoda_kv_pages_used") == 0
    sample = poisoned(pair["decode_engine"], 0.0)
    payload_bytes = sum(t.numel() * t.element_size() for layer in sample.layers for t in layer.values())
    assert grown < RSS_MARGIN, (grown, payload_bytes)  # ROUNDS payloads kept would be ROUNDS * payload_bytes
    assert ROUNDS * payload_bytes > RSS_MARGIN  # so the margin can catch a payload kept per round
