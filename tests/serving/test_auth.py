"""API keys and tenants of the public API: the keys file, 401s before the body is read, key
rotation without a restart, and prefix-cache isolation that a client header cannot get around."""

from __future__ import annotations

import hashlib
import logging
import socket

import httpx
import openai
import pytest

from pagoda.node_agent.serving.api.auth import ApiKeys, ApiKeysError, parse_keys
from pagoda.node_agent.serving.api.metrics import metric_sum

from .apps import live_app, read_response
from .conftest import MODEL
from .live import metrics

ALICE_KEY = "sk-alice-0123456789abcdef"
BOB_KEY = "sk-bob-fedcba9876543210"  # stored in the file only as its sha256
LONG = (
    "You are the archivist of a lighthouse museum. Visitors ask about keepers, lamps, storms and "
    "the ships that passed. Answer in one sentence. Question: when was the lamp first lit?"
)


def keys_text(*extra: str) -> str:
    bob = hashlib.sha256(BOB_KEY.encode()).hexdigest()
    return "\n".join(
        ["# tenants of the test server", f"alice {ALICE_KEY}", "", f"bob sha256:{bob}  # bob", *extra]
    )


# ---------------------------------------------------------------------------- the keys file


def test_a_keys_file_maps_plain_and_hashed_keys_to_tenants(tmp_path) -> None:
    path = tmp_path / "keys"
    path.write_text(keys_text())
    keys = ApiKeys(path)
    assert keys.tenants == {"alice", "bob"}
    assert keys.lookup(ALICE_KEY.encode()) == "alice" and keys.lookup(BOB_KEY.encode()) == "bob"
    assert keys.lookup(b"sk-nobody") is None
    assert keys.check([f"Bearer {BOB_KEY}".encode()]).tenant == "bob"
    assert keys.check([]).reason == "missing"
    assert keys.check([b"Basic abc"]).reason == "malformed" and keys.check([b"Bearer"]).reason == "malformed"
    assert keys.check([b"Bearer a", b"Bearer b"]).reason == "malformed"
    assert keys.check([b"Bearer sk-nobody"]).reason == "unknown"


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("alice\n", 1),
        ("# c\nalice sk-secret-key extra\n", 2),
        ("alice sha256:abcd\n", 1),
        ("alice sk-secret-key\nbob sk-secret-key\n", 2),
        ("# nothing\n\n", None),
    ],
)
def test_a_malformed_keys_file_names_the_line_and_never_a_key(text: str, line: int | None) -> None:
    with pytest.raises(ApiKeysError) as e:
        parse_keys(text, "keys.txt")
    msg = str(e.value)
    assert "sk-secret-key" not in msg and "keys.txt" in msg
    assert (f"line {line}" in msg) if line else "no keys" in msg


def test_keys_reload_when_the_file_changes_and_a_bad_file_keeps_the_old_keys(tmp_path, caplog) -> None:
    path = tmp_path / "keys"
    path.write_text(keys_text())
    keys = ApiKeys(path, check_every_s=0)
    path.write_text("carol sk-carol-1111\n")
    assert keys.lookup(b"sk-carol-1111") == "carol" and keys.lookup(ALICE_KEY.encode()) is None
    with caplog.at_level(logging.ERROR, logger="pagoda.auth"):
        path.write_text("carol sk-carol-1111\ndave\n")
        assert keys.lookup(b"sk-carol-1111") == "carol"  # the old keys stay
    assert "line 2" in caplog.text and "sk-carol" not in caplog.text
    path.unlink()
    assert keys.lookup(b"sk-carol-1111") == "carol"
    with pytest.raises(ApiKeysError, match="cannot read"):
        ApiKeys(tmp_path / "missing")


def test_the_flag_wins_over_the_environment(tmp_path, monkeypatch) -> None:
    env, flag = tmp_path / "env", tmp_path / "flag"
    env.write_text("envtenant sk-env\n")
    flag.write_text("flagtenant sk-flag\n")
    monkeypatch.setenv("PAGODA_API_KEYS_FILE", str(env))
    assert ApiKeys.from_settings(None).tenants == {"envtenant"}
    assert ApiKeys.from_settings(str(flag)).tenants == {"flagtenant"}
    monkeypatch.delenv("PAGODA_API_KEYS_FILE")
    assert ApiKeys.from_settings(None) is None


def test_a_bad_keys_file_stops_the_server_at_startup(tmp_path) -> None:
    from pagoda.node_agent.cli.serve import build_app

    from .apps import serve_args

    path = tmp_path / "keys"
    path.write_text(f"alice {ALICE_KEY}\nbob\n")
    with pytest.raises(ApiKeysError, match="line 2") as e:
        build_app(serve_args("--api-keys", str(path)), engine=object())
    assert ALICE_KEY not in str(e.value)


# ---------------------------------------------------------------------------- a keyed server


@pytest.fixture(scope="module")
def keyed(make_engine, tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "api-keys"
    path.write_text(keys_text())
    flags = ("--api-keys", str(path), "--tenant-secret", "t", "--body-timeout", "60")
    with live_app(make_engine, *flags) as (server, app):
        yield server.url, app, path


def client(url: str, key: str | None, **headers: str) -> openai.OpenAI:
    """The official client; ``key`` None sends no Authorization header at all."""

    def strip(request: httpx.Request) -> None:
        if key is None:
            del request.headers["Authorization"]

    http = httpx.Client(event_hooks={"request": [strip]}, timeout=60)
    return openai.OpenAI(
        base_url=url + "/v1", api_key=key or "none", default_headers=headers, max_retries=0, http_client=http
    )


def cached(url: str, key: str, prompt: str, **headers: str) -> int:
    r = client(url, key, **headers).completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, temperature=0
    )
    return r.usage.prompt_tokens_details.cached_tokens


