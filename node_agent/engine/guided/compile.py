"""A constraint spec (SamplingParams.guided) -> an xgrammar CompiledGrammar, or a RequestError.

json_object: a schema of any object; json_schema: the schema in strict mode (no property a schema
does not name); both with xgrammar's fixed separators (``", "``, ``": "``, no other whitespace),
so that a small model cannot pad the reply with newlines until max_tokens; regex: the pattern; tool_calls: the model family's structural tag
(``xgrammar.get_model_structural_tag``: free text and the family's tool-call markers, each call's
arguments held to its function's parameter schema). Whatever xgrammar refuses is a RequestError
naming the constraint's param, never a server error.
"""

from __future__ import annotations

import json
import re

from pagoda.node_agent.params import RequestError, guided_param

MAX_ERROR_CHARS = 300
# a run of whitespace inside generated JSON is capped: a small model can otherwise emit newlines
# until max_tokens and never close the object
MAX_JSON_WHITESPACE = 8
_SOURCE_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*")  # "[12:00:01] file.cc:42: " of C++ errors


def compile_spec(compiler, spec: dict):
    """Compile ``spec`` (already checked by params.check_guided) with an xgrammar GrammarCompiler."""
    import xgrammar as xgr

    kind = spec["type"]
    try:
        if kind in ("json_object", "json_schema"):  # OpenAI's json_object: any JSON object
            schema = spec["schema"] if kind == "json_schema" else {"type": "object"}
            return compiler.compile_json_schema(json.dumps(schema), strict_mode=True, any_whitespace=False)
        if kind == "regex":
            return compiler.compile_regex(spec["pattern"])
        tag = xgr.get_model_structural_tag(
            spec["format"],
            tools=spec["tools"],
            tool_choice=spec.get("tool_choice", "auto"),
            reasoning=spec.get("reasoning", "auto"),
            parallel_tool_calls=spec.get("parallel_tool_calls", True),
            max_whitespace_cnt=MAX_JSON_WHITESPACE,
        )
        return compiler.compile_structural_tag(tag)
    except Exception as exc:  # xgrammar raises RuntimeError, ValueError, its own and pydantic's errors
        raise RequestError(
            f"the {kind} constraint cannot be compiled: {_reason(exc)}", guided_param(spec)
        ) from exc


def _reason(exc: BaseException) -> str:
    """The first lines of xgrammar's message, without the C++ source location."""
    text = _SOURCE_PREFIX.sub("", str(exc)).strip() or type(exc).__name__
    text = " ".join(text.split())
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."
