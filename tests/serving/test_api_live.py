"""The single-process server over HTTP: the official openai client, validation, prefix cache with
tenants, disconnects, 429s, integrity aborts, load and metrics."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from pagoda.node_agent.serving.api.metrics import metric_sum

from .conftest import CHAT, MAX_TOKENS, MODEL, PROMPTS
from .live import metrics, wait_idle

pytestmark = [pytest.mark.serve, pytest.mark.timeout(300)]

LONG = (
    "You are a careful assistant for a lighthouse museum. Answer briefly and politely, and never "
    "invent dates. Question: who kept the light?"
)


def client(stack, **headers) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=stack.url + "/v1", api_key="unused", default_headers=headers, max_retries=0, timeout=60
    )


def post(stack, path: str, body, **kw) -> httpx.Response:
    data = body if isinstance(body, bytes | str) else json.dumps(body)
    headers = {"content-type": "application/json", **kw.pop("headers", {})}
    return httpx.post(stack.url + path, content=data, headers=headers, timeout=60, **kw)


def test_openai_client_completes_chats_and_streams_like_the_offline_engine(stack) -> None:
    c = client(stack)
    assert [m.id for m in c.models.list().data] == [MODEL]
    for prompt in PROMPTS:
        r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert r.choices[0].text == stack.offline[prompt]
        assert r.usage.completion_tokens <= MAX_TOKENS and r.usage.prompt_tokens > 0
    chat = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    assert chat.choices[0].message.content == stack.offline_chat
    assert chat.choices[0].message.role == "assistant"

    parts, usage, reasons = [], None, []
    stream = c.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for ev in stream:
        if ev.usage:
            usage = ev.usage
        for ch in ev.choices:
            parts.append(ch.delta.content or "")
            reasons.append(ch.finish_reason)
    assert "".join(parts) == stack.offline_chat
    assert reasons[-1] in ("stop", "length") and usage is not None
    assert usage.prompt_tokens_details.cached_tokens >= 0

    text = "".join(
        ev.choices[0].text
        for ev in c.completions.create(
            model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
        if ev.choices
    )
    assert text == stack.offline[PROMPTS[0]]


def test_n_choices_and_prompt_batches(stack) -> None:
    r = client(stack).completions.create(model=MODEL, prompt=PROMPTS[:2], n=2, max_tokens=4, temperature=0)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text and r.choices[2].text == r.choices[3].text


def test_logit_bias_bans_and_forces_tokens(stack) -> None:
    """OpenAI's logit_bias through the openai client: -100 never samples a token, +100 all but
    forces one; a ban on the greedy choice changes the text, on a streamed chat too."""
    c = client(stack)
    tok = stack.engine.tokenizer
    ids = tok.encode(" lighthouse")
    forced = ids[-1]
    r = c.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, logit_bias={str(forced): 100}
    )
    assert r.choices[0].text == tok.decode([forced] * 6)
    greedy = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0)
    first = tok.encode(greedy.choices[0].text)[0]
    banned = c.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0, logit_bias={str(first): -100}
    )
    assert tok.encode(banned.choices[0].text)[0] != first
    sampled = c.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=1.0, seed=3, logit_bias={str(first): -100}
    )
    assert first not in tok.encode(sampled.choices[0].text)[:1]
    parts = [
        ev.choices[0].delta.content or ""
        for ev in c.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=3,
            temperature=0,
            stream=True,
            logit_bias={str(forced): 100},
        )
        if ev.choices
    ]
    assert "".join(parts) == tok.decode([forced] * 3)


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "gpt-4", "prompt": "hi"}, 404, "model"),
        ({"model": MODEL, "prompt": 5}, 400, "prompt"),
        ({"model": MODEL, "prompt": "hi", "n": 0}, 400, "n"),
        ({"model": MODEL, "prompt": "hi", "n": 99}, 400, "n"),
        ({"model": MODEL, "prompt": "hi", "temperature": -1}, 400, "temperature"),
        ({"model": MODEL, "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
        ({"model": MODEL, "prompt": "hi", "top_p": 0}, 400, "top_p"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "hello " * 600}, 400, "prompt"),
        ({"model": MODEL, "prompt": ""}, 400, "prompt"),
        ({"model": MODEL, "prompt": "hi", "logprobs": 30}, 400, "logprobs"),
        ({"prompt": "hi"}, 400, "model"),
    ],
)
def test_bad_completion_requests_get_openai_errors_naming_the_field(stack, body, status, param) -> None:
    r = post(stack, "/v1/completions", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"] and err["type"]


def test_bad_chat_json_and_oversized_bodies(stack) -> None:
    r = post(stack, "/v1/chat/completions", {"model": MODEL, "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = post(
        stack, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].role"
    r = post(stack, "/v1/chat/completions", b'{"model": "smollm2-135m", "messages": [')
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    r = post(stack, "/v1/completions", b"[1, 2]")
    assert r.status_code == 400
    r = post(stack, "/v1/completions", json.dumps({"model": MODEL, "prompt": "x" * (2 << 20)}))
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"


def cached_tokens(stack, prompt: str, **headers) -> int:
    r = client(stack, **headers).completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    return r.usage.prompt_tokens_details.cached_tokens


def test_prefix_cache_hits_are_reported_and_the_shared_scope_is_its_own_tenant(stack) -> None:
    """The stack runs single-tenant (no keys, no trusted header): a client's tenant header changes
    nothing; tenant isolation with keys or a trusted gateway header is in test_auth.py."""
    before = metric_sum(metrics(stack.url), "pagoda_prefix_cache_hit_tokens_total")
    prompt = LONG + " (tenant test)"
    assert cached_tokens(stack, prompt, **{"X-Pagoda-Tenant": "alice"}) == 0
    hit = cached_tokens(stack, prompt, **{"X-Pagoda-Tenant": "alice"})
    assert hit >= 16 and hit % 16 == 0  # whole pages, prefill of them skipped
    assert metric_sum(metrics(stack.url), "pagoda_prefix_cache_hit_tokens_total") >= before + hit
    # the untrusted header is ignored: every request is the one tenant
    assert cached_tokens(stack, prompt, **{"X-Pagoda-Tenant": "bob"}) == hit
    assert cached_tokens(stack, prompt) == hit
    # the configured shared scope is shared by everyone who opts in, and only by them
    shared = "Shared preamble. " + LONG
    assert cached_tokens(stack, shared, **{"X-Pagoda-Cache-Scope": "public"}) == 0
    assert cached_tokens(stack, shared, **{"X-Pagoda-Cache-Scope": "public"}) >= 16
    assert cached_tokens(stack, shared) == 0
    r = post(
        stack, "/v1/completions", {"model": MODEL, "prompt": "x"}, headers={"X-Pagoda-Cache-Scope": "alice"}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "x-pagoda-cache-scope"


def test_client_disconnect_aborts_the_request_and_frees_its_pages(stack) -> None:
    before = metric_sum(metrics(stack.url), "pagoda_requests_total", outcome="abort")
    body = {
        "model": MODEL,
        "prompt": "Count slowly:",
        "max_tokens": 200,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", stack.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
    m = wait_idle(stack.url)
    assert metric_sum(m, "pagoda_kv_pages_used") == 0
    assert metric_sum(m, "pagoda_requests_total", outcome="abort") == before + 1
    assert stack.aengine.num_inflight == 0


def test_queue_full_answers_429_with_retry_after(stack) -> None:
    saved = stack.aengine.max_inflight
    stack.aengine.max_inflight = 1
    try:
        body = {
            "model": MODEL,
            "prompt": "Count:",
            "max_tokens": 64,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", stack.url + "/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            r2 = post(stack, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})
            assert r2.status_code == 429 and r2.headers["retry-after"] == "1"
            assert r2.json()["error"]["code"] == "queue_full"
    finally:
        stack.aengine.max_inflight = saved
    wait_idle(stack.url)


def test_an_integrity_abort_is_an_error_never_text(stack) -> None:
    """A page's tag changes under a running request (simulated stale mapping): the engine fails the
    request closed, and the API returns an error, not partial text."""
    from pagoda.node_agent.kv.pool import PageRef

    eng = stack.engine
    original = eng.integrity.check
    marker = "INTEGRITY-VICTIM"

    def corrupting_check(seqs, pool, tables=None):  # runs on the engine thread, like every engine call
        # (the step's tables were built before this call: the changed mapping is caught by the
        # next step's check, and this step reads the tables that were checked)
        for s in seqs:
            if (
                s.block_table
                and len(s.output_token_ids) >= 2
                and marker in eng.tokenizer.decode(s.prompt_token_ids)
            ):
                ref = s.block_table[0]
                s.block_table[0] = PageRef(ref.page, ref.tag + 1)  # the mapping no longer matches the page
        return original(seqs, pool, tables)

    before = metric_sum(metrics(stack.url), "pagoda_integrity_mismatches_total")
    eng.integrity.check = corrupting_check
    try:
        r = post(
            stack, "/v1/completions", {"model": MODEL, "prompt": marker, "max_tokens": 8, "ignore_eos": True}
        )
        assert r.status_code == 500 and "integrity" in r.json()["error"]["message"].lower()
        with pytest.raises(openai.APIError, match="(?i)integrity"):
            for _ in client(stack).completions.create(
                model=MODEL, prompt=marker + "!", max_tokens=8, stream=True, extra_body={"ignore_eos": True}
            ):
                pass
    finally:
        eng.integrity.check = original
    m = wait_idle(stack.url)
    assert metric_sum(m, "pagoda_integrity_mismatches_total") >= before + 2
    assert metric_sum(m, "pagoda_kv_pages_used") == 0


def test_64_concurrent_streams_on_a_small_kv_budget_all_end_and_leak_nothing(stack) -> None:
    async def one(c: httpx.AsyncClient, i: int) -> str:
        body = {
            "model": MODEL,
            "prompt": f"[{i}] Tell me about the number {i}.",
            "max_tokens": 8,
            "temperature": 0.7,
            "seed": i,
            "stream": True,
        }
        async with c.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                assert r.status_code in (429, 503) and "retry-after" in r.headers
                return "rejected"
            last = ""
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    last = line
                    if '"error"' in line:
                        return "error"
            assert last == "data: [DONE]"
            return "done"

    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=stack.url, timeout=90) as c:
            return await asyncio.wait_for(asyncio.gather(*(one(c, i) for i in range(64))), 100)

    t0 = time.monotonic()
    results = asyncio.run(run())
    assert len(results) == 64 and set(results) <= {"done", "rejected", "error"}
    assert results.count("done") >= 48, results
    m = wait_idle(stack.url)
    assert metric_sum(m, "pagoda_kv_pages_used") == 0
    assert metric_sum(m, "pagoda_running_sequences") == 0 and metric_sum(m, "pagoda_waiting_sequences") == 0
    assert stack.aengine.num_inflight == 0
    assert time.monotonic() - t0 < 100


def test_health_ready_and_metrics_names(stack) -> None:
    assert httpx.get(stack.url + "/health").json() == {"status": "ok"}
    assert httpx.get(stack.url + "/ready").status_code == 200
    text = httpx.get(stack.url + "/metrics").text
    for name in (
        "pagoda_kv_pages_used",
        "pagoda_kv_pages_total",
        "pagoda_kv_capacity_tokens",
        "pagoda_generation_tokens_total",
        "pagoda_time_to_first_token_seconds_bucket",
        "pagoda_inter_token_latency_seconds_bucket",
        "pagoda_integrity_checks_total",
        "pagoda_integrity_mismatches_total",
        "pagoda_prompt_tokens_total",
        "pagoda_requests_total",
        "pagoda_running_sequences",
        "pagoda_waiting_sequences",
        "pagoda_prefix_cache_hit_tokens_total",
        "pagoda_weight_bytes",
        "pagoda_engine_info",
    ):
        assert f"{name}{{" in text and 'pool="both"' in text, name
    m = metrics(stack.url)
    assert metric_sum(m, "pagoda_kv_capacity_tokens") == stack.engine.decode_pool.capacity_tokens
    assert metric_sum(m, "pagoda_generation_tokens_total") > 0
    assert metric_sum(m, "pagoda_integrity_checks_total") > 0
    assert 'decode_kv="bf16"' in text and 'integrity="enforce"' in text
