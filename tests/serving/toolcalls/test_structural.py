"""Each parser's ``structural_format`` is a grammar engine key whose grammar admits the very
outputs the parser reads (so constrained calls always parse), and the generic envelope schema
compiles and admits the envelopes the generic parser reads."""

from __future__ import annotations

import json

import pytest

from pagoda.node_agent.serving.api.toolcalls import PARSERS, envelope_schema, get_parser, parse
from tests.serving.toolcalls.cases import CASES, TOOLS

xgr = pytest.importorskip("xgrammar", reason="the grammar engine (engine extra) is not installed")
from xgrammar.testing import _is_grammar_accept_string  # noqa: E402

FORMATTED = sorted(name for name in PARSERS if get_parser(name).structural_format)


def test_every_family_but_generic_has_a_grammar_key():
    assert FORMATTED == sorted(set(PARSERS) - {"generic"})


@pytest.mark.parametrize("name", FORMATTED)
def test_the_grammar_admits_the_valid_literal_outputs(name):
    key = get_parser(name).structural_format
    grammar = xgr.Grammar.from_structural_tag(
        xgr.get_model_structural_tag(key, tools=TOOLS, tool_choice="auto", reasoning="disabled")
    )
    admitted = 0
    for case in CASES[name]:
        if case.invalid or not case.calls or not case.strict:
            continue  # only outputs the family itself writes, with offered calls only
        assert _is_grammar_accept_string(grammar, case.text), case.label
        admitted += 1
    assert admitted >= 1


@pytest.mark.parametrize("name", FORMATTED)
def test_a_required_grammar_refuses_an_unknown_function(name):
    key = get_parser(name).structural_format
    grammar = xgr.Grammar.from_structural_tag(
        xgr.get_model_structural_tag(key, tools=TOOLS[2:], tool_choice="required", reasoning="disabled")
    )
    valid = next(
        c for c in CASES[name] if c.strict and not c.invalid and any(n != "get_time" for n, _, _ in c.calls)
    )
    assert not _is_grammar_accept_string(grammar, valid.text)


@pytest.mark.parametrize(
    "choice", ["auto", "required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_the_envelope_schema_compiles_and_admits_its_envelopes(choice):
    grammar = xgr.Grammar.from_json_schema(json.dumps(envelope_schema(TOOLS, choice, True)))
    reply = json.dumps({"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}]})
    assert _is_grammar_accept_string(grammar, reply)
    assert not _is_grammar_accept_string(grammar, reply.replace("get_weather", "get_wether"))
    assert [c.name for c in parse("generic", TOOLS, reply).tool_calls] == ["get_weather"]
    assert _is_grammar_accept_string(grammar, '{"content": "hi"}') is (choice == "auto")
