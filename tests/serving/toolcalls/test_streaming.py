"""Streaming gives what one-shot parsing gives, however the output is split: at every character
boundary, into 1-character pieces, and into random pieces."""

from __future__ import annotations

import random

import pytest

from pagoda.node_agent.serving.api.toolcalls import assemble, get_parser
from tests.serving.toolcalls.cases import TOOLS, all_cases, case_id, check, normalized


def _stream(name: str, pieces: list[str]):
    parser = get_parser(name)(TOOLS)
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    events += parser.finish()
    return events, parser.invalid


@pytest.mark.parametrize("item", all_cases(), ids=case_id)
def test_every_split_gives_the_one_shot_events(item):
    name, case = item
    whole, invalid = _stream(name, [case.text])
    check(assemble(whole, invalid), case)
    want = normalized(whole)
    for cut in range(len(case.text) + 1):
        events, n = _stream(name, [case.text[:cut], case.text[cut:]])
        assert (normalized(events), n) == (want, invalid), f"split at {cut}: {case.text[:cut]!r}"
    events, n = _stream(name, list(case.text))
    assert (normalized(events), n) == (want, invalid), "1-character pieces"
    rng = random.Random(len(case.text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(case.text) + 1), min(6, len(case.text) + 1)))
        pieces = [case.text[a:b] for a, b in zip([0, *cuts], [*cuts, len(case.text)], strict=True)]
        events, n = _stream(name, pieces)
        assert (normalized(events), n) == (want, invalid), f"pieces {pieces!r}"