def test_requests_without_a_valid_key_are_refused_with_openai_401s(keyed) -> None:
    url, _, _ = keyed
    before = metrics(url)
    with pytest.raises(openai.AuthenticationError) as e:
        client(url, None).models.list()
    assert e.value.status_code == 401
    with pytest.raises(openai.AuthenticationError) as e:
        client(url, "sk-wrong").completions.create(model=MODEL, prompt="hi", max_tokens=1)
    assert e.value.body["code"] == "invalid_api_key" and e.value.body["type"] == "invalid_request_error"
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"
    assert r.headers["www-authenticate"] == "Bearer"
    r = httpx.get(url + "/v1/models", headers={"Authorization": f"Basic {ALICE_KEY}"}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert ALICE_KEY not in r.text
    r = httpx.get(url + "/v1/nothing-here", timeout=30)
    assert r.status_code == 401  # unknown paths are not probed without a key either
    after = metrics(url)
    for reason, n in (("missing", 3), ("unknown", 1), ("malformed", 1)):
        got = metric_sum(after, "pagoda_auth_failures_total", plane="public", reason=reason)
        was = metric_sum(before, "pagoda_auth_failures_total", plane="public", reason=reason)
        assert got - was == n, reason
    # the probes stay open
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    assert httpx.get(url + "/ready", timeout=30).status_code == 200
    assert "pagoda_auth_failures_total" in httpx.get(url + "/metrics", timeout=30).text
    # a valid key, plain or stored as a hash
    assert [m.id for m in client(url, ALICE_KEY).models.list().data] == [MODEL]
    assert client(url, BOB_KEY).completions.create(model=MODEL, prompt="hi", max_tokens=1).choices


def test_a_refused_key_is_answered_before_the_body_is_read(keyed) -> None:
    """Headers announce a body that never comes (the body timeout is 60 s): the 401 still comes at
    once; and an announced body over the size limit is a 401, not a 413."""
    url, _, _ = keyed
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-wrong\r\n"
            b'Content-Type: application/json\r\nContent-Length: 5000\r\n\r\n{"mod'
        )
        answer = read_response(s)
    assert answer.startswith("HTTP/1.1 401") and "invalid_api_key" in answer
    r = httpx.post(
        url + "/v1/completions", content=b"x" * (2 << 20), headers={"Authorization": "Bearer no"}, timeout=30
    )
    assert r.status_code == 401


def test_the_tenant_comes_from_the_key_not_from_a_header(keyed) -> None:
    url, _, _ = keyed
    prompt = LONG + " (keyed)"
    assert cached(url, ALICE_KEY, prompt) == 0
    hit = cached(url, ALICE_KEY, prompt)
    assert hit >= 16
    # bob claims to be alice: the header is not trusted, bob is bob
    assert cached(url, BOB_KEY, prompt, **{"X-Pagoda-Tenant": "alice"}) == 0
    assert cached(url, BOB_KEY, prompt, **{"X-Pagoda-Tenant": "alice"}) >= 16  # bob's own entry now
    assert cached(url, ALICE_KEY, prompt, **{"X-Pagoda-Tenant": "bob"}) == hit


def test_keys_rotate_without_a_restart(keyed) -> None:
    url, app, path = keyed
    keys = app.state.settings.api_keys
    saved, text = keys.check_every_s, path.read_text()
    keys.check_every_s = 0  # the test does not wait for the periodic check
    try:
        path.write_text(keys_text("carol sk-carol-2222").replace(f"alice {ALICE_KEY}", ""))
        assert client(url, "sk-carol-2222").completions.create(model=MODEL, prompt="hi", max_tokens=1).choices
        with pytest.raises(openai.AuthenticationError):
            client(url, ALICE_KEY).models.list()
        path.write_text("carol\n")  # broken: the keys in force stay
        assert client(url, "sk-carol-2222").models.list().data
    finally:
        path.write_text(text)
        keys.check_every_s = saved


# ---------------------------------------------------------------------------- behind a gateway


@pytest.fixture(scope="module")
def gateway(make_engine):
    with live_app(make_engine, "--trust-tenant-header", "--tenant-secret", "t") as (server, _):
        yield server.url


def test_a_trusted_gateway_header_separates_and_joins_tenants(gateway) -> None:
    prompt = LONG + " (gateway)"
    assert cached(gateway, "unused", prompt, **{"X-Pagoda-Tenant": "alice"}) == 0
    hit = cached(gateway, "unused", prompt, **{"X-Pagoda-Tenant": "alice"})
    assert hit >= 16
    assert cached(gateway, "other-key", prompt, **{"X-Pagoda-Tenant": "alice"}) == hit  # same tenant
    assert cached(gateway, "unused", prompt, **{"X-Pagoda-Tenant": "bob"}) == 0
    assert cached(gateway, "unused", prompt) == 0  # no header: the anonymous tenant
    assert cached(gateway, "unused", prompt) == hit


def test_without_keys_or_trust_the_server_says_it_is_single_tenant(caplog) -> None:
    import asyncio

    from pagoda.node_agent.serving.api.api_server import ApiSettings, log_tenancy
    from pagoda.node_agent.serving.api.metrics import ServeMetrics
    from pagoda.node_agent.serving.api.tenancy import TenantPolicy

    settings = ApiSettings([MODEL], TenantPolicy.from_settings(None, "s", None), ServeMetrics("both"))
    with caplog.at_level(logging.INFO, logger="pagoda.api"):
        asyncio.run(log_tenancy(settings)())
    assert "single-tenant: no --api-keys" in caplog.text
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
