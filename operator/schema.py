"""The CRD's OpenAPI schema applied without an API server: defaults filled in and the spec checked
the way the API server would (types, enums, bounds, patterns, required and unknown fields).

``pagoda-operator render`` uses it so that a document it prints objects for is one the cluster
would store: ``admit_document`` adds the CRD's own CEL rules (``cel_rules``), root-level ones on
``metadata.name`` included. The CRD file is the one source: ``crds/modeldeployment.yaml`` next to the
package, or the image's copy. Patterns are matched as the API server's RE2 does: ``$`` ends the text
(Python's would also match before a final newline).
"""

from __future__ import annotations

import copy
import os
import pathlib
import re
from typing import Any

import yaml

from . import cel_rules

Obj = dict[str, Any]

IMAGE_CRD = pathlib.Path("/app/crds/modeldeployment.yaml")


def crd_path(configured: str = "") -> pathlib.Path:
    """The CRD file: the configured one, the repository's, or the operator image's."""
    if configured:
        return pathlib.Path(configured)
    beside = pathlib.Path(__file__).resolve().parents[1] / "crds" / "modeldeployment.yaml"
    return beside if beside.exists() else IMAGE_CRD


def load_crd(configured: str = "") -> Obj:
    return yaml.safe_load(crd_path(configured or os.environ.get("PAGODA_CRD_FILE", "")).read_text())


def root_schema(crd: Obj) -> Obj:
    """The openAPIV3Schema of the stored version."""
    version = next(v for v in crd["spec"]["versions"] if v.get("storage"))
    return version["schema"]["openAPIV3Schema"]


def spec_schema(crd: Obj) -> Obj:
    """The openAPIV3Schema of ``spec`` in the stored version."""
    return root_schema(crd)["properties"]["spec"]


def defaults(schema: Obj, value: Any) -> Any:
    """Fill absent properties that have a default, recursively (structural defaulting)."""
    value = copy.deepcopy(value)
    if isinstance(value, dict) and schema.get("type") == "object":
        props = schema.get("properties") or {}
        for key, sub in props.items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = defaults(sub, value[key])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in value:
                if key not in props:
                    value[key] = defaults(extra, value[key])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        value = [defaults(schema["items"], v) for v in value]
    return value


_TYPES = {
    "object": dict,
    "array": list,
    "string": str,
    "boolean": bool,
}


def _type_ok(schema: Obj, value: Any) -> bool:
    if schema.get("x-kubernetes-int-or-string"):
        return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))
    kind = schema.get("type")
    if kind is None:
        return True
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, _TYPES[kind])


def _matches(pattern: str, value: str) -> bool:
    """RE2 semantics of a trailing ``$``: the end of the text, not before a final newline."""
    if pattern.endswith("$") and not pattern.endswith("\\$"):
        pattern = pattern[:-1] + r"\Z"
    return re.search(pattern, value) is not None


def errors(schema: Obj, value: Any, path: str = "spec") -> list[str]:
    """Every way ``value`` breaks ``schema``, as "path: why" messages (empty when it is valid)."""
    if not _type_ok(schema, value):
        return [f"{path}: {value!r} is not of type {schema.get('type', 'int-or-string')}"]
    out: list[str] = []
    if "enum" in schema and value not in schema["enum"]:
        out.append(f"{path}: {value!r} is not one of {schema['enum']}")
    if isinstance(value, int | float) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            out.append(f"{path}: {value} is less than the minimum {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            out.append(f"{path}: {value} is greater than the maximum {schema['maximum']}")
    if isinstance(value, str) and not schema.get("x-kubernetes-int-or-string"):
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            out.append(f"{path}: longer than {schema['maxLength']} characters")
        if "minLength" in schema and len(value) < schema["minLength"]:
            out.append(f"{path}: shorter than {schema['minLength']} characters")
        if "pattern" in schema and not _matches(schema["pattern"], value):
            out.append(f"{path}: {value!r} does not match {schema['pattern']!r}")
    if isinstance(value, list):
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            out.append(f"{path}: more than {schema['maxItems']} items")
        if "minItems" in schema and len(value) < schema["minItems"]:
            out.append(f"{path}: fewer than {schema['minItems']} items")
        if isinstance(schema.get("items"), dict):
            for i, item in enumerate(value):
                out += errors(schema["items"], item, f"{path}[{i}]")
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        for key in schema.get("required") or []:
            if key not in value:
                out.append(f"{path}.{key}: required")
        if "minProperties" in schema and len(value) < schema["minProperties"]:
            out.append(f"{path}: needs at least {schema['minProperties']} field(s)")
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            if key in props:
                out += errors(props[key], item, f"{path}.{key}")
            elif isinstance(extra, dict):
                out += errors(extra, item, f"{path}.{key}")
            elif props and not schema.get("x-kubernetes-preserve-unknown-fields"):
                out.append(f"{path}.{key}: unknown field")
    return out


def admit_spec(raw: Any, crd: Obj | None = None) -> tuple[Obj, list[str]]:
    """The spec with the CRD's defaults, and its schema errors."""
    schema = spec_schema(crd or load_crd())
    if not isinstance(raw, dict):
        return {}, ["spec: must be an object"]
    stored = defaults(schema, raw)
    return stored, errors(schema, stored)


def admit_document(doc: Obj, crd: Obj | None = None) -> tuple[Obj, list[str]]:
    """The spec with the CRD's defaults, and every reason the API server would refuse the document:
    the spec's schema errors, else the CRD's CEL rules over the whole object (``metadata.name``
    and the defaulted spec)."""
    crd = crd or load_crd()
    stored, problems = admit_spec(doc.get("spec"), crd)
    if problems:
        return stored, problems
    meta = doc.get("metadata") or {}
    obj = {
        "apiVersion": doc.get("apiVersion"),
        "kind": doc.get("kind"),
        "metadata": {k: meta[k] for k in ("name", "generateName") if k in meta},
        "spec": stored,
    }
    return stored, cel_rules.errors(root_schema(crd), obj)
