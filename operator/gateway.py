"""The Gateway API inference extension front of a ModelDeployment (``spec.router.gateway``): an
``InferencePool`` (inference.networking.k8s.io/v1, the extension's GA API) over the pods that serve
the OpenAI API, and an ``HTTPRoute`` (gateway.networking.k8s.io/v1) from the named Gateways to it.

Pagoda's prefill and decode pods serve only the internal plane (``/internal/*``, the KV port); the
router pods serve the OpenAI API and keep the prefill -> decode split. So the pool's members are
the router pods, and the endpoint picker balances over router replicas; Pagoda's own router, behind
its Service, stays the default front. The endpoint picker (its Deployment and Service) is the
user's: the pool names it. Pure functions, like ``children``.
"""

from __future__ import annotations

from typing import Any

from .spec import Spec

Obj = dict[str, Any]

POOL_API = "inference.networking.k8s.io/v1"
POOL_KIND = "InferencePool"
ROUTE_API = "gateway.networking.k8s.io/v1"
ROUTE_KIND = "HTTPRoute"


def gateway_children(meta: Obj, spec: Spec, metadata: Obj, selector: dict[str, str], port: int) -> list[Obj]:
    """The InferencePool and HTTPRoute (none without ``spec.router.gateway``). ``metadata`` is the
    children's metadata (name ``<md>``, labels, ownerReference), ``selector`` the router pods'
    labels, ``port`` their container port."""
    gw = spec.router.gateway
    if gw is None:
        return []
    name = metadata["name"]
    picker: Obj = {
        "group": "",
        "kind": "Service",
        "name": gw.endpoint_picker,
        "port": {"number": gw.endpoint_picker_port},
        "failureMode": gw.failure_mode,
    }
    pool = {
        "apiVersion": POOL_API,
        "kind": POOL_KIND,
        "metadata": metadata,
        "spec": {
            "selector": {"matchLabels": dict(selector)},
            "targetPorts": [{"number": port}],
            "endpointPickerRef": picker,
        },
    }
    route_spec: Obj = {
        "parentRefs": [dict(ref) for ref in gw.parent_refs],
        "rules": [
            {
                "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                "backendRefs": [{"group": "inference.networking.k8s.io", "kind": POOL_KIND, "name": name}],
            }
        ],
    }
    if gw.hostnames:
        route_spec["hostnames"] = list(gw.hostnames)
    route = {"apiVersion": ROUTE_API, "kind": ROUTE_KIND, "metadata": dict(metadata), "spec": route_spec}
    return [pool, route]
