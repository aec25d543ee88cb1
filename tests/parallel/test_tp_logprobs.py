"""Logprobs on a tensor-parallel replica: rank 0 samples from the gathered logits, so the sampled
tokens' logprobs and the prompt logprobs (their rows sent to every rank with the step) equal one
rank's."""

from __future__ import annotations

import pytest

from pagoda.node_agent.engine.config import ParallelConfig
from pagoda.node_agent.params import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPTS = ["The capital of France is", "def fib(n):"]
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, prompt_logprobs=2)


def logprobs_of(engine) -> list[tuple[list[int], list[dict], list]]:
    seen: dict[str, list] = {}

    def keep(o) -> None:
        seen.setdefault(o.request_id, [[], None])
        seen[o.request_id][0] += o.logprobs or []
        if o.prompt_logprobs is not None:
            seen[o.request_id][1] = o.prompt_logprobs

    ids = [engine.add_request(p, SamplingParams(**vars(PARAMS))) for p in PROMPTS]
    done = engine.run_until_done(on_output=keep)
    return [(done[i].token_ids, *seen[i]) for i in ids]


def values(entries: list) -> list[list[float]]:
    return [[] if e is None else [e["logprob"], *(t["logprob"] for t in e["top_logprobs"])] for e in entries]


def test_two_ranks_give_one_ranks_logprobs(make_engine):
    one = logprobs_of(make_engine(kv_memory=64 << 20, max_num_batched_tokens=16))
    engine = make_engine(
        parallel=ParallelConfig(tensor_parallel=2, dist_timeout=30),
        kv_memory=64 << 20,
        max_num_batched_tokens=16,
    )
    try:
        two = logprobs_of(engine)
    finally:
        engine.close()
    for (tok1, lp1, pr1), (tok2, lp2, pr2) in zip(one, two, strict=True):
        assert tok1 == tok2
        assert [e["token"] for e in lp1] == [e["token"] for e in lp2]
        for a, b in zip(values(lp1) + values(pr1), values(lp2) + values(pr2), strict=True):
            assert a == pytest.approx(b, abs=1e-3)
