"""The request tools and the literal example outputs every tool-call test reads, one list per family
(written from each family's documented format), and the helpers that compare parses."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from pagoda.node_agent.serving.api.toolcalls import CallStart, Event, Parsed, coalesce

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather forecast for a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string"},
                    "limit": {"type": "integer"},
                    "exact": {"type": "boolean"},
                    "filters": {"type": "object", "properties": {"tags": {"type": "array"}}},
                },
                "required": ["query"],
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
    },
]

RANDOM_ID = re.compile(r"call_[0-9a-f]{24}")


@dataclass
class Case:
    """One literal output and what parsing it must give: calls as ``(name, arguments, id)`` (id None:
    a fresh random one)."""

    label: str
    text: str
    content: str
    calls: list[tuple[str, dict, str | None]] = field(default_factory=list)
    invalid: int = 0
    strict: bool = True  # False: a leniency of the parser, beyond what the family's grammar writes


KS, KE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KB, KA, KC = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
KIMI = [
    Case(
        "two calls after text",
        f'Let me check.{KS}{KB}functions.get_weather:0{KA}{{"city": "Paris", "days": 3}}{KC}'
        f'{KB}functions.search:1{KA}{{"query": "museums", "limit": 5}}{KC}{KE}',
        "Let me check.",
        [
            ("get_weather", {"city": "Paris", "days": 3}, "functions.get_weather:0"),
            ("search", {"query": "museums", "limit": 5}, "functions.search:1"),
        ],
    ),
    Case(
        "newlines between the markers, no arguments",
        f"{KS}\n{KB}\nfunctions.get_time:7{KA}\n{{}}\n{KC}\n{KE}\n",
        "",
        [("get_time", {}, "functions.get_time:7")],
        strict=False,
    ),
    Case(
        "an unknown function beside a known one",
        f'{KS}{KB}functions.delete_all:0{KA}{{"really": true}}{KC}{KB}functions.get_time:1{KA}{{}}{KC}{KE}',
        f'{KB}functions.delete_all:0{KA}{{"really": true}}{KC}',
        [("get_time", {}, "functions.get_time:1")],
        invalid=1,
    ),
    Case(
        "arguments that are not JSON, then text",
        f'{KS}{KB}functions.get_weather:0{KA}{{"city": "Paris"{KC}{KE} Sorry.',
        f'{KB}functions.get_weather:0{KA}{{"city": "Paris"{KC} Sorry.',
        invalid=1,
    ),
    Case(
        "arguments that are a list",
        f"{KS}{KB}functions.get_time:0{KA}[1, 2]{KC}{KE}",
        f"{KB}functions.get_time:0{KA}[1, 2]{KC}",
        invalid=1,
    ),
    Case(
        "text only, with marker-like pieces",
        "a <| b <|tool_call x |> <|tool_calls_section",
        "a <| b <|tool_call x |> <|tool_calls_section",
    ),
    Case(
        "a call without its section, text after",
        f"{KB}functions.get_time:0{KA}{{}}{KC} ok",
        " ok",
        [("get_time", {}, "functions.get_time:0")],
        strict=False,
    ),
    Case(
        "a call cut off by the end of the output",
        f'Here.{KS}{KB}functions.get_weather:0{KA}{{"city": "Par',
        f'Here.{KB}functions.get_weather:0{KA}{{"city": "Par',
        invalid=1,
    ),
]

GLM45 = [
    Case(
        "two calls, coerced values",
        "I'll look.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>New York</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>\n<tool_call>search\n"
        "<arg_key>query</arg_key>\n<arg_value>42</arg_value>\n<arg_key>exact</arg_key>\n<arg_value>true</arg_value>\n"
        '<arg_key>filters</arg_key>\n<arg_value>{"tags": ["a", "b"]}</arg_value>\n</tool_call>',
        "I'll look.\n",
        [
            ("get_weather", {"city": "New York", "days": 2}, None),
            ("search", {"query": "42", "exact": True, "filters": {"tags": ["a", "b"]}}, None),
        ],
    ),
    Case(
        "a call without arguments, text after",
        "<tool_call>get_time\n</tool_call>\nDone.",
        "\nDone.",
        [("get_time", {}, None)],
    ),
    Case(
        "a value that is not JSON for an integer is a string",
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n<arg_key>days</arg_key>\n"
        "<arg_value>two</arg_value>\n</tool_call>",
        "",
        [("get_weather", {"city": "Rome", "days": "two"}, None)],
        strict=False,
    ),
    Case(
        "an unknown function",
        "<tool_call>launch\n<arg_key>target</arg_key>\n<arg_value>moon</arg_value>\n</tool_call>",
        "<tool_call>launch\n<arg_key>target</arg_key>\n<arg_value>moon</arg_value>\n</tool_call>",
        invalid=1,
    ),
    Case(
        "stray text between key and value",
        "<tool_call>get_weather\n<arg_key>city</arg_key>oops<arg_value>Oslo</arg_value>\n</tool_call>",
        "<tool_call>get_weather\n<arg_key>city</arg_key>oops<arg_value>Oslo</arg_value>\n</tool_call>",
        invalid=1,
    ),
    Case(
        "the end marker missing at the end of the output",
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Lyon</arg_value>\n",
        "",
        [("get_weather", {"city": "Lyon"}, None)],
        strict=False,
    ),
]

GLM47 = [
    Case(
        "two calls without newlines",
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value><arg_key>days</arg_key>"
        "<arg_value>1</arg_value></tool_call><tool_call>search<arg_key>query</arg_key><arg_value>true</arg_value>"
        "<arg_key>limit</arg_key><arg_value>10</arg_value></tool_call>",
        "",
        [
            ("get_weather", {"city": "Oslo", "days": 1}, None),
            ("search", {"query": "true", "limit": 10}, None),
        ],
    ),
    Case(
        "text around a call",
        "Checking <b>now</b>.<tool_call>get_time</tool_call> That is all.",
        "Checking <b>now</b>. That is all.",
        [("get_time", {}, None)],
    ),
    Case(
        "a value with markup and newlines stays raw",
        "<tool_call>search<arg_key>query</arg_key><arg_value>a < b\nand <i>c</i></arg_value></tool_call>",
        "",
        [("search", {"query": "a < b\nand <i>c</i>"}, None)],
    ),
]

DS_S, DS_E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_B, DS_C, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
DEEPSEEK_V3 = [
    Case(
        "two calls in fences",
        f'{DS_S}{DS_B}function{DS_SEP}get_weather\n```json\n{{"city": "Tokyo"}}\n```{DS_C}\n'
        f"{DS_B}function{DS_SEP}get_time\n```json\n{{}}\n```{DS_C}{DS_E}",
        "",
        [("get_weather", {"city": "Tokyo"}, None), ("get_time", {}, None)],
    ),
    Case(
        "text before, an unknown function",
        f'Sure｜ok.{DS_S}{DS_B}function{DS_SEP}fly\n```json\n{{"to": "Mars"}}\n```{DS_C}{DS_E}',
        f'Sure｜ok.{DS_B}function{DS_SEP}fly\n```json\n{{"to": "Mars"}}\n```{DS_C}',
        invalid=1,
    ),
    Case(
        "broken JSON inside the fence",
        f'{DS_S}{DS_B}function{DS_SEP}get_weather\n```json\n{{"city": Tokyo}}\n```{DS_C}{DS_E}',
        f'{DS_B}function{DS_SEP}get_weather\n```json\n{{"city": Tokyo}}\n```{DS_C}',
        invalid=1,
    ),
]

DEEPSEEK_V31 = [
    Case(
        "text, then two calls",
        f'Sure.{DS_S}{DS_B}get_weather{DS_SEP}{{"city": "Lima", "unit": "celsius"}}{DS_C}'
        f'{DS_B}search{DS_SEP}{{"query": "ceviche"}}{DS_C}{DS_E}',
        "Sure.",
        [("get_weather", {"city": "Lima", "unit": "celsius"}, None), ("search", {"query": "ceviche"}, None)],
    ),
    Case(
        "no separator",
        f"{DS_S}{DS_B}get_time{{}}{DS_C}{DS_E}",
        f"{DS_B}get_time{{}}{DS_C}",
        invalid=1,
    ),
]

HERMES = [
    Case(
        "two calls",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Berlin"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "search", "arguments": {"query": "beer", "exact": false}}\n</tool_call>',
        "",
        [("get_weather", {"city": "Berlin"}, None), ("search", {"query": "beer", "exact": False}, None)],
    ),
    Case(
        "text before and after",
        'Checking both.\n\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\nOne moment.',
        "Checking both.\n\n\nOne moment.",
        [("get_time", {}, None)],
    ),
    Case(
        "an unknown function and broken JSON",
        '<tool_call>\n{"name": "rm", "arguments": {}}\n</tool_call><tool_call>\n{"name": "get_time", "arguments": }\n</tool_call>',
        '<tool_call>\n{"name": "rm", "arguments": {}}\n</tool_call><tool_call>\n{"name": "get_time", "arguments": }\n</tool_call>',
        invalid=2,
    ),
    Case(
        "arguments given as a JSON string",
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Kyiv\\"}"}</tool_call>',
        "",
        [("get_weather", {"city": "Kyiv"}, None)],
        strict=False,
    ),
    Case(
        "text with marker-like pieces",
        "Compare a<b, <tools> and <tool_call",
        "Compare a<b, <tools> and <tool_call",
    ),
    Case(
        "a call left open, closed by the next",
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        "",
        [("get_time", {}, None), ("get_time", {}, None)],
        strict=False,
    ),
]

LLAMA3 = [
    Case(
        "one call",
        '{"name": "get_weather", "parameters": {"city": "Madrid"}}',
        "",
        [("get_weather", {"city": "Madrid"}, None)],
    ),
    Case(
        "two calls separated by ;",
        '<|python_tag|>{"name": "search", "parameters": {"query": "a } b { c \\" ]"}}; {"name": "get_time", "parameters": {}}',
        "",
        [("search", {"query": 'a } b { c " ]'}, None), ("get_time", {}, None)],
    ),
    Case("plain text", "The weather is {probably} nice.", "The weather is {probably} nice."),
    Case("a JSON answer is content, not a call", ' {"answer": 42}', ' {"answer": 42}'),
    Case(
        "an unknown function, then text",
        '{"name": "format_disk", "parameters": {}} and that is it',
        '{"name": "format_disk", "parameters": {}} and that is it',
        invalid=1,
    ),
    Case(
        "an object never closed",
        '{"name": "get_time", "parameters": {',
        '{"name": "get_time", "parameters": {',
        invalid=1,
    ),
]

GENERIC = [
    Case(
        "two calls",
        '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]}',
        "",
        [("get_weather", {"city": "Paris"}, None), ("get_time", {}, None)],
    ),
    Case("content", '{"content": "Hello there!"}', "Hello there!"),
    Case("not JSON", "Hello, {world", "Hello, {world", invalid=1),
    Case(
        "an unknown function beside a known one",
        '{"tool_calls": [{"name": "nope", "arguments": {}}, {"name": "search", "arguments": "{\\"query\\": \\"x\\"}"}]}',
        '{"name": "nope", "arguments": {}}',
        [("search", {"query": "x"}, None)],
        invalid=1,
    ),
    Case(
        "arguments not an object",
        '{"tool_calls": [{"name": "get_time", "arguments": 3}]}',
        '{"name": "get_time", "arguments": 3}',
        invalid=1,
    ),
    Case("neither calls nor content", '{"answer": 1}', '{"answer": 1}', invalid=1),
]

CASES: dict[str, list[Case]] = {
    "kimi_k2": KIMI,
    "glm45": GLM45,
    "glm47": GLM47,
    "deepseek_v3": DEEPSEEK_V3,
    "deepseek_v31": DEEPSEEK_V31,
    "hermes": HERMES,
    "llama3_json": LLAMA3,
    "generic": GENERIC,
}


def all_cases() -> list[tuple[str, Case]]:
    return [(name, case) for name, cases in CASES.items() for case in cases]


def case_id(item: tuple[str, Case]) -> str:
    return f"{item[0]}: {item[1].label}"


def check(parsed: Parsed, case: Case) -> None:
    """``parsed`` is what ``case`` says: content, calls (names, arguments, ids) and the count."""
    assert parsed.content == case.content
    got = [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]
    assert got == [(name, args) for name, args, _ in case.calls]
    for call, (_, _, want_id) in zip(parsed.tool_calls, case.calls, strict=True):
        assert call.id == want_id if want_id else RANDOM_ID.fullmatch(call.id), call.id
    assert parsed.invalid == case.invalid


def normalized(events: list[Event]) -> list[Event]:
    """Coalesced events with random call ids replaced by one placeholder."""
    out = []
    for ev in coalesce(events):
        if isinstance(ev, CallStart) and RANDOM_ID.fullmatch(ev.id):
            ev = CallStart(ev.index, "call_RANDOM", ev.name)
        out.append(ev)
    return out
