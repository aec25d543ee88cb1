"""Hermes, Qwen2.5 and Qwen3: ``<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`` per
call, anywhere in the text."""

from __future__ import annotations

from pagoda.node_agent.serving.api.toolcalls.base import loads
from pagoda.node_agent.serving.api.toolcalls.markers import MarkedCallParser


def call_object(obj: object, keys: tuple[str, ...]) -> tuple[object, object] | None:
    """``(name, arguments)`` of a ``{"name": ..., KEY: {...}}`` object, KEY the first of ``keys`` it
    holds (arguments also taken as a JSON string, ``{}`` when it holds none), or None when ``obj``
    has no name."""
    if not isinstance(obj, dict) or "name" not in obj:
        return None
    arguments = next((obj[k] for k in keys if k in obj), {})
    if isinstance(arguments, str):
        arguments = loads(arguments)
    return obj["name"], arguments


class HermesParser(MarkedCallParser):
    name = "hermes"
    structural_format = "qwen_3"
    call = ("<tool_call>", "</tool_call>")

    def parse_body(self, body: str) -> tuple[object, object, str | None] | None:
        parsed = call_object(loads(body), ("arguments", "parameters"))
        return None if parsed is None else (*parsed, None)
