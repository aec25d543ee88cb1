"""The served model's chat format: which tool-call parser reads its replies, whether it reasons.

Detected once at start from the model's family and its chat template (toolcalls/detect.py);
``--tool-call-parser`` and ``--reasoning-parser`` override. The worker reports it to the API
(local backend) and to the router (``/internal/state``), which parse replies with it.
"""

from __future__ import annotations

import logging

from pagoda.node_agent.serving.api.backend import ChatFormat
from pagoda.node_agent.serving.api.toolcalls import (
    detect_reasoning_parser,
    detect_tool_parser,
    reasoning_parser_for,
)

log = logging.getLogger("pagoda.chat_format")

AUTO = "auto"
NONE = "none"


def chat_format_of(engine, tool_parser: str = AUTO, reasoning_parser: str = AUTO) -> ChatFormat:
    """The chat format of an LLMEngine's model (``tool_parser``/``reasoning_parser``: a name,
    ``auto`` to detect, or for reasoning ``none`` to turn separation off)."""
    tok = engine.tokenizer
    template = tok.chat_template
    family = engine.model_config.arch
    parser = detect_tool_parser(family, template) if tool_parser == AUTO else tool_parser
    if reasoning_parser == AUTO:
        reasoning = detect_reasoning_parser(family, template)
    else:
        reasoning = None if reasoning_parser == NONE else reasoning_parser
    fmt = ChatFormat(parser, reasoning, _opens_reasoning(tok, reasoning))
    log.info("chat format: tool calls %s, reasoning %s", fmt.tool_parser, fmt.reasoning_parser or "off")
    return fmt


def _opens_reasoning(tok, reasoning: str | None) -> bool:
    """Whether the template's generation prompt already opens the reasoning block."""
    if reasoning is None:
        return False
    try:
        text = tok.render_chat([{"role": "user", "content": "hi"}])
    except Exception:  # a template that needs more than one user turn: assume it does not
        return False
    parser = reasoning_parser_for(reasoning, text)
    return parser is not None and parser.in_reasoning
