"""One chat choice's generated text read back into OpenAI message parts: ``content``,
``reasoning_content`` and ``tool_calls`` (whole, or as streaming deltas the official client
assembles), with the checks that feed the tool-call and structured-output metrics."""

from __future__ import annotations

import json
from typing import Any

import jsonschema

from pagoda.node_agent.serving.api.backend import ChatFormat
from pagoda.node_agent.serving.api.chat_plan import ChatPlan
from pagoda.node_agent.serving.api.metrics import ServeMetrics
from pagoda.node_agent.serving.api.toolcalls import (
    ArgsDelta,
    CallStart,
    OutputParser,
    ReasoningDelta,
    TextDelta,
    get_parser,
    reasoning_parser_for,
)


class ChatReader:
    """Splits one choice's text as it arrives; ``feed`` and ``finish`` give OpenAI delta dicts."""

    def __init__(self, plan: ChatPlan, fmt: ChatFormat) -> None:
        self.plan = plan
        opened = "<think>" if fmt.reasoning_open else ""  # the generation prompt opened the block
        reasoning = reasoning_parser_for(fmt.reasoning_parser, opened)
        self.tools = get_parser(plan.tool_parser)(plan.tools) if plan.tool_parser else None
        self.parser = OutputParser(self.tools, reasoning)
        self.reasoning = reasoning
        self.calls: list[dict[str, Any]] = []  # assembled: {"id", "type", "function": {name, arguments}}
        self.content: list[str] = []
        self.thought: list[str] = []

    def feed(self, text: str) -> list[dict[str, Any]]:
        return self._deltas(self.parser.feed(text)) if text else []

    def finish(self) -> list[dict[str, Any]]:
        return self._deltas(self.parser.finish())

    def _deltas(self, events: list[Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for ev in events:
            if isinstance(ev, ReasoningDelta):
                if ev.text:
                    self.thought.append(ev.text)
                    out.append({"reasoning_content": ev.text})
            elif isinstance(ev, TextDelta):
                if ev.text:
                    self.content.append(ev.text)
                    out.append({"content": ev.text})
            elif isinstance(ev, CallStart):
                self.calls.append(
                    {"id": ev.id, "type": "function", "function": {"name": ev.name, "arguments": ""}}
                )
                fn = {"name": ev.name, "arguments": ""}
                out.append(
                    {"tool_calls": [{"index": ev.index, "id": ev.id, "type": "function", "function": fn}]}
                )
            elif isinstance(ev, ArgsDelta):
                self.calls[ev.index]["function"]["arguments"] += ev.text
                out.append({"tool_calls": [{"index": ev.index, "function": {"arguments": ev.text}}]})
        return out

    def message(self) -> dict[str, Any]:
        """The whole assistant message (after ``finish``)."""
        content = "".join(self.content)
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning is not None and self.thought:
            msg["reasoning_content"] = "".join(self.thought)
        if self.calls:
            msg["tool_calls"] = self.calls
            if not content.strip():
                msg["content"] = None  # OpenAI's shape of a reply that is only calls
        return msg

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """``tool_calls`` when the reply ended on its own with calls in it."""
        return "tool_calls" if self.calls and engine_reason == "stop" else engine_reason

    def record(self, metrics: ServeMetrics, engine_reason: str | None) -> None:
        """Count the reply's tool calls (valid or not) and its structured-output result."""
        if self.tools is not None:
            valid = sum(call_valid(c, self.tools.functions) for c in self.calls)
            metrics.tool_calls.labels(metrics.pool, "valid").inc(valid)
            metrics.tool_calls.labels(metrics.pool, "invalid").inc(
                len(self.calls) - valid + self.tools.invalid
            )
        if self.plan.structured is not None:
            result = structured_result("".join(self.content), self.plan.schema, engine_reason)
            metrics.structured.labels(metrics.pool, self.plan.structured, result).inc()


def call_valid(call: dict[str, Any], schemas: dict[str, dict[str, Any] | None]) -> bool:
    """An offered function, arguments a JSON object valid against its parameter schema."""
    name = call["function"]["name"]
    if name not in schemas:
        return False
    try:
        args = json.loads(call["function"]["arguments"])
    except ValueError:
        return False
    if not isinstance(args, dict):
        return False
    schema = schemas[name]
    return schema is None or jsonschema.Draft202012Validator(schema).is_valid(args)


def structured_result(text: str, schema: dict[str, Any] | None, engine_reason: str | None) -> str:
    """valid / invalid / incomplete (cut by max_tokens) for a json_object or json_schema reply."""
    try:
        value = json.loads(text)
    except ValueError:
        return "incomplete" if engine_reason == "length" else "invalid"
    if schema is None:
        return "valid" if isinstance(value, dict) else "invalid"
    return "valid" if jsonschema.Draft202012Validator(schema).is_valid(value) else "invalid"
