"""Admission == render: every spec the API server refuses (the CRD's schema and CEL rules, as
evaluated in the tests with jsonschema and cel-python) is refused by ``pagoda-operator render``
too, and every child of a spec both accept has a name and fields the API server takes."""

from __future__ import annotations

import copy
import ipaddress
import re

import jsonschema
import kubernetes_validate
import pytest
from op_schema import admit, example

from pagoda.operator import render
from pagoda.operator.config import Config

LONG = "m" * 50  # 49 is the longest name whose children all fit 63 characters


def named(name: str) -> dict:
    return example(name)


def with_spec(**spec: object) -> dict:
    return example(**spec)


HOSTILE = {
    "name-too-long": named(LONG),
    "name-with-a-dot": named("my.model"),
    "name-with-a-leading-digit": named("1model"),
    "name-upper-case": named("Model"),
    "rolling-update-0-0": with_spec(decode={"rollingUpdate": {"maxSurge": 0, "maxUnavailable": 0}}),
    "rolling-update-0%-0%": with_spec(router={"rollingUpdate": {"maxSurge": "0%", "maxUnavailable": "0%"}}),
    "max-surge-abc": with_spec(prefill={"rollingUpdate": {"maxSurge": "abc"}}),
    "max-surge-negative": with_spec(prefill={"rollingUpdate": {"maxSurge": -1}}),
    "max-unavailable-over-100%": with_spec(decode={"rollingUpdate": {"maxUnavailable": "150%"}}),
    "negative-pdb": with_spec(decode={"disruptionBudget": {"maxUnavailable": -1}}),
    "pdb-not-a-percentage": with_spec(router={"disruptionBudget": {"maxUnavailable": "one"}}),
    "bad-cidr-prefix": with_spec(networkPolicy={"metricsFrom": [{"ipBlock": {"cidr": "10.0.0.0/33"}}]}),
    "bad-cidr-text": with_spec(networkPolicy={"metricsFrom": [{"ipBlock": {"cidr": "not-a-cidr"}}]}),
    "bad-cidr-octet": with_spec(networkPolicy={"metricsFrom": [{"ipBlock": {"cidr": "10.0.0.256/8"}}]}),
    "bad-except-cidr": with_spec(
        networkPolicy={"metricsFrom": [{"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0"]}}]}
    ),
    "bad-ipv6-cidr": with_spec(networkPolicy={"metricsFrom": [{"ipBlock": {"cidr": "fd00:::1/64"}}]}),
    "image-with-whitespace": with_spec(image="pagoda/node-agent:0.1.0 --privileged"),
    "image-2-mb": with_spec(image="a" * (2 * 2**20)),
}


@pytest.mark.parametrize("doc", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_hostile_spec_is_refused_by_admission_and_by_render(doc: dict) -> None:
    with pytest.raises(jsonschema.ValidationError):
        admit(copy.deepcopy(doc))
    with pytest.raises(render.RenderError, match="is invalid"):
        render.render_objects(copy.deepcopy(doc), None, Config())


FRIENDLY = {
    "name-49": named("m" * 49),
    "name-one-letter": named("m"),
    "percentages": with_spec(
        decode={"rollingUpdate": {"maxSurge": "25%", "maxUnavailable": "0%"}},
        router={"disruptionBudget": {"maxUnavailable": "50%"}},
    ),
    "roll-without-a-spare": with_spec(decode={"rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}),
    "pdb-zero": with_spec(decode={"disruptionBudget": {"maxUnavailable": 0}}),
    "cidrs": with_spec(
        networkPolicy={
            "metricsFrom": [
                {"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16", "10.2.3.4/32"]}},
                {"ipBlock": {"cidr": "fd00::/8"}},
                {"ipBlock": {"cidr": "2001:db8:0:0:0:0:0:0/32"}},
                {"ipBlock": {"cidr": "::/0"}},
            ]
        }
    ),
    "image-digest": with_spec(image="registry.example:5000/pagoda/node-agent@sha256:" + "a" * 64),
}


@pytest.mark.parametrize("doc", FRIENDLY.values(), ids=FRIENDLY.keys())
def test_what_both_accept_renders_children_the_api_server_takes(doc: dict) -> None:
    admit(copy.deepcopy(doc))
    objs = render.render_objects(copy.deepcopy(doc), None, Config())
    dns1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
    for obj in objs:
        name = obj["metadata"]["name"]
        assert len(name) <= 63 and dns1035.match(name), name
        kubernetes_validate.validate(obj, "1.33", strict=True)
        for peer in (obj.get("spec") or {}).get("ingress", [{}])[-1].get("from", []):
            if "ipBlock" in peer:  # what the API server's CIDR parser would take
                for cidr in [peer["ipBlock"]["cidr"], *peer["ipBlock"].get("except", [])]:
                    ipaddress.ip_network(cidr, strict=False)


def test_render_reports_the_crd_rule_message() -> None:
    with pytest.raises(render.RenderError, match="DNS-1035 label"):
        render.render_objects(named("my.model"), None, Config())
    with pytest.raises(render.RenderError, match="must not both be 0"):
        render.render_objects(HOSTILE["rolling-update-0-0"], None, Config())


@pytest.mark.parametrize(
    "doc",
    [
        with_spec(image="pagoda/node-agent:0.1.0\n"),
        with_spec(networkPolicy={"metricsFrom": [{"ipBlock": {"cidr": "10.0.0.0/8\n"}}]}),
    ],
    ids=["image", "cidr"],
)
def test_render_matches_patterns_as_the_api_server_does(doc: dict) -> None:
    """RE2's ``$`` is the end of the text: a trailing newline is refused (Python's ``re`` alone, as
    the tests' jsonschema uses it, would let it through)."""
    with pytest.raises(render.RenderError, match="does not match"):
        render.render_objects(doc, None, Config())
