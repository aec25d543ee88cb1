"""Property test of the public API: generated request bodies, valid and not, to both endpoints of
the live server. Whatever the body, the answer is never a 5xx, always JSON (or a well-formed SSE
stream ending in ``[DONE]`` or an error event), never a hang, and the server ends idle."""

from __future__ import annotations

import json
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagoda.node_agent.serving.api.metrics import metric_sum

from .conftest import MODEL
from .live import wait_idle

pytestmark = [pytest.mark.serve, pytest.mark.slow, pytest.mark.timeout(1200)]

EXAMPLES = 2000
BATCH = 8  # bodies per generated case, sent at once: the server batches them (and the run is 3x shorter)
MAX_NEW = 2  # valid bodies generate at most this many tokens per choice: the run stays short
VOCAB = 49152
INT64 = 2**63

# ---------------------------------------------------------------------------- values

short_text = st.text(max_size=12)
surrogate_text = st.builds(
    lambda a, c, b: a + chr(c) + b, short_text, st.integers(0xD800, 0xDFFF), short_text
)
odd_strings = st.sampled_from(["", " ", "\x00", "\u202e", "null", "1", "true", "𝔘𝔫𝔦", "a" * 300])
huge_ints = st.sampled_from([INT64, -INT64 - 1, INT64 - 1, -INT64, 2**64, 2**64 - 1, 10**300, -(10**300)])
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    huge_ints,
    st.floats(allow_nan=False, allow_infinity=False),
    short_text,
    surrogate_text,
    odd_strings,
)
junk = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=10,
)

words = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=24)
token_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)
prompt = st.one_of(
    words, st.lists(words, min_size=1, max_size=3), token_ids, st.lists(token_ids, min_size=1, max_size=3)
)
part = st.fixed_dictionaries({"type": st.just("text"), "text": words})
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant", "developer", "tool"]),
        "content": st.one_of(words, st.lists(part, min_size=1, max_size=2)),
    }
)

COMMON: dict[str, st.SearchStrategy] = {
    "temperature": st.one_of(st.none(), st.floats(0, 2)),
    "top_p": st.floats(0.05, 1),
    "top_k": st.integers(0, 100),
    "n": st.integers(1, 2),
    "stop": st.one_of(st.none(), words, st.lists(words, max_size=4)),
    "seed": st.one_of(st.none(), st.integers(-INT64, INT64 - 1)),
    "stream": st.booleans(),
    "stream_options": st.one_of(st.none(), st.fixed_dictionaries({"include_usage": st.booleans()})),
    "presence_penalty": st.sampled_from([0, 0.0, None]),
    "frequency_penalty": st.sampled_from([0, 0.0, None]),
    "ignore_eos": st.booleans(),
    "user": short_text,
    "metadata": st.dictionaries(short_text, short_text, max_size=2),
    "store": st.booleans(),
    "logit_bias": st.just({}),
    "logprobs": st.sampled_from([None, False]),
}
COMPLETION = {**COMMON, "best_of": st.just(1), "echo": st.just(False), "suffix": st.sampled_from([None, ""])}
CHAT = {
    **COMMON,
    "max_completion_tokens": st.integers(1, MAX_NEW),
    "top_logprobs": st.none(),
    "tools": st.just([]),
    "tool_choice": st.sampled_from([None, "none"]),
    "parallel_tool_calls": st.booleans(),
    "response_format": st.just({"type": "text"}),
    "modalities": st.just(["text"]),
}
# OpenAI fields the server refuses unless neutral, and names it has never heard of
REFUSED = ["top_logprobs", "tools", "functions", "response_format", "best_of", "audio", "prediction", "echo"]
STRANGERS = ["temperatura", "max_token", "prompt ", "Model", "repetition_penalty", "min_tokens", ""]


def one_in(n: int) -> st.SearchStrategy[bool]:
    """True with probability 1/n (integer strategies favour their bounds, so not ``integers() == 0``)."""
    return st.sampled_from([False] * (n - 1) + [True])


