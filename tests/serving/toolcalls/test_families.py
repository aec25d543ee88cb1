"""Each family's parser on literal outputs in its format: calls, text around them, malformed calls
and unknown functions (never returned as calls), and content released as soon as it can be."""

from __future__ import annotations

import pytest

from pagoda.node_agent.serving.api.toolcalls import (
    PARSERS,
    ArgsDelta,
    CallStart,
    TextDelta,
    get_parser,
    parse,
)
from tests.serving.toolcalls.cases import CASES, TOOLS, all_cases, case_id, check


@pytest.mark.parametrize("item", all_cases(), ids=case_id)
def test_literal_outputs_parse(item):
    name, case = item
    check(parse(name, TOOLS, case.text), case)


def test_every_parser_has_literal_cases():
    assert set(PARSERS) == set(CASES)
    assert all(len(cases) >= 2 for cases in CASES.values())


def test_an_unknown_parser_is_a_value_error_naming_the_known_ones():
    with pytest.raises(ValueError, match="kimi_k2") as err:
        get_parser("nonesuch")
    assert "nonesuch" in str(err.value) and "hermes" in str(err.value)


@pytest.mark.parametrize("name", sorted(set(PARSERS) - {"generic"}))
def test_no_tools_means_no_calls(name):
    for case in CASES[name]:
        parsed = parse(name, [], case.text)
        assert parsed.tool_calls == [] and parsed.invalid == len(case.calls) + case.invalid


@pytest.mark.parametrize(
    ("name", "first", "released"),
    [
        ("hermes", "Hello <tool", "Hello "),
        ("hermes", "Hello <b", "Hello <b"),
        ("glm45", "Sure, <tool_ca", "Sure, "),
        ("kimi_k2", "One <|tool_calls_sec", "One "),
        ("kimi_k2", "One <|tool_call_be", "One "),
        ("deepseek_v3", "Ok <｜tool▁ca", "Ok "),
        ("llama3_json", "The answer", "The answer"),
    ],
)
def test_content_is_held_back_only_while_it_could_be_a_marker(name, first, released):
    parser = get_parser(name)(TOOLS)
    events = parser.feed(first)
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == released


def test_a_call_is_announced_with_its_whole_arguments_when_it_closes():
    parser = get_parser("hermes")(TOOLS)
    assert parser.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Ri') == []
    events = parser.feed('o"}}\n</tool_call>')
    assert [type(e) for e in events] == [CallStart, ArgsDelta]
    assert events[0].index == 0 and events[0].name == "get_weather" and events[1].text == '{"city": "Rio"}'


def test_the_call_index_counts_only_calls_returned():
    text = '<tool_call>{"name": "x", "arguments": {}}</tool_call><tool_call>{"name": "get_time"}</tool_call>'
    parser = get_parser("hermes")(TOOLS)
    starts = [e for e in parser.feed(text) + parser.finish() if isinstance(e, CallStart)]
    assert [s.index for s in starts] == [0] and parser.invalid == 1


def test_tools_without_the_function_wrapper_and_odd_entries_are_tolerated():
    tools = [{"name": "get_time"}, "junk", {"type": "function", "function": {"description": "no name"}}]
    parsed = parse("hermes", tools, '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    assert [c.name for c in parsed.tool_calls] == ["get_time"]
