"""A small async Kubernetes API client over aiohttp, using the credentials kopf logged in with."""

from __future__ import annotations

import json
import time
from typing import Any
from urllib.parse import quote

import aiohttp
import kopf

Obj = dict[str, Any]
DISCOVERY_TTL_S = 60.0  # how long an API discovery answer (is LeaderWorkerSet served?) is kept

# Kind -> (API path prefix, plural) for the kinds the operator touches.
KINDS: dict[str, tuple[str, str]] = {
    "Service": ("/api/v1", "services"),
    "ServiceAccount": ("/api/v1", "serviceaccounts"),
    "Pod": ("/api/v1", "pods"),
    "Lease": ("/apis/coordination.k8s.io/v1", "leases"),
    "Secret": ("/api/v1", "secrets"),
    "ConfigMap": ("/api/v1", "configmaps"),
    "Deployment": ("/apis/apps/v1", "deployments"),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings"),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies"),
    "ModelDeployment": ("/apis/pagoda.dev/v1alpha1", "modeldeployments"),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets"),
    "HorizontalPodAutoscaler": ("/apis/autoscaling/v2", "horizontalpodautoscalers"),
    "ScaledObject": ("/apis/keda.sh/v1alpha1", "scaledobjects"),
    "LeaderWorkerSet": ("/apis/leaderworkerset.x-k8s.io/v1", "leaderworkersets"),
    "InferencePool": ("/apis/inference.networking.k8s.io/v1", "inferencepools"),
    "HTTPRoute": ("/apis/gateway.networking.k8s.io/v1", "httproutes"),
}


class ApiError(Exception):
    """A non-2xx answer of the API server; ``message`` is the Status object's message when it sent one."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:500]}")
        self.status = status
        self.message = f"HTTP {status}"
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict) and isinstance(parsed.get("message"), str):
            self.message = parsed["message"][:500]
        elif body.strip():
            self.message = f"HTTP {status}: {body.strip()[:300]}"


def path(kind: str, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
    """The URL path of a namespaced object or collection."""
    prefix, plural = KINDS[kind]
    url = f"{prefix}/namespaces/{quote(namespace)}/{plural}"
    if name is not None:
        url += f"/{quote(name)}"
    if subresource:
        url += f"/{subresource}"
    return url


class Kube:
    """The operations the reconciler needs: get, list, create, merge-patch, delete."""

    def __init__(self, info: kopf.ConnectionInfo) -> None:
        self.server = info.server.rstrip("/")
        self._info = info
        self._session: aiohttp.ClientSession | None = None
        self._served: dict[str, tuple[float, bool]] = {}  # kind -> (when asked, served)

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            info = self._info
            auth = None
            if info.username and info.password:
                auth = aiohttp.BasicAuth(info.username, info.password)
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=info.as_ssl_context()),
                headers=info.as_http_headers(),
                auth=auth,
                timeout=aiohttp.ClientTimeout(total=30),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def _call(
        self, method: str, url: str, body: Any = None, content_type: str | None = None
    ) -> Obj | None:
        headers = {"Content-Type": content_type or "application/json"} if body is not None else {}
        data = json.dumps(body) if body is not None else None
        async with self._client().request(method, self.server + url, data=data, headers=headers) as resp:
            text = await resp.text()
            if resp.status == 404 and method in ("GET", "DELETE"):
                return None
            if resp.status >= 400:
                raise ApiError(resp.status, text)
            return json.loads(text) if text else {}

    async def get(self, kind: str, namespace: str, name: str) -> Obj | None:
        """The object, or None when it does not exist."""
        return await self._call("GET", path(kind, namespace, name))

    async def read(self, url: str) -> Obj | None:
        """GET an absolute API path (a cluster-scoped object such as a CRD); None when absent."""
        return await self._call("GET", url)

    async def list(self, kind: str, namespace: str, labels: dict[str, str]) -> list[Obj]:
        """Objects of a kind in a namespace carrying all the given labels."""
        selector = ",".join(f"{k}={v}" for k, v in labels.items())
        url = path(kind, namespace) + "?labelSelector=" + quote(selector)
        result = await self._call("GET", url) or {}
        items = result.get("items") or []
        # The selector is also applied here: some API emulators ignore labelSelector.
        return [o for o in items if labels.items() <= (o.get("metadata", {}).get("labels") or {}).items()]

    async def create(self, obj: Obj) -> Obj:
        meta = obj["metadata"]
        return await self._call("POST", path(obj["kind"], meta["namespace"]), obj) or {}

    async def patch(
        self, kind: str, namespace: str, name: str, patch: Obj, subresource: str | None = None
    ) -> Obj:
        """JSON merge patch (RFC 7386): maps merge, lists are replaced, null deletes."""
        url = path(kind, namespace, name, subresource)
        return await self._call("PATCH", url, patch, "application/merge-patch+json") or {}

    async def apply(self, url: str, obj: Obj) -> Obj:
        """Server-side apply (``application/apply-patch+yaml``; JSON is YAML) at an absolute API path."""
        return await self._call("PATCH", url, obj, "application/apply-patch+yaml") or {}

    async def served(self, kind: str) -> bool:
        """Whether the API server serves a kind (API discovery of its group version): an optional
        CRD such as LeaderWorkerSet may not be installed. A yes is kept for ``DISCOVERY_TTL_S``,
        so passes do not ask the API server each time; a no is asked again (an install is seen
        at the next pass)."""
        cached = self._served.get(kind)
        now = time.monotonic()
        if cached is not None and now - cached[0] < DISCOVERY_TTL_S:
            return cached[1]
        prefix, plural = KINDS[kind]
        found = await self._call("GET", prefix)
        answer = any(r.get("name") == plural for r in (found or {}).get("resources") or [])
        if answer:
            self._served[kind] = (now, answer)
        return answer

    async def delete(self, kind: str, namespace: str, name: str, uid: str | None = None) -> bool:
        """Delete an object (only if its uid is still ``uid``, when given); False when it was gone."""
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "preconditions": {"uid": uid}} if uid else None
        return await self._call("DELETE", path(kind, namespace, name), body) is not None
