"""``pagoda-operator render -f md.yaml [--namespace NS]``: the objects the operator would create for
a ModelDeployment, as YAML on stdout, without a cluster.

The same functions as a reconciliation pass build them (``formats.check`` and ``children.build``),
after the CRD's defaults, schema and CEL rules (``schema.admit_document``): whatever render accepts,
the API server admits. Exit status 2 with the reason on
stderr for a spec the API server or the operator would refuse.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

import yaml

from . import children, formats, schema
from .config import Config
from .spec import API_VERSION, KIND, parse

Obj = dict[str, Any]

RENDER_UID = "00000000-0000-0000-0000-000000000000"  # stands in for the ModelDeployment's uid
NOTE = (
    "# Rendered by pagoda-operator render. Not shown: the {name}-internal Secret (random values, created\n"
    "# once by the operator). ownerReferences carry a placeholder uid.\n"
)


class RenderError(Exception):
    """Why a document cannot be rendered (printed, exit status 2)."""


def render_objects(doc: Any, namespace: str | None, cfg: Config, crd: Obj | None = None) -> list[Obj]:
    """The children of one ModelDeployment document, in the order the operator applies them."""
    if not isinstance(doc, dict) or doc.get("kind") != KIND or doc.get("apiVersion") != API_VERSION:
        raise RenderError(f"not a {API_VERSION} {KIND}")
    meta = doc.get("metadata") or {}
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        raise RenderError("metadata.name is required")
    ns = namespace or meta.get("namespace") or "default"
    stored, problems = schema.admit_document(doc, crd)
    if problems:
        raise RenderError(f"ModelDeployment {ns}/{name} is invalid: " + "; ".join(problems))
    spec = parse(stored)
    refused = formats.check(spec)
    if refused:
        why = "; ".join(f"{p.reason}: {p.message}" for p in refused)
        raise RenderError(f"ModelDeployment {ns}/{name} is not served: {why}")
    owner = {"name": name, "namespace": ns, "uid": meta.get("uid") or RENDER_UID}
    return list(children.build(owner, spec, cfg).values())


def render(stream: TextIO, namespace: str | None, cfg: Config, out: TextIO) -> None:
    """Render every ModelDeployment of a YAML stream to ``out``."""
    try:
        docs = [d for d in yaml.safe_load_all(stream) if d is not None]
    except yaml.YAMLError as err:
        raise RenderError(f"not YAML: {err}") from err
    if not docs:
        raise RenderError("no ModelDeployment in the input")
    crd = schema.load_crd(cfg.crd_file)
    rendered = [(d, render_objects(d, namespace, cfg, crd)) for d in docs]
    for doc, objs in rendered:
        out.write(NOTE.format(name=doc["metadata"]["name"]))
        out.write(yaml.safe_dump_all(objs, sort_keys=False, explicit_start=True))


def main(argv: list[str]) -> int:
    """Entry of ``pagoda-operator render``; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="pagoda-operator render", description="print the objects the operator would create"
    )
    parser.add_argument("-f", "--filename", required=True, help="ModelDeployment YAML ('-' for stdin)")
    parser.add_argument(
        "--namespace", "-n", default=None, help="namespace (default: the file's, else default)"
    )
    args = parser.parse_args(argv)
    try:
        cfg = Config.from_env()
        if args.filename == "-":
            render(sys.stdin, args.namespace, cfg, sys.stdout)
        else:
            with open(args.filename, encoding="utf-8") as f:
                render(f, args.namespace, cfg, sys.stdout)
    except (RenderError, OSError, ValueError) as err:
        print(f"pagoda-operator render: {err}", file=sys.stderr)
        return 2
    return 0
