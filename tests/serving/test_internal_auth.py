"""The internal plane's token: where it comes from, request proofs (401/403, counted, single-use,
bound to method and path), grants that pin a ticket's KV pages to its decode worker, validated
internal bodies, a parked ticket's own timeout, and the router's atomic admission."""

from __future__ import annotations

import argparse
import asyncio
import json
import socket

import httpx
import pytest

from pagoda.node_agent.serving.api.internal_auth import (
    HEADER,
    TOKEN_ENV,
    TOKEN_FILE_ENV,
    WINDOW_S,
    InternalAuth,
    TokenError,
    auth_for_role,
    load_token,
)
from pagoda.node_agent.serving.api.metrics import metric_sum

from .live import LiveServer, metrics

TOKEN = "unit-test-internal-token-0123456789"


# ---------------------------------------------------------------------- the token


def test_token_sources_in_order(tmp_path) -> None:
    flag, envfile = tmp_path / "flag", tmp_path / "env"
    flag.write_text(" from-the-flag-file-0001\n")
    envfile.write_text("from-the-env-file-00002")
    env = {TOKEN_FILE_ENV: str(envfile), TOKEN_ENV: "from-the-env-variable-03"}
    assert load_token(str(flag), env) == "from-the-flag-file-0001"
    assert load_token(None, env) == "from-the-env-file-00002"
    assert load_token(None, {TOKEN_ENV: "from-the-env-variable-03"}) == "from-the-env-variable-03"
    assert load_token(None, {}) is None
    with pytest.raises(TokenError, match="16"):
        load_token(None, {TOKEN_ENV: "short"})
    with pytest.raises(TokenError, match="cannot read"):
        load_token(str(tmp_path / "missing"), {})


@pytest.mark.parametrize("role", ["prefill", "decode", "router"])
def test_roles_with_an_internal_plane_need_a_token(role) -> None:
    with pytest.raises(TokenError) as err:
        auth_for_role(role, None, {})
    msg = str(err.value)
    assert "--internal-token-file" in msg and TOKEN_FILE_ENV in msg and f"${TOKEN_ENV} " in msg
    assert auth_for_role("both", None, {}) is None
    assert isinstance(auth_for_role(role, None, {TOKEN_ENV: TOKEN}), InternalAuth)


# ---------------------------------------------------------------------- request proofs


def test_request_proofs() -> None:
    now = [1_000_000.0]
    auth = InternalAuth(TOKEN, clock=lambda: now[0])
    h = auth.headers("POST", "/internal/prefill")[HEADER]
    assert TOKEN not in h  # the token never travels
    assert auth.check("POST", "/internal/prefill", None)[:2] == (401, "missing")
    assert auth.check("POST", "/internal/prefill", "Bearer " + TOKEN)[:2] == (403, "malformed")
    assert auth.check("POST", "/internal/decode", h)[:2] == (403, "invalid")  # bound to the path
    assert auth.check("GET", "/internal/prefill", h)[:2] == (403, "invalid")  # and the method
    assert InternalAuth("another-token-000000000").check("POST", "/internal/prefill", h)[:2] == (
        403,
        "invalid",
    )
    assert auth.check("POST", "/internal/prefill", h) is None
    assert auth.check("POST", "/internal/prefill", h)[:2] == (403, "replayed")
    old = auth.headers("GET", "/internal/state")[HEADER]
    now[0] += WINDOW_S + 1
    assert auth.check("GET", "/internal/state", old)[:2] == (403, "stale")


def test_grants_pin_a_ticket_to_its_address() -> None:
    auth = InternalAuth(TOKEN)
    g = auth.grant("t1", "10.0.0.5:9000")
    assert auth.check_grant("t1", "10.0.0.5:9000", g)
    assert not auth.check_grant("t1", "203.0.113.9:9000", g)  # re-targeted
    assert not auth.check_grant("t2", "10.0.0.5:9000", g)
    assert not InternalAuth("another-token-000000000").check_grant("t1", "10.0.0.5:9000", g)


# ---------------------------------------------------------------------- live workers


def _app(role: str, engine, token_file) -> object:
    from pagoda.node_agent.cli.serve import add_serve_args, build_app

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin://smollm2-135m")
    ap.add_argument("--no-prefix-caching", action="store_true")
    add_serve_args(ap)
    args = ap.parse_args(["--role", role, "--internal-token-file", str(token_file), "--kv-port", "0"])
    return build_app(args, engine=engine)


@pytest.fixture(scope="module")
def workers(make_engine, tmp_path_factory):
    token_file = tmp_path_factory.mktemp("token") / "token"
    token_file.write_text(TOKEN)
    servers = {}
    try:
        for role in ("prefill", "decode"):
            eng = make_engine(kv_memory=16 << 20, max_num_seqs=4, max_model_len=256)
            servers[role] = LiveServer(_app(role, eng, token_file)).start()
        yield {role: s.url for role, s in servers.items()}
    finally:
        for s in servers.values():
            s.stop()


