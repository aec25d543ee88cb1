"""The generic mode, for chat templates with no tool support (the built-in SmolLM2): the tools are
described in the system prompt, the reply is one JSON envelope (constrained to
``envelope_schema`` by the grammar engine), ``{"tool_calls": [{"name", "arguments"}]}`` or
``{"content": "..."}``, and the history's calls and results are rendered as plain turns."""

from __future__ import annotations

import json
from typing import Any

from pagoda.node_agent.serving.api.toolcalls.base import (
    Event,
    TextDelta,
    ToolParser,
    function_schemas,
    loads,
)


def _functions(tools: list[dict], tool_choice: Any) -> dict[str, dict]:
    """The functions a reply may call: all of them ("auto", "required", None), the named one, or
    none ("none")."""
    functions = function_schemas(tools)
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        if name not in functions:
            raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
        return {name: functions[name]}
    return {} if tool_choice == "none" else functions


def _descriptions(tools: list[dict], names: dict[str, dict]) -> list[dict]:
    out = []
    for tool in tools:
        fn = tool.get("function", tool)
        if fn.get("name") in names:
            entry = {"name": fn["name"], "description": fn.get("description", "")}
            entry["parameters"] = names[fn["name"]] or {"type": "object"}
            out.append(entry)
    return out


def system_prompt(tools: list[dict], tool_choice: Any = "auto", parallel_tool_calls: bool = True) -> str:
    """The system-prompt text that offers the tools and asks for the JSON envelope ("" when
    ``tool_choice`` is "none")."""
    tool_choice = "auto" if tool_choice is None else tool_choice
    names = _functions(tools, tool_choice)
    if not names:
        return ""
    listing = "\n".join(json.dumps(d, ensure_ascii=False) for d in _descriptions(tools, names))
    call = '{"tool_calls": [{"name": "<function name>", "arguments": {<its parameters>}}]}'
    lines = ["You can call these functions (name, description, JSON schema of the arguments):", listing]
    lines.append("Reply with exactly one JSON object and nothing else.")
    if tool_choice == "auto":
        lines.append(f"To call functions, reply {call}.")
        lines.append('To answer without calling a function, reply {"content": "<your answer>"}.')
    elif isinstance(tool_choice, dict):
        lines.append(f"You must call {next(iter(names))}: reply {call}.")
    else:
        lines.append(f"You must call at least one function: reply {call}.")
    if not parallel_tool_calls:
        lines.append("Call one function at a time.")
    return "\n".join(lines)


MAX_PARALLEL_CALLS = 8  # calls in one generic-mode reply
# A string or integer argument whose schema sets no bound gets one in the envelope: a small model
# can otherwise run one string (a URL, a repeated phrase) or one number's digits until max_tokens
# cuts the whole call. The reply still validates against the function's own schema (the envelope
# is only stricter).
MAX_STRING_CHARS = 64
MAX_INTEGER = 10**15 - 1


