"""The CRD's CEL rules (``x-kubernetes-validations``) evaluated without an API server, with
cel-python, so that ``pagoda-operator render`` refuses what admission refuses: the same rules,
read from the same CRD file, on the same defaulted object (root-level rules see ``metadata.name``).
"""

from __future__ import annotations

import functools
from typing import Any

import celpy

Obj = dict[str, Any]


@functools.cache
def _environment() -> celpy.Environment:
    return celpy.Environment()


@functools.cache
def _program(rule: str) -> Any:
    env = _environment()
    return env.program(env.compile(rule))


def _holds(rule: str, value: Any) -> bool:
    try:
        result = _program(rule).evaluate({"self": celpy.json_to_cel(value)})
    except celpy.CELEvalError:
        return False
    return not isinstance(result, celpy.CELEvalError) and bool(result)


def errors(schema: Obj, value: Any, path: str = "") -> list[str]:
    """The messages of every rule ``value`` breaks, each prefixed with where it applies (none for
    the root). A rule that cannot be evaluated on the value counts as broken."""
    out = [
        f"{path}: {rule['message']}" if path else str(rule["message"])
        for rule in schema.get("x-kubernetes-validations") or []
        if not _holds(rule["rule"], value)
    ]
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            sub = props.get(key) if key in props else extra if isinstance(extra, dict) else None
            if sub is not None:
                out += errors(sub, item, f"{path}.{key}" if path else key)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            out += errors(schema["items"], item, f"{path}[{i}]")
    return out
