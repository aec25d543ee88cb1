"""spec.router.gateway: an InferencePool over the router pods and an HTTPRoute to it, validated
against the inference extension's v1 API and the Gateway API's HTTPRoute (schemas/)."""

from __future__ import annotations

import asyncio
import json
import pathlib

import jsonschema
import pytest
from fake_kube import FakeKube
from op_schema import admit, example

from pagoda.operator import children
from pagoda.operator.config import Config
from pagoda.operator.reconcile import reconcile
from pagoda.operator.spec import parse

SCHEMAS = pathlib.Path(__file__).parent / "schemas"
META = {"name": "m", "namespace": "ns", "uid": "uid-m"}
CPU = {"prefill": {"gpus": 0}, "decode": {"gpus": 0}}
GATEWAY = {
    "parentRefs": [{"name": "inference-gateway", "namespace": "gateways", "sectionName": "http"}],
    "hostnames": ["llm.example.com"],
    "endpointPicker": {"name": "m-epp"},
}


def schema(name: str) -> dict:
    return json.loads((SCHEMAS / name).read_text())


def built(**spec: object) -> dict[str, dict]:
    return children.build(META, parse(admit(example("m", **CPU, **spec))["spec"]), Config())


def test_no_gateway_objects_by_default() -> None:
    assert not [k for k in built() if k.startswith(("InferencePool/", "HTTPRoute/"))]


def test_the_pool_and_route_render_and_validate() -> None:
    objs = built(router={"gateway": GATEWAY})
    pool, route = objs["InferencePool/m"], objs["HTTPRoute/m"]
    jsonschema.validate(pool, schema("inferencepool-inference-v1.json"))
    jsonschema.validate(route, schema("httproute-gateway-v1.json"))
    assert pool["spec"]["endpointPickerRef"] == {
        "group": "",
        "kind": "Service",
        "name": "m-epp",
        "port": {"number": 9002},
        "failureMode": "FailClose",
    }
    assert pool["spec"]["targetPorts"] == [{"number": children.PORT}]
    # The members are the pods that serve the OpenAI API: the router's, and only those.
    router_pods = objs["Deployment/m-router"]["spec"]["template"]["metadata"]["labels"]
    engine_pods = objs["Deployment/m-decode"]["spec"]["template"]["metadata"]["labels"]
    selector = pool["spec"]["selector"]["matchLabels"]
    assert selector.items() <= router_pods.items() and not selector.items() <= engine_pods.items()
    assert route["spec"]["parentRefs"] == GATEWAY["parentRefs"]
    assert route["spec"]["hostnames"] == ["llm.example.com"]
    assert route["spec"]["rules"][0]["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "m"}
    ]
    for obj in (pool, route):
        assert obj["metadata"]["ownerReferences"][0]["uid"] == "uid-m"
    # Pagoda's router stays the default front: its Service is there as without a gateway.
    assert objs["Service/m-router"] == built()["Service/m-router"]


def test_admission_requires_a_parent_and_a_picker() -> None:
    for bad in ({"parentRefs": [], "endpointPicker": {"name": "e"}}, {"parentRefs": [{"name": "g"}]}):
        with pytest.raises(Exception):  # noqa: B017 - the schema's own error type
            admit(example("m", **CPU, router={"gateway": bad}))
    stored = admit(
        example(
            "m", **CPU, router={"gateway": {"parentRefs": [{"name": "g"}], "endpointPicker": {"name": "e"}}}
        )
    )
    assert stored["spec"]["router"]["gateway"]["endpointPicker"] == {
        "name": "e",
        "port": 9002,
        "failureMode": "FailClose",
    }


def test_turning_the_gateway_off_deletes_only_our_pool_and_route() -> None:
    kube = FakeKube()
    body = admit(example("m", **CPU, router={"gateway": GATEWAY}))
    body["metadata"].update(namespace="ns", uid="uid-m", generation=1)
    kube.objects[("ModelDeployment", "ns", "m")] = body
    asyncio.run(reconcile(kube, body, Config()))  # type: ignore[arg-type]
    assert ("InferencePool", "ns", "m") in kube.objects and ("HTTPRoute", "ns", "m") in kube.objects
    off = admit(example("m", **CPU))
    off["metadata"].update(namespace="ns", uid="uid-m", generation=2)
    kube.writes.clear()
    asyncio.run(reconcile(kube, off, Config()))  # type: ignore[arg-type]
    deleted = sorted((kind, name) for verb, kind, name in kube.writes if verb == "delete")
    assert deleted == [("HTTPRoute", "m"), ("InferencePool", "m")]
