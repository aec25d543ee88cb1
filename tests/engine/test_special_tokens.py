"""Special tokens kept in the text for a tool-call parser (``skip_special_tokens`` false), the
stop token left out, through the detokenizer and a real engine run."""

from __future__ import annotations

from pagoda.node_agent.models.tokenizer import Detokenizer
from pagoda.node_agent.params import SamplingParams, params_from_json, params_to_json


def test_the_detokenizer_keeps_special_tokens_but_not_the_stop_token(builtin_tokenizer) -> None:
    tok = builtin_tokenizer
    start, end = tok._tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    ids = tok.encode("hi") + [start] + tok.encode("there") + [end]
    assert "<|im_start|>" not in Detokenizer(tok).update(ids)
    kept = Detokenizer(tok, skip_special=False, hidden=frozenset({end})).update(ids)
    assert "<|im_start|>" in kept and not kept.endswith("<|im_end|>")


def test_the_flag_travels_the_internal_plane() -> None:
    p = SamplingParams(skip_special_tokens=False)
    assert params_from_json(params_to_json(p)).skip_special_tokens is False


def test_an_engine_run_without_skipping_matches_the_skipped_text_on_plain_output(make_engine) -> None:
    engine = make_engine()
    a = engine.add_request("The capital of France is", SamplingParams(max_tokens=6, temperature=0.0))
    b = engine.add_request(
        "The capital of France is", SamplingParams(max_tokens=6, temperature=0.0, skip_special_tokens=False)
    )
    out = engine.run_until_done()
    assert out[a].text == out[b].text and out[a].token_ids == out[b].token_ids
