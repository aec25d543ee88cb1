"""An in-memory stand-in for the operator's Kube client, for passes run without an API emulator
(thousands of pods, refused writes). It stores what it is sent and applies merge patches."""

from __future__ import annotations

import copy
import json
from typing import Any

from pagoda.operator.kube import ApiError

Obj = dict[str, Any]


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


class FakeKube:
    """get/list/create/patch/delete/apply over a dict; ``refuse[(kind, verb)]`` makes a call fail
    with that API error body (a Status object, as the API server sends)."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], Obj] = {}
        self.refuse: dict[tuple[str, str], tuple[int, Obj]] = {}
        self.writes: list[tuple[str, str, str]] = []
        self.unserved: set[str] = set()  # kinds whose API is not installed (discovery says no)
        self.documents: dict[str, Obj] = {}  # absolute-path GETs: OpenAPI documents
        self._uid = 0
        self.paths: dict[str, Obj] = {}  # cluster-scoped objects by API path (the CRD)
        self.reads: list[str] = []

    def _check(self, kind: str, verb: str) -> None:
        if (kind, verb) in self.refuse:
            status, body = self.refuse[(kind, verb)]
            raise ApiError(status, json.dumps(body))

    def put(self, obj: Obj) -> Obj:
        """Store an object as if the API server had it (tests' setup)."""
        self._uid += 1
        obj = copy.deepcopy(obj)
        obj.setdefault("metadata", {}).setdefault("uid", f"uid-{self._uid}")
        meta = obj["metadata"]
        self.objects[(obj["kind"], meta["namespace"], meta["name"])] = obj
        return obj

    async def served(self, kind: str) -> bool:
        return kind not in self.unserved

    async def get(self, kind: str, namespace: str, name: str) -> Obj | None:
        self._check(kind, "get")
        obj = self.objects.get((kind, namespace, name))
        return copy.deepcopy(obj) if obj is not None else None

    async def list(self, kind: str, namespace: str, labels: dict[str, str]) -> list[Obj]:
        self._check(kind, "list")
        return [
            copy.deepcopy(o)
            for (k, ns, _), o in self.objects.items()
            if k == kind and ns == namespace and labels.items() <= (o["metadata"].get("labels") or {}).items()
        ]

    async def create(self, obj: Obj) -> Obj:
        self._check(obj["kind"], "create")
        self.writes.append(("create", obj["kind"], obj["metadata"]["name"]))
        return self.put(obj)

    async def patch(
        self, kind: str, namespace: str, name: str, patch: Obj, subresource: str | None = None
    ) -> Obj:
        self._check(kind, "patch")
        self.writes.append(("patch", kind + (f"/{subresource}" if subresource else ""), name))
        key = (kind, namespace, name)
        self.objects[key] = merge_patch(self.objects[key], patch)
        return copy.deepcopy(self.objects[key])

    async def delete(self, kind: str, namespace: str, name: str, uid: str | None = None) -> bool:
        self._check(kind, "delete")
        self.writes.append(("delete", kind, name))
        return self.objects.pop((kind, namespace, name), None) is not None

    async def read(self, url: str) -> Obj | None:
        """An absolute-path GET: an OpenAPI document a test put in ``documents``, or a cluster-scoped
        object stored with ``put_path`` or ``apply`` (the CRD); None when neither holds it."""
        self.reads.append(url)
        obj = self.documents.get(url, self.paths.get(url))
        return copy.deepcopy(obj) if obj is not None else None

    async def apply(self, url: str, obj: Obj) -> Obj:
        self._check(obj["kind"], "apply")
        self.writes.append(("apply", obj["kind"], url))
        self.paths[url.split("?", 1)[0]] = copy.deepcopy(obj)
        return obj
