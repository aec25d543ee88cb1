"""Logprobs over HTTP with the official openai client: chat and completions, streamed and not, echo
with prompt logprobs, and the shapes without a server (router fill-in, offsets)."""

from __future__ import annotations

import math

import openai
import pytest

from pagoda.node_agent.serving.api.backend import StreamChunk
from pagoda.node_agent.serving.api.logprobs import Shaper
from pagoda.node_agent.serving.router.router import Lead

from .conftest import CHAT, MODEL, PROMPTS

pytestmark = [pytest.mark.serve, pytest.mark.timeout(300)]

N_NEW = 4


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def check_chat(url: str, offline: str) -> None:
    """Chat logprobs through the API at ``url``, non-streamed then streamed: same entries both ways."""
    c = client(url)
    r = c.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=N_NEW, temperature=0, logprobs=True, top_logprobs=3
    )
    choice = r.choices[0]
    content = choice.logprobs.content
    assert choice.message.content == offline[: len(choice.message.content)]
    assert "".join(t.token for t in content) == choice.message.content
    assert len(content) == r.usage.completion_tokens == N_NEW
    for t in content:
        tops = [a.logprob for a in t.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert t.logprob == tops[0] and t.logprob <= 0  # greedy: the sampled token is the top one
        assert t.bytes == list(t.token.encode())
    streamed = []
    for ev in c.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=N_NEW,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        stream=True,
    ):
        for ch in ev.choices:
            if ch.logprobs is not None:
                streamed += ch.logprobs.content or []
    assert [t.token for t in streamed] == [t.token for t in content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-4)


def check_completions(url: str) -> None:
    """Legacy completions: logprobs N, echo with prompt logprobs, streamed and not."""
    c = client(url)
    prompt = PROMPTS[0]
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=N_NEW, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == N_NEW
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(N_NEW)]
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) <= 2 and max(top.values()) == pytest.approx(val)
        assert top.get(tok, val) == pytest.approx(val)

    e = c.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=1, echo=True)
    elp, text = e.choices[0].logprobs, e.choices[0].text
    assert text.startswith(prompt) and text[len(prompt) :] == lp.tokens[0]
    n_prompt = e.usage.prompt_tokens
    assert len(elp.tokens) == n_prompt + 1 and elp.token_logprobs[0] is None and elp.top_logprobs[0] is None
    assert "".join(elp.tokens) == text
    assert all(v is not None and v <= 0 for v in elp.token_logprobs[1:])
    assert elp.token_logprobs[-1] == pytest.approx(lp.token_logprobs[0], abs=1e-4)
    assert elp.text_offset[-1] == len(prompt)

    parts, tokens, offsets = [], [], []
    for ev in c.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, temperature=0, logprobs=1, echo=True, stream=True
    ):
        for ch in ev.choices:
            parts.append(ch.text)
            if ch.logprobs is not None:
                tokens += ch.logprobs.tokens
                offsets += ch.logprobs.text_offset
    assert "".join(parts).startswith(text) and "".join(tokens) == "".join(parts)
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


def test_chat_logprobs_with_the_openai_client(stack) -> None:
    check_chat(stack.url, stack.offline_chat)


def test_completions_logprobs_and_echo_with_the_openai_client(stack) -> None:
    check_completions(stack.url)


def test_sampled_chat_logprobs_are_log_probabilities_of_the_kept_tokens(stack) -> None:
    r = client(stack.url).chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=3,
        temperature=0.8,
        top_p=0.9,
        seed=3,
        logprobs=True,
        top_logprobs=20,
        extra_body={"top_k": 10},
    )
    for t in r.choices[0].logprobs.content:
        assert 1 <= len(t.top_logprobs) <= 10  # only the tokens top-k and top-p keep are listed
        total = sum(math.exp(a.logprob) for a in t.top_logprobs)
        assert total == pytest.approx(1.0, abs=1e-4)  # all of them, renormalized
        assert t.logprob in [a.logprob for a in t.top_logprobs]


# ---------------------------------------------------------------------------- without a server


def entry(token: str, lp: float) -> dict:
    return {"token": token, "logprob": lp, "bytes": list(token.encode()), "top_logprobs": []}


def test_the_router_puts_the_prefill_workers_entries_in_place() -> None:
    lead = Lead.of(
        {"logprobs": [entry("A", -0.1)], "prompt_logprobs": [None, entry("y", -2.0)], "prompt_text": "xy"}
    )
    first = lead.fill(StreamChunk("AB", 2, logprobs=[None, entry("B", -0.2)]))
    assert [e["token"] for e in first.logprobs] == ["A", "B"]
    assert first.prompt_logprobs[1]["token"] == "y" and first.prompt_text == "xy"
    later = lead.fill(StreamChunk("C", 3, logprobs=[entry("C", -0.3)]))
    assert later.prompt_logprobs is None and [e["token"] for e in later.logprobs] == ["C"]


def test_completions_echo_of_token_ids_uses_the_decoded_prompt() -> None:
    shaper = Shaper(False, [[5, 6, 7]], echo=True)
    c = StreamChunk(
        " ok",
        1,
        True,
        "length",
        logprobs=[entry(" ok", -0.5)],
        prompt_logprobs=[None, entry("b", -1.0), entry("c", -2.0)],
        prompt_text="abc",
    )
    text, lp = shaper.final(0, c.delta, c)
    assert text == "abc ok"
    assert lp["tokens"] == ["a", "b", "c", " ok"]
    assert lp["token_logprobs"] == [None, -1.0, -2.0, -0.5]
    assert lp["text_offset"] == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/completions", {"logprobs": 21}, "logprobs"),
        ("/v1/completions", {"logprobs": True}, "logprobs"),
    ],
)
def test_bad_logprobs_values_are_400s_naming_the_field(stack, path, extra, param) -> None:
    c = client(stack.url)
    base = {"messages": CHAT} if "chat" in path else {"prompt": "hi"}
    with pytest.raises(openai.BadRequestError) as e:
        c.post(
            path.removeprefix("/v1"), body={"model": MODEL, "max_tokens": 1, **base, **extra}, cast_to=object
        )
    body = e.value.body
    assert body.get("error", body)["param"] == param
