"""Request parsing and tenant salts, without a server."""

from __future__ import annotations

import pytest

from pagoda.node_agent.serving.api.errors import ApiError
from pagoda.node_agent.serving.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    parse_body,
)
from pagoda.node_agent.serving.api.tenancy import TenantPolicy


def test_parse_accepts_openai_shapes() -> None:
    r = parse_body(b'{"model": "m", "prompt": [1, 2, 3], "stop": "x", "max_tokens": 3}', CompletionRequest)
    assert r.prompts() == [[1, 2, 3]] and r.sampling(3).stop == ["x"]
    c = parse_body(
        b'{"model": "m", "messages": [{"role": "developer", "content": [{"type": "text", "text": "hi"}]}],'
        b' "max_completion_tokens": 5}',
        ChatCompletionRequest,
    )
    assert c.chat_messages() == [{"role": "system", "content": "hi"}] and c.requested_max_tokens() == 5


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'{"model": "m", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}', "stop"),
        (b'{"model": "m", "prompt": "x", "presence_penalty": 1}', "presence_penalty"),
        (b'{"model": "m", "prompt": "x", "echo": 1}', "echo"),
        (b'{"model": "m", "prompt": "x", "logprobs": 21}', "logprobs"),
        (b'{"model": "m", "prompt": "x", "logprobs": true}', "logprobs"),
        (b'{"model": "m", "prompt": []}', "prompt"),
        (b'{"model": 3, "prompt": "x"}', "model"),
    ],
)
def test_parse_errors_name_the_field(raw: bytes, param: str) -> None:
    with pytest.raises(ApiError) as e:
        parse_body(raw, CompletionRequest)
    assert e.value.status == 400 and e.value.param == param


def test_salts_are_server_derived_per_tenant() -> None:
    p = TenantPolicy(b"k1", "x-pagoda-tenant", "public", trust_header=True)
    a, b = p.salt({"x-pagoda-tenant": "alice"}), p.salt({"x-pagoda-tenant": "bob"})
    assert a != b and a == p.salt({"x-pagoda-tenant": "alice"})
    assert "alice" not in a and len(a) == 32
    trusted = TenantPolicy(b"k2", "x-pagoda-tenant", trust_header=True)
    assert trusted.salt({"x-pagoda-tenant": "alice"}) != a  # the secret matters
    shared = p.salt({"x-pagoda-tenant": "alice", "x-pagoda-cache-scope": "public"})
    assert shared == p.salt({"x-pagoda-tenant": "bob", "x-pagoda-cache-scope": "public"}) != a
    with pytest.raises(ApiError):
        p.salt({"x-pagoda-cache-scope": "bob"})
    keyed = TenantPolicy(b"k1", "authorization", trust_header=True)
    assert keyed.salt({"authorization": "Bearer sk-1"}) != keyed.salt({"authorization": "Bearer sk-2"})
    assert keyed.tenant({"authorization": "Bearer sk-1"}) == "sk-1"


def test_the_tenant_header_counts_only_when_trusted_and_keys_name_the_tenant() -> None:
    single = TenantPolicy(b"k", "x-pagoda-tenant")
    assert single.single_tenant and "single-tenant" in single.describe()
    assert (
        single.salt({"x-pagoda-tenant": "alice"}) == single.salt({}) == single.salt({"x-pagoda-tenant": "b"})
    )
    keys = TenantPolicy(b"k", "x-pagoda-tenant", keyed=True)
    assert keys.tenant({"x-pagoda-tenant": "alice"}, "bob") == "bob"  # the header is not trusted
    with pytest.raises(ApiError) as e:
        keys.tenant({})
    assert e.value.status == 401
    gateway = TenantPolicy(b"k", "x-pagoda-tenant", trust_header=True, keyed=True)
    assert gateway.tenant({"x-pagoda-tenant": "alice"}, "gw") == "alice"  # the gateway names the tenant
    assert gateway.tenant({}, "gw") == "gw"
    assert TenantPolicy(b"k", trust_header=True).tenant({}) == "anonymous"
