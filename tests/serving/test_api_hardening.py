"""What a hostile client found, answered: every bad body is a 400 naming the field, a request's
choices are admitted or refused whole before any work, a slow body is a 408, and nothing is ever
a plain-text 500 (unexpected failures are JSON, streams end with an error event)."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from pagoda.node_agent.serving.api.metrics import metric_sum

from .apps import read_response
from .conftest import MODEL
from .live import metrics, wait_idle

pytestmark = [pytest.mark.serve, pytest.mark.timeout(300)]

CHAT = [{"role": "user", "content": "Say hi."}]


def post(stack, path: str, body: dict | bytes, **headers: str) -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        stack.url + path, content=data, headers={"content-type": "application/json", **headers}, timeout=60
    )


def app_of(stack):
    return stack.server.server.config.app


def assert_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def work_done(url: str) -> tuple[float, float]:
    m = metrics(url)
    return metric_sum(m, "pagoda_generation_tokens_total"), metric_sum(m, "pagoda_prompt_tokens_total")


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"seed": 2**63}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"seed": True}, "seed"),
        ({"seed": 1.0}, "seed"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"max_tokens": "3"}, "max_tokens"),
        ({"n": True}, "n"),
        ({"n": 2.0}, "n"),
        ({"top_k": "5"}, "top_k"),
        ({"top_k": False}, "top_k"),
        ({"temperature": True}, "temperature"),
        ({"top_p": "0.5"}, "top_p"),
        ({"stream": "yes"}, "stream"),
        ({"stop": ["a", 3]}, "stop"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"best_of": 2}, "best_of"),
        ({"echo": "yes"}, "echo"),
        ({"suffix": "x"}, "suffix"),
        ({"logit_bias": {"50256": -100}}, "logit_bias"),  # past the vocabulary (49152 tokens)
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"-3": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"5": "x"}}, "logit_bias"),
        ({"logit_bias": [5]}, "logit_bias"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"stream_options": {"include_usage": True, "x": 1}}, "stream_options.x"),
        ({"temperatura": 0.5}, "temperatura"),
        ({"tools": [{"type": "function"}]}, "tools"),  # a chat field, unknown to completions
    ],
)
def test_bad_completion_fields_are_400s_naming_the_field(stack, extra: dict, param: str) -> None:
    before = work_done(stack.url)
    r = post(stack, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, **extra})
    err = assert_error(r, 400, param)
    assert param.split(".")[0] in err["message"]
    assert work_done(stack.url) == before


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"top_logprobs": 2}, "top_logprobs"),  # needs logprobs: true
        ({"logprobs": False, "top_logprobs": 0}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"logprobs": 1}, "logprobs"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools[0].function.name"),
        ({"tools": [TOOL, TOOL]}, "tools"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
            "tools[0].function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]},
            "tools[0].function.parameters",
        ),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
        ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "r", "schema": {"type": "nope"}},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"tools": [TOOL], "response_format": {"type": "json_object"}}, "response_format"),
        ({"audio": {"voice": "alloy"}}, "audio"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
        ({"max_completion_tokens": True}, "max_completion_tokens"),
        ({"best_of": 1}, "best_of"),  # a completions field, unknown to chat
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"id": "c1"}]}]},
            "messages[0].tool_calls[0].function",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0].type"),
        ({"messages": [{"role": "user", "content": "x", "colour": 1}]}, "messages[0].colour"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ],
)
def test_bad_chat_fields_are_400s_naming_the_field(stack, extra: dict, param: str) -> None:
    r = post(stack, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 2, **extra})
    assert_error(r, 400, param)


def test_neutral_values_of_unsupported_fields_and_ignored_fields_are_accepted(stack) -> None:
    neutral = {
        "logprobs": False,
        "top_logprobs": None,
        "tools": [],
        "tool_choice": "none",
        "parallel_tool_calls": False,
        "response_format": {"type": "text"},
        "logit_bias": {},
        "modalities": ["text"],
        "user": "u-1",
        "metadata": {"team": "a"},
        "store": False,
        "presence_penalty": 0,
        "stream_options": {"include_usage": True},
    }
    r = post(stack, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 2, **neutral})
    assert r.status_code == 200, r.text
    neutral = {"best_of": 1, "echo": False, "suffix": None, "logprobs": None, "user": "u", "n": None}
    r = post(stack, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, **neutral})
    assert r.status_code == 200, r.text


def test_seeds_at_the_int64_edges_are_served_reproducibly(stack) -> None:
    for seed in (-(2**63), 2**63 - 1):
        body = {"model": MODEL, "prompt": "Pick a word:", "max_tokens": 3, "n": 2, "seed": seed}
        first, again = post(stack, "/v1/completions", body), post(stack, "/v1/completions", body)
        assert first.status_code == 200, first.text
        texts = [c["text"] for c in first.json()["choices"]]
        assert texts == [c["text"] for c in again.json()["choices"]]


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'{"model": "M", "messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content"),
        (
            b'{"model": "M", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
            "messages[0].content[0].text",
        ),
        (b'{"model": "M", "messages": [{"role": "user", "content": "x"}], "user": "\\ud800"}', "user"),
        (
            b'{"model": "M", "messages": [{"role": "user", "content": "x"}], "stop": ["a", "\\ud800"]}',
            "stop[1]",
        ),
        (b'{"model": "\\ud800", "messages": [{"role": "user", "content": "x"}]}', "model"),
    ],
)
def test_lone_surrogates_anywhere_in_the_body_are_400s(stack, raw: bytes, param: str) -> None:
    r = post(stack, "/v1/chat/completions", raw.replace(b'"M"', json.dumps(MODEL).encode()))
    err = assert_error(r, 400, param)
    assert "surrogate" in err["message"]
    r = post(stack, "/v1/completions", b'{"model": "%s", "prompt": ["ok", "\\ud800"]}' % MODEL.encode())
    assert_error(r, 400, "prompt[1]")
    r = post(stack, "/v1/completions", b'{"model": "%s", "prompt": "x", "\\ud800": 1}' % MODEL.encode())
    assert_error(r, 400)


def test_malformed_json_huge_ints_and_deep_nesting_are_400s(stack) -> None:
    for raw in (
        b'{"model": "m", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",
        b'{"model": "m", "prompt": "x", "temperature": NaN}',
        b'{"model": "m", "prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
        b'{"model": "m", "prompt": ' + b"[" * 40 + b"]" * 40 + b"}",
        b"\xff\xfe{",
        b"",
    ):
        assert_error(post(stack, "/v1/completions", raw), 400)


def test_more_choices_than_the_server_can_hold_are_refused_before_any_work(stack) -> None:
    before = work_done(stack.url)
    body = {"model": MODEL, "prompt": [f"prompt {i}" for i in range(32)], "n": 8, "max_tokens": 4}
    err = assert_error(post(stack, "/v1/completions", body), 400, "n", "too_many_choices")
    assert "256 choices" in err["message"]
    assert work_done(stack.url) == before and stack.aengine.num_inflight == 0


def test_a_batch_is_admitted_or_refused_whole(stack) -> None:
    before = work_done(stack.url)
    # one invalid prompt among valid ones: 400, none of them queued
    r = post(
        stack, "/v1/completions", {"model": MODEL, "prompt": [[1, 2], [3, 10**9]], "n": 2, "max_tokens": 2}
    )
    assert_error(r, 400, "prompt")
    r = post(stack, "/v1/completions", {"model": MODEL, "prompt": ["fine", "hello " * 600], "max_tokens": 2})
    assert_error(r, 400, "prompt")
    assert work_done(stack.url) == before and stack.aengine.num_inflight == 0
    # not enough free slots now: 429 for the whole request, nothing started
    saved = stack.aengine.max_inflight
    stack.aengine.max_inflight = 4
    try:
        body = {"model": MODEL, "prompt": "Count:", "max_tokens": 64, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", stack.url + "/v1/completions", json=body, timeout=60) as held:
            assert held.status_code == 200
            r = post(stack, "/v1/completions", {"model": MODEL, "prompt": "hi", "n": 4, "max_tokens": 2})
            assert_error(r, 429, code="queue_full")
            assert r.headers["retry-after"] == "1"
            assert stack.aengine.num_inflight == 1
            r = post(stack, "/v1/completions", {"model": MODEL, "prompt": "hi", "n": 5, "max_tokens": 2})
            assert_error(r, 400, "n", "too_many_choices")
            r = post(stack, "/v1/completions", {"model": MODEL, "prompt": "hi", "n": 3, "max_tokens": 2})
            assert r.status_code == 200 and len(r.json()["choices"]) == 3
    finally:
        stack.aengine.max_inflight = saved
    wait_idle(stack.url)
    assert stack.aengine.num_inflight == 0


def test_a_partial_body_times_out_with_a_json_408(stack) -> None:
    settings = app_of(stack).state.settings
    saved = settings.body_timeout_s
    settings.body_timeout_s = 0.5
    try:
        with socket.create_connection(("127.0.0.1", stack.server.port), timeout=30) as s:
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 200\r\n\r\n{"model": "smollm2-135m", "pro'
            )
            data = read_response(s)
    finally:
        settings.body_timeout_s = saved
    head, _, body = data.partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 408") and "application/json" in head
    assert json.loads(body)["error"]["code"] == "body_timeout"


def test_unknown_routes_and_methods_are_json_errors(stack) -> None:
    assert_error(httpx.get(stack.url + "/v1/nothing", timeout=30), 404, code="not_found")
    assert_error(httpx.get(stack.url + "/v1/completions", timeout=30), 405, code="method_not_allowed")


def test_an_unexpected_failure_is_a_json_500_without_internals(stack, monkeypatch) -> None:
    backend = app_of(stack).state.backend

    async def broken(gens):
        raise RuntimeError("internal detail /secret/path")

    monkeypatch.setattr(backend, "open_all", broken)
    r = post(stack, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})
    err = assert_error(r, 500, code="internal_error")
    assert err["type"] == "server_error" and "secret" not in r.text


def test_a_stream_failing_after_its_headers_ends_with_an_error_event(stack, monkeypatch) -> None:
    backend = app_of(stack).state.backend
    real = backend.open_all

    class Failing:
        def __init__(self, handle) -> None:
            self.handle = handle
            self.request_id = handle.request_id

        def __aiter__(self):
            return self._iter()

        async def _iter(self):
            async for chunk in self.handle:
                yield chunk
                raise RuntimeError("internal detail /secret/path")

        def abort(self) -> None:
            self.handle.abort()

    async def failing(gens):
        return [Failing(h) for h in await real(gens)]

    monkeypatch.setattr(backend, "open_all", failing)
    body = {"model": MODEL, "prompt": "Count:", "max_tokens": 32, "ignore_eos": True, "stream": True, "n": 2}
    with httpx.stream("POST", stack.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
    assert "[DONE]" not in events and "secret" not in "".join(events)
    assert json.loads(events[-1])["error"]["code"] == "internal_error"
    m = wait_idle(stack.url)
    assert metric_sum(m, "pagoda_kv_pages_used") == 0 and stack.aengine.num_inflight == 0
