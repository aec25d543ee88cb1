"""Constrained decoding on the built-in model: outputs hold to their json_schema, json_object, regex
and tool-call constraints at several temperatures; a grammar cut short by max_tokens ends "length";
a constraint xgrammar refuses is a RequestError naming its param; grammars compile once; the state
survives preemption and the prefill -> decode handoff."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from pagoda.node_agent.engine.config import PhaseFormats
from pagoda.node_agent.engine.guided import cache as cache_mod
from pagoda.node_agent.engine.guided.cache import GrammarCache
from pagoda.node_agent.engine.guided.state import GrammarState
from pagoda.node_agent.engine.kv_setup import kv_components
from pagoda.node_agent.kv.pool import KVPagePool
from pagoda.node_agent.params import RequestError, SamplingParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
}
ANSWER = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "confidence": {"type": "integer", "maximum": 10}},
    "required": ["answer", "confidence"],
}
COLOURS = {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3}
CASES = [
    (PERSON, "Describe a person named Bob who is 30, as JSON."),
    (ANSWER, "Is the sky blue? Answer as JSON with your confidence from 0 to 10."),
    (COLOURS, "List two colours as a JSON array."),
]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}},
            "required": ["city"],
        },
    },
}


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def run(engine, reqs: list[tuple[list[dict], SamplingParams]]) -> list:
    """Every request in one batch; their final outputs in order."""
    rids = [engine.add_request(msgs, p, chat=True) for msgs, p in reqs]
    done = engine.run_until_done()
    return [done[r] for r in rids]


def matcher_takes(cache: GrammarCache, spec: dict, text: str):
    """A fresh matcher of ``spec`` fed ``text`` as a string: (accepted, completed)."""
    m = GrammarState.of(SamplingParams(guided=spec), cache.compile(spec)).matcher
    return m.accept_string(text), m.is_completed()


def test_json_schema_outputs_validate_at_every_temperature(engine):
    reqs = [
        (
            chat(prompt),
            SamplingParams(max_tokens=40, temperature=t, seed=7, guided={"type": "json_schema", "schema": s}),
        )
        for s, prompt in CASES
        for t in (0.0, 0.9)
    ]
    outs = run(engine, reqs)
    for (_, p), out in zip(reqs, outs, strict=True):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), p.guided["schema"])


def test_json_object_parses_and_regex_matches(engine):
    pattern = r"(yes|no)\. [A-Z][a-z]{1,12}\."
    obj = {"type": "json_object"}
    outs = run(
        engine,
        [
            (
                chat("Reply with a JSON object whose key city is Paris."),
                SamplingParams(max_tokens=24, temperature=0.0, guided=obj),
            ),
            (
                chat("Is water wet? Say yes or no, then one word."),
                SamplingParams(
                    max_tokens=12, temperature=0.7, seed=3, guided={"type": "regex", "pattern": pattern}
                ),
            ),
        ],
    )
    assert outs[0].finish_reason == "stop" and isinstance(json.loads(outs[0].text), dict), outs[0].text
    assert outs[1].finish_reason == "stop" and re.fullmatch(pattern, outs[1].text), outs[1].text


def test_a_required_qwen3_tool_call_is_what_its_structural_tag_allows(engine):
    spec = {
        "type": "tool_calls",
        "format": "qwen_3",
        "tools": [WEATHER],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "reasoning": "disabled",
        "param": "tool_choice",
    }
    (out,) = run(
        engine,
        [
            (
                chat("What is the weather in Paris?"),
                # the greedy pick under the tag spells its fixed text in short tokens (31 of them)
                SamplingParams(max_tokens=64, temperature=0.0, guided=spec),
            )
        ],
    )
    assert out.finish_reason == "stop", out.text
    assert matcher_takes(engine.grammars, spec, out.text) == (True, True)
    call = re.fullmatch(r"\s*<tool_call>\n(.*)\n</tool_call>\s*", out.text, re.S)
    assert call, out.text
    body = json.loads(call.group(1))
    assert body["name"] == "get_weather"
    jsonschema.validate(body["arguments"], WEATHER["function"]["parameters"])


def test_max_tokens_before_the_grammar_completes_is_length(engine):
    spec = {"type": "json_schema", "schema": PERSON}
    (out,) = run(engine, [(chat(CASES[0][1]), SamplingParams(max_tokens=3, temperature=0.0, guided=spec))])
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    assert matcher_takes(engine.grammars, spec, out.text) == (True, False)  # a valid, unfinished prefix


@pytest.mark.parametrize(
    "spec,param,why",
    [
        ({"type": "json_schema", "schema": {"type": "nonsense"}}, "response_format", "nonsense"),
        ({"type": "regex", "pattern": "(ab", "param": "response_format"}, "response_format", "parenthesis"),
        (
            {"type": "tool_calls", "format": "no_such_family", "tools": [WEATHER], "param": "tools"},
            "tools",
            "no_such_family",
        ),
        (
            {
                "type": "tool_calls",
                "format": "qwen_3",
                "tools": [WEATHER],
                "param": "tool_choice",
                "tool_choice": {"type": "function", "function": {"name": "not_offered"}},
            },
            "tool_choice",
            "not_offered",
        ),
    ],
)
def test_a_constraint_xgrammar_refuses_is_a_request_error_naming_its_param(engine, spec, param, why):
    with pytest.raises(RequestError, match="cannot be compiled") as e:
        engine.add_request("Hello", SamplingParams(max_tokens=4, guided=spec))
    assert e.value.param == param and why in str(e.value)
    assert not engine.has_unfinished()


def test_grammars_compile_once_and_the_cache_is_bounded(builtin_tokenizer, engine, monkeypatch):
    grammars = GrammarCache(
        builtin_tokenizer, engine.model_config.vocab_size, engine.stop_rules.eos_ids, max_entries=2
    )
    spec = {"type": "json_schema", "schema": PERSON}
    first = grammars.compile(spec)
    assert grammars.compile(dict(spec, param="tools")) is first  # the param names errors only
    assert (grammars.compiles, grammars.hits) == (1, 1)
    for pattern in ("a+", "b+"):
        grammars.compile({"type": "regex", "pattern": pattern})
    assert len(grammars) == 2 and grammars.compiles == 3  # the least recently used one went
    grammars.compile(spec)
    assert grammars.compiles == 4
    assert 0 < grammars.bytes <= grammars.max_bytes
    small = GrammarCache(
        builtin_tokenizer, engine.model_config.vocab_size, engine.stop_rules.eos_ids, max_bytes=1
    )
    small.compile(spec)
    assert len(small) == 0 and small.bytes == 0  # over the byte bound: used, not kept
    monkeypatch.setattr(cache_mod, "MAX_GRAMMAR_BYTES", 1)
    with pytest.raises(RequestError, match="MiB") as e:
        small.compile(spec)
    assert e.value.param == "response_format"


def test_n_requests_of_one_constraint_compile_it_once(make_engine):
    eng = make_engine()
    spec = {"type": "json_schema", "schema": ANSWER}
    outs = run(eng, [(chat(CASES[1][1]), SamplingParams(max_tokens=24, temperature=0.0, guided=spec))] * 2)
    assert eng.grammars.compiles == 1 and eng.grammars.hits == 1
    assert outs[0].token_ids == outs[1].token_ids


@pytest.mark.slow
def test_preemption_mid_grammar_keeps_the_output(make_engine):
    spec = {"type": "json_schema", "schema": PERSON}
    reqs = [
        (
            chat(f"Describe a person named {n} who is {a}, as JSON."),
            SamplingParams(max_tokens=32, temperature=0.0, guided=spec),
        )
        for n, a in (("Bob", 30), ("Alice", 41), ("Carol", 25), ("Dan", 60))
    ]
    want = [o.token_ids for o in run(make_engine(), reqs)]
    probe = make_engine(kv_memory=1 << 20)
    per_page = KVPagePool.bytes_per_page(
        probe.model_config.num_layers, 16, kv_components(probe.model_config), probe.dtype
    )
    eng = make_engine(kv_memory=10 * per_page, max_num_batched_tokens=64)
    outs = run(eng, reqs)
    assert eng.scheduler.num_preemptions > 0, "the budget was meant to force preemption"
    assert [o.token_ids for o in outs] == want
    for o in outs:
        jsonschema.validate(json.loads(o.text), PERSON)
    eng.decode_pool.check_idle()


def test_the_constraint_continues_across_the_prefill_decode_handoff(make_engine):
    fmts = PhaseFormats("bf16", "bf16", "bf16", "fp8_e4m3")
    spec = {"type": "json_schema", "schema": PERSON}
    params = SamplingParams(max_tokens=32, temperature=0.0, guided=spec)
    msgs = chat(CASES[0][1])
    (want,) = run(make_engine(formats=fmts), [(msgs, params)])
    prefill, decode = make_engine(formats=fmts, role="prefill"), make_engine(formats=fmts, role="decode")
    pid = prefill.add_request(msgs, params, chat=True, prefill_only=True)
    payload = prefill.run_until_done()[pid].kv_payload
    assert payload.first_token == want.token_ids[0]  # sampled under the mask on the prefill side
    did = decode.add_prefilled(payload, params)
    got = decode.run_until_done()[did]
    assert got.token_ids == want.token_ids and got.finish_reason == "stop"
    jsonschema.validate(json.loads(got.text), PERSON)
    # a first token the grammar forbids (a JSON object cannot start with "x") is refused, nothing kept
    payload.first_token = prefill.tokenizer.encode("x")[-1]
    payload.request_id = "forbidden-first-token"
    with pytest.raises(RequestError, match="not allowed") as e:
        decode.add_prefilled(payload, params)
    assert e.value.param == "response_format"
    decode.decode_pool.check_idle()
    assert not decode.has_unfinished()


def test_the_vocabulary_never_allows_special_or_padded_ids(builtin_tokenizer):
    import xgrammar as xgr

    from pagoda.node_agent.engine.guided.vocab import special_token_ids, tokenizer_info

    vocab = builtin_tokenizer.vocab_size + 64  # a model with padded embedding rows
    info = tokenizer_info(builtin_tokenizer, vocab, [2])
    assert info.vocab_size == vocab and info.stop_token_ids == [2]
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_builtin_json_grammar())
    mask = xgr.allocate_token_bitmask(1, vocab)

    def allowed() -> set[int]:
        matcher.fill_next_token_bitmask(mask)
        bits = ((mask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab]
        return set(bits.nonzero().flatten().tolist())

    first = allowed()
    brace = builtin_tokenizer.encode("{")[-1]
    assert brace in first and 2 not in first  # EOS only once the document is complete
    assert not first & (
        special_token_ids(builtin_tokenizer._tok) | set(range(builtin_tokenizer.vocab_size, vocab))
    )
    for t in builtin_tokenizer.encode("{}"):
        assert matcher.accept_token(t)
    assert allowed() == {2}  # a closed object: only the stop token


def test_masks_touch_only_the_constrained_rows_of_a_batch(engine):
    from pagoda.node_agent.engine.guided.masking import apply_grammar_masks
    from pagoda.node_agent.engine.sequence import Sequence

    spec = {"type": "regex", "pattern": "a"}
    seqs = [Sequence("free", [1], SamplingParams()), Sequence("held", [1], SamplingParams(guided=spec))]
    seqs[1].grammar = engine.grammars.state_for(seqs[1].params)
    vocab = engine.model_config.vocab_size
    logits = torch.randn(2, vocab + 8)  # padded past the vocabulary
    before = logits.clone()
    apply_grammar_masks(logits, seqs)
    assert torch.equal(logits[0], before[0])
    kept = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert kept == [engine.tokenizer.encode("a")[-1]]
    assert torch.equal(logits[1, kept], before[1, kept])
