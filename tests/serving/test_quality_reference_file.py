"""The continuous probe's reference file: absent at start (a new pair starts before its gate has
written the ConfigMap), appearing later, replaced, or broken. The scoring itself runs on live
servers in test_quality_score.py; here only the file handling, with a scorer that validates the
request as a pod of the built-in model's vocabulary does and computes nothing."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from pagoda.node_agent.serving.api.metrics import ServeMetrics
from pagoda.node_agent.serving.worker.quality_loop import QualityConfigError, QualityLoop
from pagoda.quality_probe import PROBE_PROMPTS, ScoredText, ScoreRequest, ScoreResponse

VOCAB = 49152


class ParseOnly:
    """The Scorer's validation (``ScoreRequest.parse``) without an engine."""

    def parse(self, raw: object) -> ScoreRequest:
        return ScoreRequest.parse(raw, VOCAB)


def reference(first_token: int) -> ScoreResponse:
    ids = [first_token, 5, 6, 7]
    top = [[(i + 1, -0.1), (i + 2, -2.5)] for i in ids[:-1]]
    return ScoreResponse({"decode_weights": "int4"}, [ScoredText(ids, top)], [[1, 2]] * len(PROBE_PROMPTS))


def write(path, ref: ScoreResponse, bump: int) -> None:
    path.write_text(json.dumps(ref.to_json()))
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + bump))  # a new stamp even within one tick


def test_no_reference_yet_means_waiting_not_failing(tmp_path) -> None:
    path = tmp_path / "reference.json"
    loop = QualityLoop(ParseOnly(), str(path), ServeMetrics("decode"), interval_s=600)
    assert loop.refresh() is False and loop.failures == 0 and loop.report() is None
    with pytest.raises(RuntimeError, match="no quality reference"):
        asyncio.run(loop.probe_once())
    assert loop.failures == 0  # waiting is not a failed probe
    write(path, reference(3), 1)
    assert loop.refresh() is True and loop.reference.texts[0].token_ids[0] == 3
    assert loop.body["texts"][0]["targets"][0] == [4, 5]  # asks for the reference's top-k ids


def test_a_replaced_reference_is_read_again_and_a_broken_one_keeps_the_last(tmp_path, caplog) -> None:
    path = tmp_path / "reference.json"
    write(path, reference(3), 1)
    loop = QualityLoop(ParseOnly(), str(path), ServeMetrics("decode"), interval_s=600)
    assert loop.reference.texts[0].token_ids[0] == 3
    write(path, reference(9), 2)
    assert loop.refresh() and loop.reference.texts[0].token_ids[0] == 9
    path.write_text("{not json")
    with caplog.at_level("WARNING", logger="pagoda.quality"):
        assert loop.refresh() is True
    assert loop.reference.texts[0].token_ids[0] == 9 and "keeping the last reference" in caplog.text
    write(path, reference(VOCAB + 1), 3)  # a token this pod's vocabulary does not have
    assert loop.refresh() and loop.reference.texts[0].token_ids[0] == 9


def test_a_broken_reference_at_start_refuses_the_server(tmp_path) -> None:
    path = tmp_path / "reference.json"
    path.write_text('{"texts": []}')
    with pytest.raises(QualityConfigError, match="reference.json"):
        QualityLoop(ParseOnly(), str(path), ServeMetrics("decode"), interval_s=600)
    write(path, reference(VOCAB + 1), 1)
    with pytest.raises(QualityConfigError, match="reference.json"):
        QualityLoop(ParseOnly(), str(path), ServeMetrics("decode"), interval_s=600)
