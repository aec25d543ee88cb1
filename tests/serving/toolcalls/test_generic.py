"""The generic mode: the envelope schema (each call validated against its function's parameters,
per tool_choice and parallel_tool_calls), the system prompt, and the history as plain turns."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pagoda.node_agent.serving.api.toolcalls import (
    envelope_schema,
    parse,
    render_history,
    system_prompt,
    with_system_prompt,
)
from tests.serving.toolcalls.cases import TOOLS

NAMED = {"type": "function", "function": {"name": "search"}}
WEATHER = {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}
TIME = {"name": "get_time", "arguments": {}}


def _valid(schema, reply) -> bool:
    try:
        jsonschema.validate(reply, schema)
    except jsonschema.ValidationError:
        return False
    return True


@pytest.mark.parametrize(
    ("choice", "parallel", "reply", "ok"),
    [
        ("auto", True, {"tool_calls": [WEATHER, TIME]}, True),
        ("auto", True, {"content": "Hi"}, True),
        (None, True, {"content": "Hi"}, True),
        ("auto", True, {"tool_calls": [{"name": "nope", "arguments": {}}]}, False),
        (
            "auto",
            True,
            {"tool_calls": [{"name": "get_weather", "arguments": {"days": 2}}]},
            False,
        ),  # city required
        ("auto", True, {"tool_calls": [{"name": "get_weather", "arguments": {"city": 3}}]}, False),
        ("auto", True, {"tool_calls": []}, False),
        ("auto", True, {"content": "Hi", "tool_calls": [TIME]}, False),
        ("required", True, {"tool_calls": [WEATHER, TIME]}, True),
        ("required", True, {"content": "Hi"}, False),
        ("required", False, {"tool_calls": [WEATHER]}, True),
        ("required", False, {"tool_calls": [WEATHER, TIME]}, False),
        (NAMED, True, {"tool_calls": [{"name": "search", "arguments": {"query": "x"}}]}, True),
        (NAMED, True, {"tool_calls": [TIME]}, False),
        ("none", True, {"content": "Hi"}, True),
        ("none", True, {"tool_calls": [TIME]}, False),
    ],
)
def test_the_envelope_schema(choice, parallel, reply, ok):
    schema = envelope_schema(TOOLS, choice, parallel)
    jsonschema.Draft202012Validator.check_schema(schema)
    assert _valid(schema, reply) is ok


def test_a_named_function_that_is_not_offered_is_a_value_error():
    with pytest.raises(ValueError, match="launch"):
        envelope_schema(TOOLS, {"type": "function", "function": {"name": "launch"}}, True)


def test_a_function_without_parameters_takes_any_object():
    schema = envelope_schema([{"type": "function", "function": {"name": "ping"}}], "required", True)
    assert _valid(schema, {"tool_calls": [{"name": "ping", "arguments": {"any": 1}}]})
    assert not _valid(schema, {"tool_calls": [{"name": "ping", "arguments": [1]}]})


def test_every_envelope_the_schema_admits_parses_to_its_calls():
    reply = json.dumps({"tool_calls": [WEATHER, TIME]})
    assert _valid(envelope_schema(TOOLS, "required", True), json.loads(reply))
    parsed = parse("generic", TOOLS, reply)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        (WEATHER["name"], WEATHER["arguments"]),
        (TIME["name"], TIME["arguments"]),
    ]


def test_the_system_prompt_offers_the_tools_and_the_envelope():
    auto = system_prompt(TOOLS, "auto")
    assert all(name in auto for name in ("get_weather", "search", "get_time", "forecast for a city"))
    assert '"tool_calls"' in auto and '"content"' in auto
    required = system_prompt(TOOLS, "required", parallel_tool_calls=False)
    assert '"content"' not in required and "one function at a time" in required
    named = system_prompt(TOOLS, NAMED)
    assert "search" in named and "get_weather" not in named
    assert system_prompt(TOOLS, "none") == ""


HISTORY = [
    {"role": "system", "content": "Be brief."},
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "Weather in Paris, "},
            {"type": "text", "text": "and the time?"},
        ],
    },
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
    {"role": "assistant", "content": "Sunny, 21 C; it is 14:05."},
]


def test_history_renders_as_plain_turns():
    turns = render_history(HISTORY)
    assert [t["role"] for t in turns] == ["system", "user", "assistant", "user", "assistant"]
    assert all(set(t) == {"role", "content"} and isinstance(t["content"], str) for t in turns)
    assert turns[1]["content"] == "Weather in Paris, and the time?"
    assert json.loads(turns[2]["content"]) == {
        "tool_calls": [
            {"name": "get_weather", "arguments": {"city": "Paris"}},
            {"name": "get_time", "arguments": {}},
        ]
    }
    assert "get_weather" in turns[3]["content"] and "Sunny, 21 C" in turns[3]["content"]
    assert "get_time" in turns[3]["content"] and "14:05" in turns[3]["content"]
    parsed = parse("generic", TOOLS, turns[2]["content"])  # the model sees its own format in the history
    assert [c.name for c in parsed.tool_calls] == ["get_weather", "get_time"]


def test_the_system_prompt_joins_the_history():
    merged = with_system_prompt(render_history(HISTORY), "TOOLS HERE")
    assert merged[0] == {"role": "system", "content": "Be brief.\n\nTOOLS HERE"} and len(merged) == 5
    fresh = with_system_prompt([{"role": "user", "content": "hi"}], "TOOLS HERE")
    assert fresh[0] == {"role": "system", "content": "TOOLS HERE"} and fresh[1]["role"] == "user"
