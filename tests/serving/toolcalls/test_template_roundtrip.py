"""Token-level round trip: an assistant turn with calls, rendered by a chat template in the family's
format (tests/data/chat_templates, through transformers' chat-template rendering), tokenized by the
built-in model's tokenizer, detokenized token by token as the engine does and streamed into the
family's parser, gives back the same calls (and reasoning, and content)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagoda.node_agent.models.tokenizer import Detokenizer
from pagoda.node_agent.serving.api.toolcalls import (
    PARSERS,
    OutputParser,
    assemble,
    detect_reasoning_parser,
    get_parser,
    reasoning_parser_for,
    render_history,
    system_prompt,
    with_system_prompt,
)
from tests.serving.toolcalls.cases import TOOLS

TEMPLATES = Path(__file__).resolve().parents[2] / "data" / "chat_templates"
END_OF_TURN = {
    "kimi_k2": "<|im_end|>",
    "hermes": "<|im_end|>\n",
    "deepseek_v3": "<｜end▁of▁sentence｜>",
    "deepseek_v31": "<｜end▁of▁sentence｜>",
    "llama3_json": "<|eot_id|>",
    "glm45": "",
    "glm47": "",
}
CALLS = [
    ("functions.get_weather:0", "get_weather", {"city": "São Paulo", "days": 3, "unit": "celsius"}),
    (
        "functions.search:1",
        "search",
        {"query": 'café "au lait" <b> 42', "exact": True, "filters": {"tags": ["a", "b"]}},
    ),
    ("functions.get_time:2", "get_time", {}),
]
CONTENT = "Let me look these up."
REASONING = "The user wants two things; I will call both tools."


def _assistant(content: str | None, reasoning: str | None = None) -> dict:
    msg = {
        "role": "assistant",
        "content": content,
        "tool_calls": [
            {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
            for cid, name, args in CALLS
        ],
    }
    if reasoning:
        msg["reasoning_content"] = reasoning
    return msg


def _conversation(assistant: dict) -> list[dict]:
    return [
        {"role": "system", "content": "You help with errands."},
        {"role": "user", "content": "Weather in São Paulo, a café search, and the time?"},
        assistant,
    ]


def _render(hf, messages, template, generation_prompt, tools=TOOLS):
    return hf.apply_chat_template(
        messages, tools=tools, chat_template=template, tokenize=False, add_generation_prompt=generation_prompt
    )


def _assistant_text(hf, messages, template, end_of_turn, tools=TOOLS) -> tuple[str, str]:
    """The rendered prompt before the last (assistant) message, and that message's own text."""
    prompt = _render(hf, messages[:-1], template, True, tools)
    full = _render(hf, messages, template, False, tools)
    assert full.startswith(prompt)
    turn = full[len(prompt) :]
    assert turn.endswith(end_of_turn)
    return prompt, turn[: len(turn) - len(end_of_turn)]


def _stream_tokens(tokenizer, text: str, parser: OutputParser):
    """Feed ``text`` to ``parser`` as the engine would: token ids decoded incrementally."""
    ids = tokenizer._tok.encode(text, add_special_tokens=False)
    detok, seen, events = Detokenizer(tokenizer), "", []
    for i in range(1, len(ids) + 1):
        now = detok.update(ids[:i])
        events += parser.feed(now[len(seen) :])
        seen = now
    assert seen == text  # the tokenizer round-trips the text
    return events + parser.finish(), len(ids)


# a Llama-3 JSON reply is calls or content, never both
FAMILY_REPLIES = [(n, False) for n in sorted(END_OF_TURN)] + [
    (n, True) for n in sorted(END_OF_TURN) if n != "llama3_json"
]


@pytest.mark.parametrize(("name", "with_content"), FAMILY_REPLIES)
def test_calls_rendered_by_the_family_template_stream_back(builtin_tokenizer, name, with_content):
    template = (TEMPLATES / f"{name}.jinja").read_text()
    messages = _conversation(_assistant(CONTENT if with_content else None))
    _, text = _assistant_text(builtin_tokenizer._tok, messages, template, END_OF_TURN[name])
    parser = OutputParser(get_parser(name)(TOOLS))
    events, n_tokens = _stream_tokens(builtin_tokenizer, text, parser)
    parsed = assemble(events, parser.invalid)
    assert n_tokens > 20 and parsed.invalid == 0
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [(n, a) for _, n, a in CALLS]
    if name == "kimi_k2":
        assert [c.id for c in parsed.tool_calls] == [cid for cid, _, _ in CALLS]
    assert parsed.content.strip() == (CONTENT if with_content else "")


@pytest.mark.parametrize("name", ["kimi_k2", "hermes"])
def test_reasoning_then_calls_stream_back(builtin_tokenizer, name):
    template = (TEMPLATES / f"{name}.jinja").read_text()
    messages = _conversation(_assistant(CONTENT, REASONING))
    prompt, text = _assistant_text(builtin_tokenizer._tok, messages, template, END_OF_TURN[name])
    reasoning = reasoning_parser_for(detect_reasoning_parser(None, template), prompt[-64:])
    parser = OutputParser(get_parser(name)(TOOLS), reasoning)
    events, _ = _stream_tokens(builtin_tokenizer, text, parser)
    parsed = assemble(events, parser.invalid)
    assert parsed.reasoning.strip() == REASONING and parsed.content.strip() == CONTENT
    assert [c.name for c in parsed.tool_calls] == [n for _, n, _ in CALLS]


@pytest.mark.parametrize("name", sorted(END_OF_TURN))
def test_templates_render_tool_results_in_the_history(builtin_tokenizer, name):
    template = (TEMPLATES / f"{name}.jinja").read_text()
    messages = _conversation(_assistant(None)) + [
        {"role": "tool", "tool_call_id": cid, "content": f"result {i}"} for i, (cid, _, _) in enumerate(CALLS)
    ]
    text = _render(builtin_tokenizer._tok, messages, template, True)
    assert all(f"result {i}" in text for i in range(len(CALLS))) and "get_weather" in text


def test_the_generic_envelope_round_trips_through_the_builtin_template(builtin_tokenizer):
    """No tool support in SmolLM2's own template: the history goes as plain turns, the reply as the
    JSON envelope, and the generic parser reads the calls back from the tokens."""
    hf = builtin_tokenizer._tok
    messages = with_system_prompt(
        render_history(_conversation(_assistant(None))), system_prompt(TOOLS, "auto")
    )
    prompt = hf.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    full = hf.apply_chat_template(messages, tokenize=False)
    assert full.startswith(prompt) and "get_weather" in prompt
    text = full[len(prompt) :].removesuffix("<|im_end|>\n")
    parser = OutputParser(get_parser("generic")(TOOLS))
    events, _ = _stream_tokens(builtin_tokenizer, text, parser)
    parsed = assemble(events, parser.invalid)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [(n, a) for _, n, a in CALLS]


def test_every_family_parser_has_a_template():
    assert set(END_OF_TURN) == set(PARSERS) - {"generic"}