def bounded(schema: Any) -> Any:
    """``schema`` with ``maxLength`` on every string without a length, enum, const, pattern or
    format, and a range on every integer without one."""
    if isinstance(schema, list):
        return [bounded(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bounded(v) for k, v in schema.items()}
    keys = set(schema)
    if schema.get("type") == "string" and not {"maxLength", "enum", "const", "pattern", "format"} & keys:
        out["maxLength"] = MAX_STRING_CHARS
    if schema.get("type") == "integer" and not {"enum", "const"} & keys:
        if not {"maximum", "exclusiveMaximum"} & keys:
            out["maximum"] = MAX_INTEGER
        if not {"minimum", "exclusiveMinimum"} & keys:
            out["minimum"] = -MAX_INTEGER
    return out


def envelope_schema(tools: list[dict], tool_choice: Any = "auto", parallel_tool_calls: bool = True) -> dict:
    """The JSON schema of a reply: calls (one branch per function, so each call's arguments
    validate against that function's parameters), or content when ``tool_choice`` is "auto" (or
    None); content only when it is "none"."""
    tool_choice = "auto" if tool_choice is None else tool_choice
    content = {
        "type": "object",
        "properties": {"content": {"type": "string"}},
        "required": ["content"],
        "additionalProperties": False,
    }
    names = _functions(tools, tool_choice)
    if not names:
        return content
    branches = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [name]},
                "arguments": bounded(params) if params else {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name, params in names.items()
    ]
    # Parallel calls are bounded: a small model repeats a call until max_tokens cuts the reply (and
    # every call of it) otherwise; one more call than there are functions leaves room for two
    # calls of one function (Paris and London) without letting a loop run on.
    most = 1 if not parallel_tool_calls else min(len(names) + 1, MAX_PARALLEL_CALLS)
    array: dict[str, Any] = {"type": "array", "items": {"anyOf": branches}, "minItems": 1, "maxItems": most}
    calls = {
        "type": "object",
        "properties": {"tool_calls": array},
        "required": ["tool_calls"],
        "additionalProperties": False,
    }
    return {"anyOf": [calls, content]} if tool_choice == "auto" else calls


def _text(content: Any) -> str:
    """A message's content as text (OpenAI content parts joined)."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def _envelope(tool_calls: list[dict]) -> str:
    calls = []
    for tc in tool_calls:
        fn = tc.get("function", {})
        arguments = fn.get("arguments", {})
        if isinstance(arguments, str):
            arguments = loads(arguments) if isinstance(loads(arguments), dict) else arguments
        calls.append({"name": fn.get("name", ""), "arguments": arguments})
    return json.dumps({"tool_calls": calls}, ensure_ascii=False)


def render_history(messages: list[dict]) -> list[dict]:
    """The messages as plain ``{"role", "content"}`` turns for a template without tool support:
    an assistant's calls become its envelope text, consecutive tool results one user turn."""
    names: dict[str, str] = {}
    out: list[dict] = []
    for msg in messages:
        role, content = msg.get("role"), _text(msg.get("content"))
        if role == "assistant" and msg.get("tool_calls"):
            for tc in msg["tool_calls"]:
                names[tc.get("id", "")] = tc.get("function", {}).get("name", "")
            envelope = _envelope(msg["tool_calls"])
            out.append({"role": "assistant", "content": f"{content}\n{envelope}" if content else envelope})
        elif role == "tool":
            call_id = msg.get("tool_call_id", "")
            line = f"Result of {names.get(call_id) or 'the function'} (call {call_id}): {content}"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + line
            else:
                out.append({"role": "user", "content": line, "tool_results": True})
        else:
            out.append({"role": role, "content": content})
    return [{"role": m["role"], "content": m["content"]} for m in out]


def with_system_prompt(messages: list[dict], text: str) -> list[dict]:
    """``messages`` with ``text`` added to their system message (or one put first)."""
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0], content=f"{_text(messages[0].get('content'))}\n\n{text}")
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


class GenericParser(ToolParser):
    """Reads the envelope once the reply is whole; text that is not an envelope is content."""

    name = "generic"
    structural_format = None

    def __init__(self, tools: list[dict] | None) -> None:
        super().__init__(tools)
        self._buf = ""

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        return []

    def finish(self) -> list[Event]:
        raw, self._buf = self._buf, ""
        obj = loads(raw)
        calls = obj.get("tool_calls") if isinstance(obj, dict) else None
        content = obj.get("content") if isinstance(obj, dict) else None
        if not isinstance(content, str) and not isinstance(calls, list):
            return self._reject(raw)
        out: list[Event] = [TextDelta(content)] if isinstance(content, str) and content else []
        for item in calls or []:
            text = json.dumps(item, ensure_ascii=False)
            if not isinstance(item, dict):
                out += self._reject(text)
                continue
            arguments = item.get("arguments", {})
            out += self._call(
                item.get("name"), loads(arguments) if isinstance(arguments, str) else arguments, text
            )
        return out
