"""Every family's parser, by name: what ``--tool-call-parser`` accepts."""

from __future__ import annotations

from pagoda.node_agent.serving.api.toolcalls import deepseek, generic, glm, hermes, kimi_k2, llama3_json
from pagoda.node_agent.serving.api.toolcalls.base import REGISTRY, Parsed, ToolParser, assemble

FAMILIES = (kimi_k2, glm, deepseek, hermes, llama3_json, generic)  # importing them registers them
PARSERS: tuple[str, ...] = tuple(sorted(REGISTRY))


def get_parser(name: str) -> type[ToolParser]:
    """The parser class called ``name``; ValueError naming the known ones otherwise."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(PARSERS)}") from None


def parse(parser_name: str, tools: list[dict], text: str) -> Parsed:
    """A whole generation parsed at once (the same result as streaming it)."""
    parser = get_parser(parser_name)(tools)
    events = parser.feed(text) + parser.finish()
    return assemble(events, parser.invalid)
