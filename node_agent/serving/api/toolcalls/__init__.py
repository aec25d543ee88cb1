"""Tool-call and reasoning parsers, one per model family (torch-free): what the API layer runs on
the generated text to return OpenAI ``tool_calls`` and ``reasoning_content``. See docs/tool-calls.md."""

from pagoda.node_agent.serving.api.toolcalls.base import (
    ArgsDelta,
    CallStart,
    Event,
    Parsed,
    ReasoningDelta,
    TextDelta,
    ToolCall,
    ToolParser,
    assemble,
    coalesce,
)
from pagoda.node_agent.serving.api.toolcalls.detect import detect_reasoning_parser, detect_tool_parser
from pagoda.node_agent.serving.api.toolcalls.generic import (
    GenericParser,
    envelope_schema,
    render_history,
    system_prompt,
    with_system_prompt,
)
from pagoda.node_agent.serving.api.toolcalls.pipeline import OutputParser
from pagoda.node_agent.serving.api.toolcalls.reasoning import (
    REASONING_PARSERS,
    ReasoningParser,
    reasoning_parser_for,
)
from pagoda.node_agent.serving.api.toolcalls.registry import PARSERS, get_parser, parse

__all__ = [
    "PARSERS",
    "REASONING_PARSERS",
    "ArgsDelta",
    "CallStart",
    "Event",
    "GenericParser",
    "OutputParser",
    "Parsed",
    "ReasoningDelta",
    "ReasoningParser",
    "TextDelta",
    "ToolCall",
    "ToolParser",
    "assemble",
    "coalesce",
    "detect_reasoning_parser",
    "detect_tool_parser",
    "envelope_schema",
    "get_parser",
    "parse",
    "reasoning_parser_for",
    "render_history",
    "system_prompt",
    "with_system_prompt",
]
