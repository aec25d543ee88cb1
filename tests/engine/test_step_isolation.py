"""A step that raises ends only the request that causes it; the others finish as if it never ran."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import pytest

from pagoda.node_agent.engine.output import RequestOutput
from pagoda.node_agent.params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
HEALTHY = [
    ("The capital of France is", GREEDY),
    ("Count with me: one, two,", SamplingParams(max_tokens=6, temperature=0.9, seed=7, ignore_eos=True)),
    ("My favourite food is", GREEDY),
    ("Once upon a time", SamplingParams(max_tokens=6, temperature=0.7, seed=-(2**63), ignore_eos=True)),
]
POISONED_PROMPT = "A request that will go wrong:"

Poison = Callable[..., None]  # (engine, request id) -> None, applied before a given step


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine()


def uncached(engine):
    for pool in engine.pools().values():
        pool.clear_prefix_cache()
    return engine


def generate(
    engine, poison: Poison | None = None, at_step: int = 0
) -> tuple[list[RequestOutput], RequestOutput | None]:
    """The healthy requests (and a poisoned one, added last) to the end; their final outputs."""
    uncached(engine)
    rids = [engine.add_request(p, params) for p, params in HEALTHY]
    bad = engine.add_request(POISONED_PROMPT, GREEDY) if poison else None
    final: dict[str, RequestOutput] = {}
    step = 0
    while engine.has_unfinished():
        if poison is not None and step == at_step:
            poison(engine, bad)
        final.update((o.request_id, o) for o in engine.step() if o.finished)
        step += 1
    assert not engine.stalled()
    return [final[r] for r in rids], final.get(bad) if bad else None


@pytest.fixture(scope="module")
def baseline(engine) -> list[RequestOutput]:
    return generate(engine)[0]


def assert_idle(engine) -> None:
    for pool in engine.pools().values():
        pool.check_idle()
    assert not engine._requests and not engine.scheduler.has_work()


def bad_input_token(engine, rid):
    """The newest token (next step's input) out of the vocabulary: the embedding lookup raises."""
    engine.sequence(rid).output_token_ids[-1] = engine.model_config.vocab_size + 7


def bad_prompt_token(engine, rid):
    engine.sequence(rid).prompt_token_ids[-2] = engine.model_config.vocab_size + 7


def nan_temperature(engine, rid):
    """Sampling raises (NaN probabilities) after the seeded requests before it have drawn."""
    seq = engine.sequence(rid)
    seq.params = dataclasses.replace(seq.params, temperature=float("nan"))


def failing_stop_check(engine, rid):
    def boom(tok: int) -> None:
        raise RuntimeError("stop check exploded")

    engine._requests[rid].check_stop = boom


@pytest.mark.parametrize(
    "poison,at_step,message",
    [
        (bad_input_token, 2, "IndexError"),  # a decode step
        (bad_prompt_token, 0, "IndexError"),  # a prefill step
        (nan_temperature, 2, "probability tensor"),
        (failing_stop_check, 3, "stop check exploded"),
    ],
    ids=["decode-input", "prefill-input", "sampling", "stop-check"],
)
def test_only_the_poisoned_request_fails(engine, baseline, poison, at_step, message):
    aborted = engine.stats.requests_aborted
    healthy, bad = generate(engine, poison, at_step)
    assert bad is not None and bad.finished and bad.finish_reason == "error"
    assert message in bad.error and bad.text == ""
    for got, want in zip(healthy, baseline, strict=True):
        assert got.finish_reason == "length" and got.error is None
        assert got.token_ids == want.token_ids and got.text == want.text
    assert engine.stats.requests_aborted == aborted + 1
    assert_idle(engine)


def test_a_batch_that_ran_then_raised_is_rerun_without_changing_any_output(engine, baseline, monkeypatch):
    """The whole batch ran (KV written, seeded generators advanced), then raised: the retry in parts
    rewrites that KV and restarts the generators, so every request ends as it would have anyway."""
    real = engine.runner.run
    calls = {"n": 0}

    def run_then_raise(step, pool):
        calls["n"] += 1
        out = real(step, pool)
        if calls["n"] == 3 and len(step.seqs) == len(HEALTHY):
            raise RuntimeError("transient failure after the run")
        return out

    monkeypatch.setattr(engine.runner, "run", run_then_raise)
    aborted = engine.stats.requests_aborted
    healthy, _ = generate(engine)
    assert calls["n"] > 3  # the failed step was re-run in parts
    assert [o.token_ids for o in healthy] == [o.token_ids for o in baseline]
    assert [o.text for o in healthy] == [o.text for o in baseline]
    assert engine.stats.requests_aborted == aborted
    assert_idle(engine)


def test_a_failure_in_every_request_fails_them_all_and_the_engine_goes_on(engine, baseline, monkeypatch):
    real = engine.runner.run
    broken = {"on": False}

    def run(step, pool):
        if broken["on"]:
            raise RuntimeError("device lost")
        return real(step, pool)

    monkeypatch.setattr(engine.runner, "run", run)

    def break_runner(engine, rid):
        broken["on"] = True

    healthy, bad = generate(engine, break_runner, at_step=2)
    assert all(o.finish_reason == "error" and "device lost" in o.error for o in [*healthy, bad])
    assert_idle(engine)
    broken["on"] = False
    healthy, _ = generate(engine)
    assert [o.token_ids for o in healthy] == [o.token_ids for o in baseline]
    assert_idle(engine)


def test_a_lone_failing_request_fails_and_the_next_one_works(engine, baseline, caplog):
    uncached(engine)
    rid = engine.add_request(POISONED_PROMPT, GREEDY)
    engine.step()  # prefill
    bad_input_token(engine, rid)
    with caplog.at_level(logging.ERROR, logger="pagoda.engine"):
        outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [(rid, "error")]
    assert "IndexError" in outs[0].error
    logged = [r for r in caplog.records if r.levelno == logging.ERROR and rid in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is not None
    assert not engine.has_unfinished()
    assert_idle(engine)
    prompt, params = HEALTHY[0]
    again = engine.add_request(prompt, params)
    assert engine.run_until_done()[again].token_ids == baseline[0].token_ids
    assert_idle(engine)
