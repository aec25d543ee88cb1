"""Tool calls and structured outputs with the official ``openai`` client against a live server on
the built-in model (generic mode: its template has no tool support), streamed and not."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from pagoda.node_agent.bench.tool_suite import CASES, FUNCTIONS

from .apps import live_app

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"
MAX_TOKENS = 512


@pytest.fixture(scope="module")
def server(make_engine):
    # 512 MiB of float32 KV holds about 11,000 tokens: every 8 requests in flight at once
    with live_app(make_engine, max_num_seqs=16, kv_memory=512 << 20, max_model_len=1024) as (srv, _app):
        yield srv


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai", reason="the official client is a dev dependency")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)


def check_calls(calls, tools: list[dict]) -> None:
    """Each call names an offered function and its arguments validate against its schema."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert calls, "no tool call"
    for call in calls:
        assert call.type == "function"
        assert call.id
        assert call.function.name in schemas, call.function.name
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def ask(client, case, stream: bool):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": case.prompt}],
        "tools": case.tool_dicts(),
        "tool_choice": "required",
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    if not stream:
        r = client.chat.completions.create(**body)
        return r.choices[0].message.tool_calls, r.choices[0].finish_reason
    with client.chat.completions.stream(**body) as s:
        for _ in s:
            pass
        final = s.get_final_completion()
    return final.choices[0].message.tool_calls, final.choices[0].finish_reason


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_required_tool_choice_gives_valid_calls_for_every_suite_prompt(client, stream: bool) -> None:
    assert len(CASES) >= 40 and {len(c.tools) for c in CASES} == {1, 2, 3, 4}
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda c: ask(client, c, stream), CASES))
    for case, (calls, reason) in zip(CASES, results, strict=True):
        check_calls(calls, case.tool_dicts())
        assert reason == "tool_calls", (case.prompt, reason)


def test_a_named_function_is_the_one_called(client) -> None:
    tools = [FUNCTIONS["get_weather"], FUNCTIONS["get_time"]]
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What's the weather in Rome?"}],
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    calls = r.choices[0].message.tool_calls
    check_calls(calls, tools)
    assert {c.function.name for c in calls} == {"get_time"}


def test_no_parallel_calls_gives_exactly_one(client) -> None:
    case = CASES[0]
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": case.prompt}],
        tools=case.tool_dicts(),
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert len(r.choices[0].message.tool_calls) == 1


def test_auto_answers_or_calls_and_a_tool_result_turn_is_accepted(client) -> None:
    tools = [FUNCTIONS["get_weather"]]
    history = [
        {"role": "user", "content": "What's the weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"location": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    r = client.chat.completions.create(
        model=MODEL, messages=history, tools=tools, max_tokens=MAX_TOKENS, temperature=0
    )
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "tool_calls", "length")
    if choice.message.tool_calls:
        check_calls(choice.message.tool_calls, tools)
    else:
        assert isinstance(choice.message.content, str)


SCHEMAS = [
    {
        "type": "object",
        "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["city", "population"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "colors": {"type": "array", "items": {"type": "string"}, "minItems": 2, "maxItems": 3}
        },
        "required": ["colors"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}, "confidence": {"type": "number"}},
        "required": ["answer", "confidence"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "email": {"type": "string"},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
]
QUESTIONS = [
    "Describe the largest city in Japan.",
    "Name some colors of the rainbow.",
    "Is the sun a star?",
    "Invent a person.",
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_json_schema_strict_replies_validate(client, stream: bool) -> None:
    def one(i: int) -> str:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": QUESTIONS[i]}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "r", "schema": SCHEMAS[i], "strict": True},
            },
            "max_tokens": MAX_TOKENS,
            "temperature": 0.7,
            "seed": i,
        }
        if not stream:
            r = client.chat.completions.create(**body)
            assert r.choices[0].finish_reason == "stop"
            return r.choices[0].message.content
        parts = [
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(**body, stream=True)
            if c.choices
        ]
        return "".join(parts)

    with ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(one, range(len(SCHEMAS))))
    for text, schema in zip(texts, SCHEMAS, strict=True):
        jsonschema.validate(json.loads(text), schema)


def test_json_object_replies_parse(client) -> None:
    def one(q: str):
        r = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"{q} Reply in JSON."}],
            response_format={"type": "json_object"},
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
        return r.choices[0]

    with ThreadPoolExecutor(4) as pool:
        choices = list(pool.map(one, QUESTIONS))
    for c in choices:
        if c.finish_reason == "length":  # an object the model keeps open: never a broken one
            continue
        assert isinstance(json.loads(c.message.content), dict)
    assert sum(c.finish_reason == "stop" for c in choices) >= len(choices) // 2


def test_metrics_count_tool_calls_and_structured_outputs(server, client) -> None:
    import httpx

    case = CASES[1]
    ask(client, case, stream=False)
    text = httpx.get(server.url + "/metrics").text
    valid = [
        line
        for line in text.splitlines()
        if line.startswith("pagoda_tool_calls_total") and 'result="valid"' in line
    ]
    assert valid and float(valid[0].rsplit(" ", 1)[1]) >= 1
    assert "pagoda_structured_output_total" in text
