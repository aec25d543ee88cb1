"""The real engine with time-budgeted steps stays token-exact under greedy decoding."""

from __future__ import annotations

import pytest

from pagoda.node_agent.params import SamplingParams

from .prompts import PLAIN_PROMPTS

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
# long enough for several floor-sized chunks (the chat prompts are templated to ~30-40 tokens)
PROMPTS = [PLAIN_PROMPTS[3] * 2, PLAIN_PROMPTS[2], PLAIN_PROMPTS[1] * 3]


def one_at_a_time(engine) -> list[list[int]]:
    out = []
    for p in PROMPTS:
        rid = engine.add_request(p, PARAMS)
        out.append(engine.run_until_done()[rid].token_ids)
    return out


def staggered(engine) -> list[list[int]]:
    """A new prompt every other step while the earlier ones decode."""
    pending, rids, final, n = list(PROMPTS), [], {}, 0
    while pending or engine.has_unfinished():
        if pending and n % 2 == 0:
            rids.append(engine.add_request(pending.pop(0), PARAMS))
        final.update({o.request_id: o for o in engine.step() if o.finished})
        n += 1
    return [final[r].token_ids for r in rids]


@pytest.fixture(scope="module")
def reference(engine) -> list[list[int]]:
    return one_at_a_time(engine)


@pytest.mark.parametrize(
    "target_ms", [0.0, pytest.param(1.0, marks=pytest.mark.slow)], ids=["auto", "floor-bound"]
)
def test_budgeted_steps_keep_greedy_output(make_engine, reference, target_ms):
    """auto: 2x the decode step; 1 ms: below any decode step here, so the floor sizes every chunk."""
    eng = make_engine(itl_target_ms=target_ms, min_prefill_tokens=16, enable_prefix_caching=False)
    assert staggered(eng) == reference
    stats = eng.scheduler.budget.stats
    assert stats.budgeted_steps > 0 and stats.timed_steps["decode"] > 0
    assert eng.state().step_budget["budgeted_steps"] == stats.budgeted_steps
    if target_ms == 1.0:
        assert stats.floor_steps == stats.budgeted_steps
    eng.decode_pool.check_idle()
