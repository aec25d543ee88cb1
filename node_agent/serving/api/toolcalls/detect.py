"""Which parsers a model needs, from its chat template (what the model was trained to write) and,
when the template shows no known markers, its config's ``model_type``."""

from __future__ import annotations

import re

_TOOLS = re.compile(r"\btools\b")
_LLAMA_JSON = re.compile(r'"parameters"\s*:')

# model_type -> parser, for templates that take tools but show none of the markers below
MODEL_TYPES = {
    "kimi_k2": "kimi_k2",
    "deepseek_v3": "deepseek_v3",
    "glm4_moe": "glm45",
    "qwen2": "hermes",
    "qwen2_moe": "hermes",
    "qwen3": "hermes",
    "qwen3_moe": "hermes",
    "llama": "llama3_json",
}


def _by_markers(template: str) -> str | None:
    if "<|tool_calls_section_begin|>" in template or "<|tool_call_argument_begin|>" in template:
        return "kimi_k2"
    if "<｜tool▁sep｜>" in template:
        return "deepseek_v3" if "```json" in template else "deepseek_v31"
    if "<arg_key>" in template:
        return "glm47" if "</arg_key><arg_value>" in template else "glm45"
    if "<tool_call>" in template:
        return "generic" if "<function=" in template else "hermes"  # Qwen3-Coder's XML: no parser yet
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template and _LLAMA_JSON.search(template)):
        return "llama3_json"
    return None


def detect_tool_parser(model_type: str | None, chat_template: str | None) -> str:
    """The tool parser for a model: its template's format; the ``model_type``'s family when the
    template takes tools but shows no known format; "generic" when the template takes no tools
    (or shows no known format and the model type names no family)."""
    if not chat_template or not _TOOLS.search(chat_template):
        return "generic"
    return _by_markers(chat_template) or MODEL_TYPES.get(model_type or "", "generic")


def detect_reasoning_parser(model_type: str | None, chat_template: str | None) -> str | None:
    """The reasoning parser for a model whose template knows a think block, else None."""
    if not chat_template or "<think>" not in chat_template and "</think>" not in chat_template:
        return None
    return "kimi_k2" if _by_markers(chat_template) == "kimi_k2" or model_type == "kimi_k2" else "think"
