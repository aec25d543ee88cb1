"""The integrity drill over HTTP: a single-process server with --enable-fault-injection exposes an
authenticated /internal/faults; an armed fault fails its victim closed with the integrity error
while the other requests finish; the endpoint is absent by default and refused where unsafe."""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import time

import httpx
import pytest

from pagoda.node_agent.serving.api.internal_auth import TOKEN_ENV, TOKEN_FILE_ENV, InternalAuth
from pagoda.node_agent.serving.api.metrics import metric_sum
from pagoda.node_agent.serving.worker.fault_drill import PATH, DrillRefused

from .live import LiveServer, metrics

pytestmark = pytest.mark.timeout(300)

TOKEN = "fault-drill-test-token-0123456789"
AUTH = InternalAuth(TOKEN)


def args(*flags: str) -> argparse.Namespace:
    """``pagoda serve`` arguments as its CLI parses them (engine flags included)."""
    from pagoda.node_agent.cli.engine_args import add_engine_args
    from pagoda.node_agent.cli.serve import add_serve_args

    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    add_serve_args(ap)
    return ap.parse_args(["--model", "builtin://smollm2-135m", "--tenant-secret", "s", *flags])


@pytest.fixture(scope="module")
def drill(make_engine, tmp_path_factory):
    from pagoda.node_agent.cli.serve import build_app

    token_file = tmp_path_factory.mktemp("drill") / "token"
    token_file.write_text(TOKEN)
    a = args("--enable-fault-injection", "--internal-token-file", str(token_file))
    engine = make_engine(kv_memory=16 << 20, max_num_seqs=8, max_model_len=512, fault_injection=True)
    server = LiveServer(build_app(a, engine=engine)).start()
    try:
        yield server.url
    finally:
        server.stop()


def signed(method: str, url: str, **kw) -> httpx.Response:
    return httpx.request(method, url + PATH, headers=AUTH.headers(method, PATH), timeout=30, **kw)


def complete(url: str, prompt: str, max_tokens: int = 6) -> httpx.Response:
    body = {"model": "smollm2-135m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(url + "/v1/completions", json=body, timeout=120)


def aborted(url: str) -> float:
    return metric_sum(metrics(url), "pagoda_integrity_requests_aborted_total")


def test_the_drill_endpoint_needs_the_internal_proof_and_a_valid_body(drill) -> None:
    assert httpx.post(drill + PATH, json={"kind": "flip_tag"}, timeout=10).status_code == 401
    forged = InternalAuth("another-token-0123456789").headers("POST", PATH)
    assert httpx.post(drill + PATH, json={"kind": "flip_tag"}, headers=forged, timeout=10).status_code == 403
    for body in (
        {"kind": "reboot"},
        {"kind": "flip_tag", "count": 0},
        {"kind": "corrupt_page", "request_id": "x"},
    ):
        r = signed("POST", drill, json=body)
        assert r.status_code == 400 and r.json()["error"]["message"], r.text


def test_the_next_request_to_decode_fails_closed_and_the_other_finishes(drill) -> None:
    before = aborted(drill)
    r = signed("POST", drill, json={"kind": "stale_mapping", "count": 1})
    assert r.status_code == 200 and r.json()["armed"]["count"] == 1, r.text
    prompts = ["The capital of France is", "def fibonacci(n):"]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda p: complete(drill, p), prompts))
    codes = sorted(a.status_code for a in answers)
    assert codes == [200, 500], [a.text for a in answers]
    failed = next(a for a in answers if a.status_code == 500).json()["error"]
    assert failed["code"] == "request_failed" and "integrity" in failed["message"].lower(), failed
    ok = next(a for a in answers if a.status_code == 200).json()
    assert ok["choices"][0]["text"]
    assert aborted(drill) - before == 1
    listed = signed("GET", drill).json()
    assert listed["armed"] == [] and listed["injected"][-1]["kind"] == "stale_mapping"


def test_a_named_request_fails_closed_mid_stream(drill) -> None:
    body = {"model": "smollm2-135m", "prompt": "Once upon a time", "max_tokens": 60, "temperature": 0}
    with httpx.stream("POST", drill + "/v1/completions", json={**body, "stream": True}, timeout=120) as s:
        events = s.iter_lines()
        first = next(e for e in events if e.startswith("data: "))
        assert "error" not in first
        deadline = time.monotonic() + 30
        live: list[str] = []
        while not live and time.monotonic() < deadline:
            live = signed("GET", drill).json()["live"]
        assert len(live) == 1
        r = signed("POST", drill, json={"kind": "flip_tag", "request_id": live[0]})
        assert r.status_code == 200, r.text
        rest = [e.removeprefix("data: ") for e in events if e.startswith("data: ")]
    errors = [json.loads(e)["error"] for e in rest if e != "[DONE]" and "error" in json.loads(e)]
    assert errors and "integrity" in errors[-1]["message"].lower(), rest[-3:]


def test_the_drill_is_refused_without_a_token_or_on_a_public_bind(monkeypatch) -> None:
    from pagoda.node_agent.cli.serve import build_app

    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.delenv(TOKEN_FILE_ENV, raising=False)
    with pytest.raises(DrillRefused, match="internal token"):
        build_app(args("--enable-fault-injection"))
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    with pytest.raises(DrillRefused, match="non-loopback"):
        build_app(args("--enable-fault-injection", "--host", "0.0.0.0"))


def test_without_the_flag_there_is_no_drill_endpoint(stack) -> None:
    r = httpx.post(
        stack.url + PATH, json={"kind": "flip_tag"}, headers=AUTH.headers("POST", PATH), timeout=10
    )
    assert r.status_code == 404
