"""The chat plan (what a chat request sends to the worker) and the reply reader, without a model."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pagoda.node_agent.bench.tool_suite import FUNCTIONS
from pagoda.node_agent.serving.api.backend import ChatFormat
from pagoda.node_agent.serving.api.chat_output import ChatReader, structured_result
from pagoda.node_agent.serving.api.chat_plan import plan_chat
from pagoda.node_agent.serving.api.errors import ApiError
from pagoda.node_agent.serving.api.protocol import ChatCompletionRequest

WEATHER, TIME = FUNCTIONS["get_weather"], FUNCTIONS["get_time"]
GENERIC, HERMES = ChatFormat("generic"), ChatFormat("hermes")


def req(**kw) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "weather in Paris?"}], **kw}
    return ChatCompletionRequest.model_validate(body)


def test_generic_required_describes_the_tools_and_constrains_to_the_envelope() -> None:
    plan = plan_chat(req(tools=[WEATHER, TIME], tool_choice="required"), GENERIC)
    assert plan.prompt[0]["role"] == "system" and "get_weather" in plan.prompt[0]["content"]
    assert plan.guided["type"] == "json_schema" and plan.tool_parser == "generic"
    schema = plan.guided["schema"]
    call = {"tool_calls": [{"name": "get_weather", "arguments": {"location": "Paris"}}]}
    jsonschema.validate(call, schema)
    with pytest.raises(jsonschema.ValidationError):  # arguments checked against that function
        jsonschema.validate({"tool_calls": [{"name": "get_weather", "arguments": {"timezone": "x"}}]}, schema)
    with pytest.raises(jsonschema.ValidationError):  # required: no plain answer
        jsonschema.validate({"content": "hi"}, schema)


def test_the_clients_system_message_is_kept_and_extended() -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    plan = plan_chat(req(messages=messages, tools=[WEATHER]), GENERIC)
    assert plan.prompt[0]["content"].startswith("Be brief.") and "get_weather" in plan.prompt[0]["content"]
    assert len(plan.prompt) == 2


def test_a_named_function_and_no_parallel_calls_narrow_the_envelope() -> None:
    choice = {"type": "function", "function": {"name": "get_time"}}
    plan = plan_chat(req(tools=[WEATHER, TIME], tool_choice=choice, parallel_tool_calls=False), GENERIC)
    schema = plan.guided["schema"]
    jsonschema.validate({"tool_calls": [{"name": "get_time", "arguments": {"timezone": "UTC"}}]}, schema)
    for bad in (
        {"tool_calls": [{"name": "get_weather", "arguments": {"location": "Paris"}}]},
        {"tool_calls": [{"name": "get_time", "arguments": {"timezone": "UTC"}}] * 2},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_family_mode_passes_tools_to_the_template_and_constrains_only_when_required() -> None:
    auto = plan_chat(req(tools=[WEATHER]), HERMES)
    assert auto.prompt["tools"] == [WEATHER] and auto.guided is None and auto.tool_parser == "hermes"
    required = plan_chat(req(tools=[WEATHER], tool_choice="required"), HERMES)
    assert required.guided["type"] == "tool_calls" and required.guided["format"] == "qwen_3"
    assert required.guided["tool_choice"] == "required"


def test_history_tool_calls_become_plain_turns_in_generic_mode_and_objects_in_family_mode() -> None:
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"location": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "cold"},
    ]  # fmt: skip
    generic = plan_chat(req(messages=messages, tools=[WEATHER], tool_choice="none"), GENERIC)
    assert all(set(m) == {"role", "content"} for m in generic.prompt) and generic.guided is None
    assert "Oslo" in json.dumps(generic.prompt)
    family = plan_chat(req(messages=messages, tools=[WEATHER]), HERMES)
    call = family.prompt["messages"][1]["tool_calls"][0]
    assert call["function"]["arguments"] == {"location": "Oslo"}
    assert family.prompt["messages"][2]["tool_call_id"] == "c1"


def test_response_formats_become_grammars_and_bad_schemas_are_400s() -> None:
    assert plan_chat(req(response_format={"type": "json_object"}), GENERIC).guided["type"] == "json_object"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}
    plan = plan_chat(req(response_format=fmt), GENERIC)
    assert plan.guided == {"type": "json_schema", "schema": schema, "param": "response_format"}
    bad = {
        "type": "json_schema",
        "json_schema": {"name": "r", "schema": {"type": "object", "minProperties": "x"}},
    }
    with pytest.raises(ApiError) as err:
        plan_chat(req(response_format=bad), GENERIC)
    assert err.value.status == 400 and err.value.param == "response_format.json_schema.schema"
    huge = {"type": "json_schema", "json_schema": {"name": "r", "schema": {"description": "x" * 70000}}}
    with pytest.raises(ApiError, match="exceeds"):
        plan_chat(req(response_format=huge), GENERIC)


def stream(reader: ChatReader, text: str, step: int) -> list[dict]:
    out = []
    for i in range(0, len(text), step):
        out += reader.feed(text[i : i + step])
    return out + reader.finish()


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_the_reader_turns_an_envelope_into_openai_tool_call_deltas(step: int) -> None:
    plan = plan_chat(req(tools=[WEATHER], tool_choice="required"), GENERIC)
    reader = ChatReader(plan, GENERIC)
    text = json.dumps({"tool_calls": [{"name": "get_weather", "arguments": {"location": "Paris"}}]})
    deltas = stream(reader, text, step)
    starts = [d["tool_calls"][0] for d in deltas if "tool_calls" in d and "id" in d["tool_calls"][0]]
    assert [s["function"]["name"] for s in starts] == ["get_weather"] and starts[0]["id"].startswith("call_")
    args = "".join(d["tool_calls"][0]["function"].get("arguments", "") for d in deltas if "tool_calls" in d)
    assert json.loads(args) == {"location": "Paris"}
    msg = reader.message()
    assert msg["content"] is None and msg["tool_calls"][0]["function"]["name"] == "get_weather"
    assert reader.finish_reason("stop") == "tool_calls" and reader.finish_reason("length") == "length"


def test_the_reader_never_returns_a_call_to_an_unknown_function() -> None:
    plan = plan_chat(req(tools=[WEATHER]), HERMES)
    reader = ChatReader(plan, HERMES)
    text = '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'
    stream(reader, text, 2)
    assert not reader.calls and "rm_rf" in reader.message()["content"] and reader.tools.invalid == 1


def test_reasoning_is_split_from_content_when_the_prompt_opened_it() -> None:
    fmt = ChatFormat("generic", "think", True)
    reader = ChatReader(plan_chat(req(), fmt), fmt)
    deltas = stream(reader, "let me think</think>Paris.", 2)
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "let me think"
    assert reader.message() == {"role": "assistant", "content": "Paris.", "reasoning_content": "let me think"}


def test_structured_results() -> None:
    schema = {"type": "object", "required": ["a"]}
    assert structured_result('{"a": 1}', schema, "stop") == "valid"
    assert structured_result('{"b": 1}', schema, "stop") == "invalid"
    assert structured_result('{"a": ', schema, "length") == "incomplete"
    assert structured_result("[1]", None, "stop") == "invalid"
