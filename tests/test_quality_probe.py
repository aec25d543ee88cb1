"""The quality probe's contract: request validation and the torch-free comparison arithmetic."""

from __future__ import annotations

import math

import pytest

from pagoda.quality_probe import (
    ProbeError,
    ProbeSet,
    ScoredText,
    ScoreRequest,
    ScoreResponse,
    compare,
    greedy_agreement,
    position_kl,
)


def _dist(probs: dict[int, float]) -> list[tuple[int, float]]:
    return sorted(((i, math.log(p)) for i, p in probs.items()), key=lambda x: -x[1])


def test_position_kl_equals_the_full_kl_when_the_top_k_hold_all_mass() -> None:
    p = {0: 0.6, 1: 0.3, 2: 0.1}
    q = {0: 0.5, 1: 0.2, 2: 0.3}
    full = sum(p[i] * math.log(p[i] / q[i]) for i in p)
    ref = _dist(p)
    assert position_kl(ref, [math.log(q[i]) for i, _ in ref]) == pytest.approx(full, rel=1e-9)


def test_lumping_the_rest_gives_a_lower_bound_and_identical_is_zero() -> None:
    p = {0: 0.5, 1: 0.2, 2: 0.2, 3: 0.1}
    q = {0: 0.4, 1: 0.1, 2: 0.1, 3: 0.4}
    full = sum(p[i] * math.log(p[i] / q[i]) for i in p)
    top2 = _dist(p)[:2]
    approx = position_kl(top2, [math.log(q[i]) for i, _ in top2])
    assert 0 < approx < full
    assert position_kl(top2, [lp for _, lp in top2]) == pytest.approx(0.0, abs=1e-12)


def test_greedy_agreement_counts_the_identical_prefix() -> None:
    assert greedy_agreement([[1, 2, 3, 4]], [[1, 2, 9, 4]]) == (0.5, 0.0)
    assert greedy_agreement([[1, 2], [3]], [[1, 2], [3]]) == (1.0, 1.0)
    with pytest.raises(ProbeError):
        greedy_agreement([[1]], [])


def _response(ids, tops, targets=None, greedy=((5, 6),)) -> ScoreResponse:
    return ScoreResponse({"decode_kv": "fp8"}, [ScoredText(ids, tops, targets)], [list(g) for g in greedy])


def test_compare_through_the_wire_and_the_request_against_a_reference() -> None:
    ids = [7, 8, 9]
    ref_top = [_dist({1: 0.7, 2: 0.2}), _dist({3: 0.9, 4: 0.05})]
    ref = ScoreResponse.from_json(_response(ids, ref_top).to_json())
    body = ProbeSet(texts=["x"], prompts=["p"]).request(ref)
    assert body["texts"] == [{"token_ids": ids, "targets": [[1, 2], [3, 4]]}]
    parsed = ScoreRequest.parse(body, vocab_size=16)
    assert parsed.texts[0]["targets"] == [[1, 2], [3, 4]]
    same = _response(ids, ref_top, [[lp for _, lp in pos] for pos in ref_top])
    c = compare(ref, ScoreResponse.from_json(same.to_json()))
    assert c.mean_kl == pytest.approx(0.0, abs=1e-12) and c.top1 == 1.0 and c.greedy_identical == 1.0
    flipped = [_dist({2: 0.6, 1: 0.3}), ref_top[1]]
    worse = _response(
        ids, flipped, [[math.log(0.3), math.log(0.6)], [lp for _, lp in ref_top[1]]], greedy=[(5, 7)]
    )
    c = compare(ref, worse)
    assert c.mean_kl > 0.1 and c.top1 == 0.5 and c.greedy_prefix == 0.5 and c.positions == 2
    with pytest.raises(ProbeError, match="did not score"):
        compare(ref, _response([7, 8, 1], ref_top, same.texts[0].targets))


@pytest.mark.parametrize(
    "body, match",
    [
        ([], "JSON object"),
        ({"texts": [{"token_ids": [1]}]}, "2..4096"),
        ({"texts": [{"token_ids": [1, 99]}]}, "ids in 0..15"),
        ({"texts": [{"token_ids": [1, 2], "targets": [[1], [2]]}]}, "per position"),
        ({"texts": [{"text": ""}]}, "non-empty"),
        ({"top_k": 21}, "top_k"),
        ({"max_new_tokens": 257}, "max_new_tokens"),
        ({"prompts": ["a"] * 33}, "prompts"),
    ],
)
def test_a_malformed_request_is_refused_with_its_field(body, match) -> None:
    with pytest.raises(ProbeError, match=match):
        ScoreRequest.parse(body, vocab_size=16)


def test_a_malformed_response_is_a_probe_error() -> None:
    with pytest.raises(ProbeError):
        ScoreResponse.from_json({"texts": [{"token_ids": [1, 2], "top": []}], "greedy": []})
    with pytest.raises(ProbeError):
        ScoreResponse.from_json({"texts": "nope"})
