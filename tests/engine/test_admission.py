"""Admission's checks, without a model: one capacity rule for a new prompt and a handoff."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pagoda.node_agent.engine.admission import Admission, check_fits, tokens_needed
from pagoda.node_agent.params import RequestError, SamplingParams


def pool(capacity: int) -> SimpleNamespace:
    return SimpleNamespace(capacity_tokens=capacity, num_free=capacity // 16)


def admission(prefill: int = 256, decode: int = 128, max_model_len: int = 200) -> Admission:
    return Admission(pool(prefill), pool(decode), max_model_len, vocab_size=100, max_num_seqs=4)


def test_a_sequence_needs_its_prompt_and_every_token_it_may_still_generate() -> None:
    assert tokens_needed(10, SamplingParams(max_tokens=5), max_model_len=200) == 15
    assert tokens_needed(190, SamplingParams(max_tokens=50), max_model_len=200) == 200  # capped


def test_the_capacity_check_names_the_pool_it_refuses_for() -> None:
    check_fits(128, pool(128), "KV cache")  # exactly full fits
    with pytest.raises(RequestError) as err:
        check_fits(129, pool(128), "decode KV cache")
    assert str(err.value) == (
        "prompt + max_tokens (129 tokens) exceeds the decode KV cache capacity (128 tokens)"
    )


def test_a_prompt_is_checked_against_the_model_length_then_each_pool() -> None:
    adm = admission()
    with pytest.raises(RequestError, match="prompt has 200 tokens; the model length is 200"):
        adm.check_prompt([1] * 200, SamplingParams())
    small = admission(prefill=64)
    with pytest.raises(RequestError, match="prompt has 64 tokens; the prefill KV pool holds 64"):
        small.check_prompt([1] * 64, SamplingParams())
    with pytest.raises(RequestError, match=r"prompt \+ max_tokens \(150 tokens\) exceeds the KV cache"):
        adm.check_prompt([1] * 100, SamplingParams(max_tokens=50))
    adm.check_prompt([1] * 100, SamplingParams(max_tokens=50), prefill_only=True)  # needs 101 only


def test_a_request_id_in_flight_is_refused_and_a_missing_one_is_made() -> None:
    with pytest.raises(RequestError, match="request id 'a' is already in flight"):
        Admission.new_id("a", {"a": object()})
    assert Admission.new_id("b", {"a": object()}) == "b"
    made = Admission.new_id(None, {})
    assert len(made) == 32 and made != Admission.new_id(None, {})
