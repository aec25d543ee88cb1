"""CRD schema tools for tests: structural defaulting, JSON-schema validation, CEL rules (celpy)."""

from __future__ import annotations

import copy
import pathlib
from typing import Any

import celpy
import jsonschema
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / "modeldeployment.yaml"
CHART = ROOT / "helm" / "pagoda"

Obj = dict[str, Any]


def load_crd() -> Obj:
    return yaml.safe_load(CRD_PATH.read_text())


def md_schema(crd: Obj | None = None) -> Obj:
    """The openAPIV3Schema of the served version."""
    crd = crd or load_crd()
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def apply_defaults(schema: Obj, value: Any) -> Any:
    """Fill defaults the way the API server does: absent properties with a default get it, recursively."""
    value = copy.deepcopy(value)
    if isinstance(value, dict) and schema.get("type") == "object":
        for key, sub in (schema.get("properties") or {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = apply_defaults(sub, value[key])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in value:
                if key not in (schema.get("properties") or {}):
                    value[key] = apply_defaults(extra, value[key])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        value = [apply_defaults(schema["items"], v) for v in value]
    return value


_env = celpy.Environment()


def cel_errors(schema: Obj, value: Any, path: str = "") -> list[str]:
    """Evaluate every x-kubernetes-validations rule on the value it applies to; failed messages."""
    errors: list[str] = []
    for rule in schema.get("x-kubernetes-validations") or []:
        program = _env.program(_env.compile(rule["rule"]))
        if not bool(program.evaluate({"self": celpy.json_to_cel(value)})):
            errors.append(f"{path or '.'}: {rule['message']}")
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key in value:
                errors += cel_errors(sub, value[key], f"{path}.{key}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            errors += cel_errors(schema["items"], item, f"{path}[{i}]")
    return errors


def admit(obj: Obj, crd: Obj | None = None) -> Obj:
    """What the API server would store: defaults applied, then schema and CEL checks (raises)."""
    schema = md_schema(crd)
    stored = apply_defaults(schema, obj)
    jsonschema.validate(stored, schema, cls=jsonschema.Draft7Validator)
    problems = cel_errors(schema, stored)
    if problems:
        raise jsonschema.ValidationError("; ".join(problems))
    return stored


def example(name: str = "smollm", **spec: Any) -> Obj:
    """A ModelDeployment with a builtin model on CPU nodes, overridable per spec key."""
    body: Obj = {
        "apiVersion": "pagoda.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"model": {"source": "builtin://smollm2-135m"}, **spec},
    }
    return body