def signed(method: str, url: str, path: str, **kw) -> httpx.Response:
    return httpx.request(
        method, url + path, headers=InternalAuth(TOKEN).headers(method, path), timeout=30, **kw
    )


def test_internal_endpoints_refuse_missing_and_wrong_proofs(workers) -> None:
    for role, path, method in (
        ("decode", "/internal/state", "GET"),
        ("decode", "/internal/decode", "POST"),
        ("prefill", "/internal/prefill", "POST"),
        ("prefill", "/internal/state", "GET"),
    ):
        url = workers[role]
        r = httpx.request(method, url + path, json={})
        assert r.status_code == 401 and r.json()["error"]["code"] == "internal_auth_missing"
        wrong = InternalAuth("another-token-000000000").headers(method, path)
        r = httpx.request(method, url + path, json={}, headers=wrong)
        assert r.status_code == 403 and r.json()["error"]["code"] == "internal_auth_invalid"
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        for open_path in ("/health", "/ready", "/metrics"):
            assert httpx.get(url + open_path).status_code == 200
    m = metrics(workers["decode"])
    assert metric_sum(m, "pagoda_auth_failures_total", plane="internal", reason="missing") >= 2
    assert metric_sum(m, "pagoda_auth_failures_total", plane="internal", reason="invalid") >= 2
    state = signed("GET", workers["decode"], "/internal/state").json()
    assert state["ready"] is True and state["role"] == "decode"


def test_the_proof_is_checked_before_the_body_is_read(workers) -> None:
    """An unauthenticated client that announces a body and never sends it is answered at once."""
    host, port = workers["decode"].removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /internal/decode HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n")
        head = s.recv(4096)
    assert head.startswith(b"HTTP/1.1 401")