@st.composite
def bodies(draw: st.DrawFn) -> tuple[str, bytes]:
    """(path, JSON bytes) of one request: a valid base, some valid options, some fields replaced by
    junk, unknown or refused fields added, required ones removed."""
    chat = draw(st.booleans())
    path = "/v1/chat/completions" if chat else "/v1/completions"
    options = CHAT if chat else COMPLETION
    main = "messages" if chat else "prompt"
    body: dict[str, Any] = {
        "model": MODEL,
        main: draw(st.lists(message, min_size=1, max_size=3) if chat else prompt),
        "max_tokens": draw(st.integers(1, MAX_NEW)),
    }
    for name in draw(st.lists(st.sampled_from(sorted(options)), max_size=6, unique=True)):
        body[name] = draw(options[name])
    names = sorted({*options, "model", main, "max_tokens"})
    for name in draw(st.lists(st.sampled_from(names), max_size=2, unique=True)):
        body[name] = draw(junk)
    if draw(one_in(8)):
        body[draw(st.sampled_from(REFUSED + STRANGERS) | short_text | surrogate_text)] = draw(junk)
    if draw(one_in(20)):
        body["model"] = draw(st.sampled_from(["gpt-4", MODEL.upper(), "builtin://smollm2-135m"]) | short_text)
    if draw(one_in(20)):
        body.pop(draw(st.sampled_from(["model", main])), None)
    if chat and isinstance(body.get("messages"), list) and body["messages"] and draw(one_in(8)):
        msg = body["messages"][0]
        if isinstance(msg, dict):
            msg[draw(st.sampled_from(["content", "role", "name", "tool_calls", "x"]))] = draw(junk)
    for name in ("max_tokens", "max_completion_tokens"):  # valid sizes stay small (2 CPU cores)
        v = body.get(name)
        if type(v) is int and v > MAX_NEW:
            body[name] = MAX_NEW
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = MAX_NEW
    return path, json.dumps(body).encode()


RAW = [
    b"",
    b"null",
    b"[1, 2]",
    b'"text"',
    b"{",
    b'{"model": "x", "prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}",
    b'{"model": "x", "prompt": ' + b"[" * 3000 + b"]" * 3000 + b"}",
    b'{"model": "x", "prompt": "a", "top_p": NaN}',
    b'{"model": "x", "prompt": "\xff\xfe"}',
    b'{"model": "x", "prompt": "a"}garbage',
]
raw_bodies = st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), st.sampled_from(RAW))


def check(r: httpx.Response) -> int:
    """The response is no 5xx and well formed; returns its status."""
    assert r.status_code < 500, r.read()
    kind = r.headers.get("content-type", "")
    if kind.startswith("text/event-stream"):
        assert r.status_code == 200
        events = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
        assert events, "an empty stream"
        for e in events[:-1]:
            assert "error" not in json.loads(e)
        last = events[-1]
        assert last == "[DONE]" or set(json.loads(last)["error"]) == {"message", "type", "param", "code"}
        return r.status_code
    data = json.loads(r.read())
    if r.status_code == 200:
        assert data["choices"] and data["usage"]["total_tokens"] >= 1
    else:
        assert set(data["error"]) == {"message", "type", "param", "code"} and data["error"]["message"]
    return r.status_code


def test_generated_request_bodies_never_get_a_5xx_and_leave_the_server_idle(stack) -> None:
    seen: Counter[int] = Counter()
    case = st.one_of(bodies(), bodies(), bodies(), bodies(), raw_bodies)
    with (
        httpx.Client(base_url=stack.url, timeout=httpx.Timeout(60)) as client,
        ThreadPoolExecutor(BATCH) as pool,
    ):

        def send(one: tuple[str, bytes]) -> int:
            path, data = one
            headers = {"content-type": "application/json"}
            with client.stream("POST", path, content=data, headers=headers) as r:
                return check(r)

        @settings(
            max_examples=EXAMPLES // BATCH,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(cases=st.lists(case, min_size=BATCH, max_size=BATCH))
        def batch(cases: list[tuple[str, bytes]]) -> None:
            seen.update(pool.map(send, cases))

        batch()
    print("fuzz statuses:", dict(seen))
    assert sum(seen.values()) >= EXAMPLES
    assert seen[200] >= EXAMPLES // 10 and seen[400] >= EXAMPLES // 10, seen  # both sides explored
    assert set(seen) <= {200, 400, 404}, seen  # 404: an unknown model name
    m = wait_idle(stack.url)
    assert metric_sum(m, "pagoda_kv_pages_used") == 0 and stack.aengine.num_inflight == 0
    assert metric_sum(m, "pagoda_running_sequences") == 0 and metric_sum(m, "pagoda_waiting_sequences") == 0
