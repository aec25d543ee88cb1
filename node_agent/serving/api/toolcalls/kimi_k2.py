"""Kimi-K2: ``<|tool_calls_section_begin|>`` then per call ``<|tool_call_begin|>functions.NAME:IDX
<|tool_call_argument_begin|>{json}<|tool_call_end|>``, then ``<|tool_calls_section_end|>``. The
``functions.NAME:IDX`` text is the call's id (the chat template renders it back)."""

from __future__ import annotations

import re

from pagoda.node_agent.serving.api.toolcalls.base import loads
from pagoda.node_agent.serving.api.toolcalls.markers import MarkedCallParser

ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
_ID = re.compile(r"(?:functions\.)?(.+):\d+", re.DOTALL)


class KimiK2Parser(MarkedCallParser):
    name = "kimi_k2"
    structural_format = "kimi"
    section = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
    call = ("<|tool_call_begin|>", "<|tool_call_end|>")

    def parse_body(self, body: str) -> tuple[object, object, str | None] | None:
        head, sep, arguments = body.partition(ARGUMENT_BEGIN)
        head = head.strip()
        match = _ID.fullmatch(head)
        if not sep or match is None:
            return None
        return match.group(1), loads(arguments), head