@pytest.mark.parametrize(
    "body,param",
    [
        (b"not json", None),
        (b"[1, 2]", None),
        (b'{"params": "x"}', "params"),
        (b'{"params": {"max_tokens": "5"}}', None),
        (b'{"params": {"max_tokens": true}}', None),
        (b'{"params": {"ignore_eos": 1}}', None),
        (b'{"params": {"stop_token_ids": [-1]}}', None),
        (b'{"params": {"evil": 1}}', None),
        (b'{"params": {"temperature": -1}}', "temperature"),
        (b'{"request_id": 5}', "request_id"),
        (b'{"timeout_s": true}', "timeout_s"),
        (b'{"timeout_s": -1}', "timeout_s"),
        (b'{"timeout_s": 1e9}', "timeout_s"),
    ],
)
def test_malformed_decode_bodies_are_400_json(workers, body, param) -> None:
    r = signed("POST", workers["decode"], "/internal/decode", content=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"] and (param is None or err["param"] == param)


@pytest.mark.parametrize(
    "change",
    [
        {"prompt": 5},
        {"chat": "yes"},
        {"cache_salt": 3},
        {"params": {"top_k": 1.5}},
        {"request_id": ""},
        {"prompt": [{"role": "user"}], "chat": True},
        {"prompt": [10**12]},
    ],
)
def test_malformed_prefill_bodies_are_400_json(workers, change) -> None:
    auth = InternalAuth(TOKEN)
    body = {
        "prompt": "hi",
        "ticket": "t",
        "kv_address": "127.0.0.1:1",
        "grant": auth.grant("t", "127.0.0.1:1"),
    }
    body.update(change)
    r = signed("POST", workers["prefill"], "/internal/prefill", json=body)
    assert r.status_code == 400 and r.json()["error"]["message"], r.text


def test_the_prefill_worker_sends_kv_only_where_a_decode_worker_granted(workers) -> None:
    """An unsigned, re-targeted or borrowed grant is refused before any prefill or connection."""
    trap = socket.socket()
    trap.bind(("127.0.0.1", 0))
    trap.listen(1)
    trap.settimeout(0.05)
    evil = f"127.0.0.1:{trap.getsockname()[1]}"
    auth = InternalAuth(TOKEN)
    base = {"prompt": "Hello there", "ticket": "t1", "params": {"max_tokens": 4}}
    cases = [
        {"kv_address": evil},  # no grant
        {"kv_address": evil, "grant": auth.grant("t1", "127.0.0.1:9")},  # re-targeted
        {"kv_address": evil, "grant": auth.grant("t0", evil)},  # another ticket's grant
        {"kv_address": evil, "grant": InternalAuth("another-token-000000000").grant("t1", evil)},
        {"kv_address": evil, "grant": 5},
    ]
    before = metric_sum(metrics(workers["prefill"]), "pagoda_auth_failures_total", reason="bad_grant")
    try:
        for c in cases:
            r = signed("POST", workers["prefill"], "/internal/prefill", json={**base, **c})
            assert r.status_code == 403 and r.json()["error"]["code"] == "bad_grant", r.text
        with pytest.raises(TimeoutError):
            trap.accept()  # nothing connected
    finally:
        trap.close()
    after = metric_sum(metrics(workers["prefill"]), "pagoda_auth_failures_total", reason="bad_grant")
    assert after - before == len(cases)


def test_a_parked_ticket_without_pages_times_out_and_a_handoff_for_it_then_is_refused(workers) -> None:
    dec = workers["decode"]
    path = "/internal/decode"
    with httpx.Client(timeout=30) as c:
        req = c.build_request("POST", dec + path, json={"timeout_s": 0.3, "params": {"max_tokens": 2}})
        req.headers.update(InternalAuth(TOKEN).headers("POST", path))
        resp = c.send(req, stream=True)
        lines = [json.loads(x) for x in resp.iter_lines() if x.strip()]
    first, last = lines[0], lines[-1]
    assert set(first) == {"kv_address", "ticket", "grant"}
    assert InternalAuth(TOKEN).check_grant(first["ticket"], first["kv_address"], first["grant"])
    assert last["error"]["code"] == "kv_timeout"
    assert signed("GET", dec, "/internal/state").json()["inflight"] == 0


# ---------------------------------------------------------------------- router admission


def test_router_admits_a_request_s_choices_together() -> None:
    from pagoda.node_agent.params import SamplingParams
    from pagoda.node_agent.serving.api.backend import GenRequest
    from pagoda.node_agent.serving.api.errors import ApiError
    from pagoda.node_agent.serving.api.metrics import ServeMetrics
    from pagoda.node_agent.serving.router.router import Router, RouterSettings

    async def main() -> None:
        settings = RouterSettings(["http://127.0.0.1:9"], ["http://127.0.0.1:9"], max_inflight=4)
        router = Router(settings, ServeMetrics("router"), InternalAuth(TOKEN))
        await router.start()  # the workers do not answer: none is ready
        try:
            req = GenRequest("hi", SamplingParams())
            with pytest.raises(ApiError) as e:
                await router.open_all([req] * 5)
            assert e.value.status == 400 and e.value.code == "too_many_choices"
            router.inflight = 2
            with pytest.raises(ApiError) as e:
                await router.open_all([req] * 3)
            assert e.value.status == 429 and e.value.headers["Retry-After"]
            with pytest.raises(ApiError) as e:
                await router.open_all([req] * 2)  # admitted, but no worker is ready
            assert e.value.status == 503 and e.value.code == "no_worker" and e.value.headers["Retry-After"]
            assert router.inflight == 2  # the refused choices gave their slots back
        finally:
            await router.stop()

    asyncio.run(main())


def test_the_router_refuses_what_the_decode_workers_cannot_hold_before_any_prefill(workers) -> None:
    """The decode worker (max_num_seqs 4) reports its room; 5 choices are refused at once with 429,
    and no prompt reaches the prefill worker."""
    from pagoda.node_agent.params import SamplingParams
    from pagoda.node_agent.serving.api.backend import GenRequest
    from pagoda.node_agent.serving.api.errors import ApiError
    from pagoda.node_agent.serving.api.metrics import ServeMetrics, metric_sum, parse_metrics
    from pagoda.node_agent.serving.router.router import Router, RouterSettings

    assert signed("GET", workers["decode"], "/internal/state").json()["max_sequences"] == 4

    def prefill_prompts() -> float:
        m = parse_metrics(httpx.get(workers["prefill"] + "/metrics", timeout=10).text)
        return metric_sum(m, "pagoda_requests_total")

    before = prefill_prompts()

    async def main() -> None:
        settings = RouterSettings([workers["prefill"]], [workers["decode"]], max_inflight=64)
        router = Router(settings, ServeMetrics("router"), InternalAuth(TOKEN))
        await router.start()
        try:
            assert router.ready
            req = GenRequest("hi", SamplingParams(max_tokens=2, temperature=0.0))
            with pytest.raises(ApiError) as e:
                await router.open_all([req] * 5)
            assert e.value.status == 429 and e.value.code == "decode_full" and e.value.headers["Retry-After"]
            assert router.inflight == 0
            handles = await router.open_all([req] * 2)  # what fits still runs
            for h in handles:
                async for _ in h:
                    pass
        finally:
            await router.stop()

    asyncio.run(main())
    assert prefill_prompts() == before + 2  # only the two admitted prompts were prefilled
