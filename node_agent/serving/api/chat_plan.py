"""From a validated chat request to what the worker renders and how its reply is read back.

A chat request with tools meets the model in one of two ways, chosen by the model's chat format
(reported by the worker, overridable with ``--tool-call-parser``):

- **family mode** (the template takes ``tools=``): the tools go to the model's own template, the
  reply is parsed by that family's parser; ``tool_choice`` ``required`` or a named function
  constrains the reply to the family's call syntax (an xgrammar structural tag, built engine-side).
- **generic mode** (no tool support in the template, e.g. the built-in SmolLM2): the tools are
  described in a system message, earlier calls and results become plain turns, and the reply is
  constrained to a JSON envelope (calls, or a plain answer when ``tool_choice`` is ``auto``).

``response_format`` json_object / json_schema constrains the reply by a grammar as well.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagoda.node_agent.serving.api.backend import ChatFormat
from pagoda.node_agent.serving.api.errors import ApiError
from pagoda.node_agent.serving.api.protocol import ChatCompletionRequest
from pagoda.node_agent.serving.api.toolcalls import generic, get_parser

MAX_SCHEMA_BYTES = 64 << 10  # one response or tool schema; the engine bounds what it compiles too


@dataclass
class ChatPlan:
    """What one chat request sends to the worker and how its text is read back."""

    prompt: list[dict[str, Any]] | dict[str, Any]  # messages, or {"messages", "tools"} for the template
    guided: dict[str, Any] | None  # the decoding constraint (params.guided), or None
    tool_parser: str | None  # parser of the reply's tool calls, None when no tools are in play
    tools: list[dict[str, Any]]  # the offered tools (what a parsed call must name)
    structured: str | None  # "json_object" / "json_schema" when response_format asks for one
    schema: dict[str, Any] | None  # the response schema the reply must validate against


def plan_chat(req: ChatCompletionRequest, fmt: ChatFormat) -> ChatPlan:
    """The plan for ``req`` on a model of chat format ``fmt``; ApiError 400 for what cannot be served."""
    messages = req.chat_messages()
    tools = req.tool_dicts()
    choice = req.tool_choice_value()
    for i, t in enumerate(tools):
        check_schema(t["function"].get("parameters"), f"tools[{i}].function.parameters")
    if not tools or choice == "none":
        prompt: list[dict[str, Any]] | dict[str, Any] = (
            generic.render_history(messages) if fmt.tool_parser == "generic" else messages
        )
        guided, structured, schema = response_guided(req)
        return ChatPlan(prompt, guided, None, tools, structured, schema)
    parallel = req.parallel_tool_calls is not False
    if fmt.tool_parser == "generic":
        text = generic.system_prompt(tools, choice, parallel)
        prompt = generic.with_system_prompt(generic.render_history(messages), text)
        envelope = generic.envelope_schema(tools, choice, parallel)
        guided = {"type": "json_schema", "schema": envelope, "param": "tools"}
        return ChatPlan(prompt, guided, "generic", tools, None, None)
    parser = get_parser(fmt.tool_parser)
    guided = None
    if choice != "auto" and parser.structural_format is not None:
        guided = {
            "type": "tool_calls",
            "format": parser.structural_format,
            "tools": tools,
            "tool_choice": choice,
            "parallel_tool_calls": parallel,
            "reasoning": "auto" if fmt.reasoning_parser else "disabled",
            "param": "tool_choice",
        }
    return ChatPlan({"messages": messages, "tools": tools}, guided, parser.name, tools, None, None)


def response_guided(req: ChatCompletionRequest) -> tuple[dict[str, Any] | None, str | None, dict | None]:
    """(the constraint, its kind, its schema) of ``response_format``; nothing for text."""
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None, None, None
    if fmt.type == "json_object":
        return {"type": "json_object", "param": "response_format"}, "json_object", None
    assert fmt.json_schema is not None and fmt.json_schema.schema_ is not None  # protocol.check_tools
    schema = fmt.json_schema.schema_
    check_schema(schema, "response_format.json_schema.schema")
    return {"type": "json_schema", "schema": schema, "param": "response_format"}, "json_schema", schema


def check_schema(schema: dict[str, Any] | None, where: str) -> None:
    """A JSON schema the client sent: bounded and well-formed (400 naming ``where`` otherwise)."""
    if schema is None:
        return
    import json

    import jsonschema

    size = len(json.dumps(schema))
    if size > MAX_SCHEMA_BYTES:
        raise ApiError(
            400,
            f"{where}: schema of {size} bytes exceeds {MAX_SCHEMA_BYTES}",
            param=where,
            code="invalid_value",
        )
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ApiError(
            400, f"{where}: not a valid JSON schema: {exc.message}"[:500], param=where, code="invalid_value"
        ) from exc
