"""SamplingParams.guided: the constraint's shape is checked torch-free, errors name its param, and
the internal plane's JSON carries it."""

from __future__ import annotations

import pytest

from pagoda.node_agent.params import (
    GUIDED_MAX_BYTES,
    RequestError,
    SamplingParams,
    params_from_json,
    params_to_json,
)

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
GOOD = [
    {"type": "json_object"},
    {"type": "json_schema", "schema": {"type": "object"}},
    {"type": "regex", "pattern": "[a-z]+"},
    {"type": "tool_calls", "format": "qwen_3", "tools": [TOOL]},
    {
        "type": "tool_calls",
        "format": "llama",
        "tools": [TOOL],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
        "parallel_tool_calls": False,
        "reasoning": "disabled",
        "param": "tool_choice",
    },
]
BAD = [
    ("not a dict", "response_format"),
    ({"type": "grammar"}, "response_format"),
    ({"type": "json_object", "schema": {}}, "response_format"),  # a key json_object does not take
    ({"type": "json_schema"}, "response_format"),
    ({"type": "json_schema", "schema": "{}"}, "response_format"),
    ({"type": "regex", "pattern": ""}, "response_format"),
    ({"type": "regex", "pattern": 3, "param": "x"}, "x"),
    ({"type": "tool_calls", "format": "qwen_3", "tools": [], "param": "tools"}, "tools"),
    ({"type": "tool_calls", "format": "qwen_3", "tools": [TOOL], "tool_choice": "none"}, "response_format"),
    (
        {"type": "tool_calls", "format": "qwen_3", "tools": [TOOL], "parallel_tool_calls": 1},
        "response_format",
    ),
    ({"type": "tool_calls", "format": "qwen_3", "tools": [TOOL], "reasoning": "yes"}, "response_format"),
    ({"type": "tool_calls", "format": "", "tools": [TOOL], "param": "tool_choice"}, "tool_choice"),
    ({"type": "json_schema", "schema": {"x": float("nan")}}, "response_format"),  # not plain JSON
]


@pytest.mark.parametrize("guided", GOOD)
def test_well_formed_constraints_pass_and_travel_the_internal_plane(guided):
    p = SamplingParams(max_tokens=4, guided=guided)
    p.validate()
    back = params_from_json(params_to_json(p))
    assert back.guided == guided
    assert params_from_json(params_to_json(SamplingParams())).guided is None


@pytest.mark.parametrize("guided,param", BAD)
def test_malformed_constraints_are_request_errors_naming_their_param(guided, param):
    with pytest.raises(RequestError, match="^constraint: ") as e:
        SamplingParams(guided=guided).validate()
    assert e.value.param == param


def test_a_constraint_over_the_size_bound_is_refused():
    big = {"type": "json_schema", "schema": {"description": "x" * GUIDED_MAX_BYTES}}
    with pytest.raises(RequestError, match="bytes as JSON") as e:
        SamplingParams(guided=big).validate()
    assert e.value.param == "response_format"


def test_the_wrong_json_type_of_guided_is_refused_on_the_internal_plane():
    with pytest.raises(RequestError, match="guided has the wrong JSON type"):
        params_from_json({"guided": "json"})
