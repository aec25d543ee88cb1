"""GLM-4.5 and GLM-4.6/4.7: ``<tool_call>NAME`` then ``<arg_key>k</arg_key><arg_value>v</arg_value>``
per argument, then ``</tool_call>``. GLM-4.5 puts a newline after the name and around each pair,
4.6/4.7 none; both parse either way. A value is JSON unless its schema type is string, and a value
that is not JSON is a string."""

from __future__ import annotations

import json
import re
from typing import Any

from pagoda.node_agent.serving.api.toolcalls.markers import MarkedCallParser

_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
_JSON_TYPES = {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer", float: "number"}


def _types(schema: object) -> set[str]:
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, str):
        return {kind}
    return {k for k in kind if isinstance(k, str)} if isinstance(kind, list) else set()


def coerce(value: str, schema: object) -> Any:
    """One argument value as its schema types it: raw text for strings, JSON for the rest, raw
    text again when it is not JSON, or is JSON of another type where the schema allows a string."""
    types = _types(schema)
    if types == {"string"}:
        return value
    try:
        parsed = json.loads(value)
    except ValueError:
        return value
    kind = "null" if parsed is None else _JSON_TYPES[type(parsed)]
    fits = kind in types or (kind == "integer" and "number" in types)
    return value if "string" in types and not fits else parsed


class Glm45Parser(MarkedCallParser):
    name = "glm45"
    structural_format = "glm_4_7"  # xgrammar's GLM grammar accepts 4.5's newlines too
    call = ("<tool_call>", "</tool_call>")

    def parse_body(self, body: str) -> tuple[object, object, str | None] | None:
        name, _, _ = body.partition("<arg_key>")
        name = name.strip()
        if not name or "\n" in name:
            return None
        props = self.functions.get(name, {}).get("properties")
        props = props if isinstance(props, dict) else {}
        arguments: dict[str, Any] = {}
        pos = len(body) - len(body.lstrip()) + len(name)
        for match in _PAIR.finditer(body, pos):
            if body[pos : match.start()].strip():
                return None  # stray text between the pairs
            key = match.group(1).strip()
            arguments[key] = coerce(match.group(2), props.get(key))
            pos = match.end()
        if body[pos:].strip():
            return None
        return name, arguments, None


class Glm47Parser(Glm45Parser):
    name = "glm47"
    structural_format = "glm_4_7"
