"""Prompts are measured and tokenized off the engine loop: text over the byte limit is a 413 before
any tokenizing, a prompt over the model length is a 400 decided on a tokenizer thread, and a flood
of oversized prompts leaves another client's stream to finish. (The delay the flood adds to that
stream is measured by bench/prompt_flood.py, not asserted here.)"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from .conftest import MODEL
from .live import wait_idle

pytestmark = [pytest.mark.serve, pytest.mark.timeout(180)]

HUGE = "All work and no play makes Jack a dull boy. " * 23_000  # ~1 MiB, inside the body limit


def post(url: str, body: dict) -> httpx.Response:
    return httpx.post(
        url, content=json.dumps(body).encode(), timeout=120, headers={"content-type": "application/json"}
    )


def stream_text(url: str, max_tokens: int) -> tuple[list[str], str]:
    body = {
        "model": MODEL,
        "prompt": "Count to twenty:",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    data = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                data.append(line[6:])
    last = json.loads(data[-2])
    return data, last["choices"][0]["finish_reason"]


@pytest.fixture
def tokenize_threads(stack):
    """(thread name, prompt kind) of every engine.tokenize call while the test runs."""
    calls: list[tuple[str, str]] = []
    original = stack.engine.tokenize

    def spy(prompt, chat=False):
        ids = isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)
        calls.append((threading.current_thread().name, "ids" if ids else "text"))
        return original(prompt, chat)

    stack.engine.tokenize = spy
    try:
        yield calls
    finally:
        del stack.engine.tokenize


def test_a_flood_of_huge_prompts_gets_413s_and_another_stream_finishes(stack, tokenize_threads) -> None:
    assert len(json.dumps({"model": MODEL, "prompt": HUGE})) < 1 << 20
    flood = [{"model": MODEL, "prompt": HUGE, "max_tokens": 4}] * 12
    flood += [{"model": MODEL, "messages": [{"role": "user", "content": HUGE}], "max_tokens": 4}] * 4
    with ThreadPoolExecutor(17) as pool:
        other = pool.submit(stream_text, stack.url, 12)
        answers = list(
            pool.map(
                lambda b: post(
                    stack.url + ("/v1/chat/completions" if "messages" in b else "/v1/completions"), b
                ),
                flood,
            )
        )
        data, reason = other.result(120)
    for body, r in zip(flood, answers, strict=True):
        assert r.status_code == 413, r.text
        err = r.json()["error"]
        assert err["code"] == "prompt_too_large"
        assert err["param"] == ("messages" if "messages" in body else "prompt")
        assert f"at most {stack.aengine.max_prompt_bytes} bytes" in err["message"]
    assert data[-1] == "[DONE]" and reason == "length"
    assert all(kind == "ids" for _, kind in tokenize_threads if not _.startswith("pagoda-tokenize"))
    assert tokenize_threads.count(("pagoda-engine", "text")) == 0
    wait_idle(stack.url)


def test_the_token_count_is_checked_on_a_tokenizer_thread(stack, tokenize_threads) -> None:
    long = " ".join(f"w{i}" for i in range(1500))  # under the byte limit, over the 512-token length
    assert len(long) < stack.aengine.max_prompt_bytes
    r = post(stack.url + "/v1/completions", {"model": MODEL, "prompt": long, "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt" and "model length" in r.json()["error"]["message"]
    ok = post(
        stack.url + "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    )
    assert ok.status_code == 200, ok.text
    text_calls = [name for name, kind in tokenize_threads if kind == "text"]
    assert len(text_calls) == 2 and all(n.startswith("pagoda-tokenize") for n in text_calls)
    assert [n for n, kind in tokenize_threads if kind == "ids"] == ["pagoda-engine"]  # the accepted one
    wait_idle(stack.url)


def test_a_worker_refuses_prompt_text_over_its_byte_limit_before_tokenizing(stack, tokenize_threads) -> None:
    """What a prefill worker does with a prompt the router forwarded: the same limit, as a
    RequestError naming the prompt (a 400), with the tokenizer never called."""
    import asyncio

    from pagoda.node_agent.params import PROMPT, RequestError, SamplingParams

    async def submit(prompt, chat: bool) -> None:
        await stack.aengine.submit(prompt, SamplingParams(max_tokens=2), chat=chat, prefill_only=True)

    for prompt, chat, field in (
        (HUGE, False, "prompt"),
        ([{"role": "user", "content": HUGE}], True, "messages"),
    ):
        with pytest.raises(RequestError, match=f"^{field}: the prompt text is over") as info:
            asyncio.run(submit(prompt, chat))
        assert info.value.param == PROMPT
    assert tokenize_threads == []
    assert stack.aengine.num_inflight == 0


def test_the_gil_switch_interval_flag_sets_the_process_interval() -> None:
    """``--gil-switch-interval``: its default, a value, 0 (Python's own kept) and a negative refused."""
    import sys

    from pagoda.node_agent.cli.serve import DEFAULT_SWITCH_INTERVAL_S, apply_switch_interval

    from .apps import serve_args

    before = sys.getswitchinterval()
    try:
        assert serve_args().gil_switch_interval == DEFAULT_SWITCH_INTERVAL_S
        apply_switch_interval(serve_args("--gil-switch-interval", "0.002").gil_switch_interval)
        assert sys.getswitchinterval() == pytest.approx(0.002)
        apply_switch_interval(0)
        assert sys.getswitchinterval() == pytest.approx(0.002)  # unchanged
        with pytest.raises(SystemExit, match="must be >= 0"):
            apply_switch_interval(-1)
    finally:
        sys.setswitchinterval(before)


def test_tokenizer_threads_run_below_the_engine_threads_priority(stack) -> None:
    """A tokenizer thread's nice value is the process's plus TOKENIZE_NICE (capped at 19), so a
    flood being tokenized yields a busy CPU to the engine thread."""
    import os
    import threading

    from pagoda.node_agent.serving.worker.async_engine import TOKENIZE_NICE

    base = os.getpriority(os.PRIO_PROCESS, 0)

    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    assert stack.aengine._tokenize_pool.submit(nice).result(30) == min(19, base + TOKENIZE_NICE)
    assert nice() == base  # this (the caller's) thread unchanged
