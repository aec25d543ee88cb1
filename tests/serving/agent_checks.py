"""The agent API's checks, run against any live server URL (single process, the router of a
disaggregated stack, a tensor-parallel replica): tool calls streamed and not, a JSON-schema reply,
and logprobs consistent with the greedy token."""

from __future__ import annotations

import json
import math

import jsonschema
import openai

from pagoda.node_agent.bench.tool_suite import CASES

MODEL = "smollm2-135m"
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24}, "population": {"type": "integer"}},
    "required": ["city", "population"],
    "additionalProperties": False,
}


def client_for(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)


def check_tool_calls(client: openai.OpenAI, cases=CASES[::11]) -> None:
    """tool_choice required: every reply is calls of offered functions with valid arguments."""
    for case in cases:
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in case.tool_dicts()}
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": case.prompt}],
            "tools": case.tool_dicts(),
            "tool_choice": "required",
            "max_tokens": 512,
            "temperature": 0,
        }
        whole = client.chat.completions.create(**body)
        with client.chat.completions.stream(**body) as s:
            for _ in s:
                pass
            streamed = s.get_final_completion()
        for reply in (whole, streamed):
            choice = reply.choices[0]
            assert choice.finish_reason == "tool_calls", (case.prompt, choice)
            assert choice.message.tool_calls
            for call in choice.message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        names = lambda r: [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls]  # noqa: E731
        assert names(whole) == names(streamed)  # greedy: the same calls either way


def check_json_schema(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe the largest city in Japan."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "city", "schema": SCHEMA, "strict": True},
        },
        max_tokens=64,
        temperature=0,
    )
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def check_logprobs(client: openai.OpenAI) -> None:
    """Greedy: each sampled token is its own top alternative, logprobs <= 0, top lists sorted."""
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        tops = entry.top_logprobs
        assert len(tops) == 3 and tops[0].token == entry.token
        assert math.isclose(tops[0].logprob, entry.logprob, abs_tol=1e-4)
        assert (
            all(a.logprob >= b.logprob for a, b in zip(tops, tops[1:], strict=False)) and entry.logprob <= 0
        )


def check_agent_api(url: str) -> None:
    client = client_for(url)
    check_tool_calls(client)
    check_json_schema(client)
    check_logprobs(client)
