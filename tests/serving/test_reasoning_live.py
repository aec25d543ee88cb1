"""Reasoning content with a thinking-style template (``--chat-template``): the generation prompt
opens ``<think>``, so what the model writes before ``</think>`` is ``reasoning_content``; with
``--reasoning-parser none`` it stays in ``content``."""

from __future__ import annotations

from pathlib import Path

import pytest

from .apps import live_app

pytestmark = pytest.mark.slow
TEMPLATE = Path(__file__).parent.parent / "data" / "chat_templates" / "thinking_chatml.jinja"
ASK = [{"role": "user", "content": "What is 2 + 2?"}]


def test_a_thinking_template_splits_reasoning_from_content(make_engine) -> None:
    import openai

    with live_app(make_engine, chat_template=str(TEMPLATE)) as (srv, _app):
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        r = client.chat.completions.create(model="smollm2-135m", messages=ASK, max_tokens=8, temperature=0)
        msg = r.choices[0].message
        thought = getattr(msg, "reasoning_content", None) or (msg.model_extra or {}).get("reasoning_content")
        assert thought, msg  # the model never closes the block in 8 tokens: all of it is reasoning
        assert not msg.content
        parts = [c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in client.chat.completions.create(
            model="smollm2-135m", messages=ASK, max_tokens=8, temperature=0, stream=True) if c.choices]  # fmt: skip
        assert "".join(parts) == thought
    with live_app(make_engine, "--reasoning-parser", "none", chat_template=str(TEMPLATE)) as (srv, _app):
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        r = client.chat.completions.create(model="smollm2-135m", messages=ASK, max_tokens=8, temperature=0)
        assert r.choices[0].message.content == thought
