"""The time-budgeted step, driven by a fake clock and a fake cost model: the scheduler alone, no model.

A fake device says what each step costs; the fake clock advances by that much per step. Checked:
while decodes run, no prefill step's predicted stall (the decode step + the prefill step) exceeds
the target; every prefill finishes; the floor is granted even when nothing of the target remains;
with no decode running the budget does not bind; the online fit recovers a linear device."""

from __future__ import annotations

import pytest
import torch

from pagoda.node_agent.engine.scheduler import Scheduler, SchedulerConfig
from pagoda.node_agent.engine.sequence import Sequence
from pagoda.node_agent.engine.step_budget import AUTO_FACTOR, StepBudget, pages_of
from pagoda.node_agent.engine.step_cost import StepCostModel
from pagoda.node_agent.kv.pool import KVPagePool
from pagoda.node_agent.params import SamplingParams

PAGE = 16
CHUNK = 256  # max_num_batched_tokens


def device_seconds(phase: str, work: dict[str, float]) -> float:
    """The fake device: linear in the work, as the cost model assumes."""
    if phase == "decode":
        return 0.002 + 0.0005 * work["batch"] + 0.00001 * work["pages"]
    return 0.003 + 0.00005 * work["tokens"] + 0.000002 * work["pages"]


class ExactCostModel:
    """A fake cost model that knows the fake device (it predicts once it has seen a step)."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def seeded(self, phase: str) -> bool:
        return phase in self.seen

    def predict(self, phase: str, work: dict[str, float]) -> float | None:
        return device_seconds(phase, work) if phase in self.seen else None

    def observe(self, phase: str, work: dict[str, float], seconds: float) -> None:
        self.seen.add(phase)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_scheduler(model, target_s: float | None, floor: int) -> tuple[Scheduler, StepBudget, Clock]:
    pool = KVPagePool(1, 512, PAGE, {"k": (1, 4), "v": (1, 4)}, torch.float32)
    clock = Clock()
    budget = StepBudget(model, target_s, floor, PAGE, clock=clock)
    cfg = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=CHUNK, enable_prefix_caching=False)
    return Scheduler(cfg, pool, budget=budget), budget, clock


def seq(i: int, prompt: int, out: int) -> Sequence:
    return Sequence(f"r{i}", [1 + (i + j) % 50 for j in range(prompt)], SamplingParams(max_tokens=out))


def simulate(sched: Scheduler, budget: StepBudget, clock: Clock, arrivals: dict[int, list[Sequence]]):
    """Run the scheduler as the engine does: each step costs device_seconds on the fake clock; a
    sequence samples a token when its KV covers all its tokens. Returns one record per step."""
    records, everyone, n = [], [s for group in arrivals.values() for s in group], 0
    while n <= max(arrivals) or sched.has_work():
        for s in arrivals.get(n, []):
            sched.add(s)
        n += 1
        decodes = [s for s in sched.running if not s.needs_prefill]
        step = sched.schedule()
        if step is None:
            continue
        work = budget._pending[1]
        decode_s = device_seconds("decode", budget.decode_work(decodes)) if decodes else 0.0
        records.append((step.phase, sum(step.num_new_tokens), bool(decodes), decode_s, work))
        clock.now += device_seconds(step.phase, work)
        for s, k in zip(step.seqs, step.num_new_tokens, strict=True):
            s.num_computed_tokens += k
            if s.num_computed_tokens == s.num_tokens:
                s.output_token_ids.append(7)
                if len(s.output_token_ids) >= s.params.max_tokens:
                    s.finish("length")
                    sched.finish(s)
        sched.step_done()
        assert n < 10_000, "the schedule does not end"
    assert all(s.finished for s in everyone), "every prefill finishes and every sequence ends"
    return records


def staggered() -> dict[int, list[Sequence]]:
    """Four streams decode while long prompts keep arriving."""
    out = {0: [seq(i, 24, 40) for i in range(4)]}
    for k in range(6):
        out[8 + 10 * k] = [seq(10 + k, 700, 8)]
    return out


def test_prefill_steps_stay_within_the_target_while_decodes_run():
    target = 0.012
    sched, budget, clock = make_scheduler(ExactCostModel(), target, floor=16)
    records = simulate(sched, budget, clock, staggered())
    budgeted = [r for r in records if r[0] == "prefill" and r[2]]
    assert budgeted, "prompts arrived while streams decoded"
    for _, tokens, _, decode_s, work in budgeted:
        assert decode_s + device_seconds("prefill", work) <= target + 1e-12
        assert tokens >= 1
    assert any(tokens < CHUNK for _, tokens, *_ in budgeted), "the budget cut some chunks"
    assert budget.stats.floor_steps == 0 and budget.stats.budgeted_steps == len(budgeted)
    assert 0 < budget.stats.planned_s / budget.stats.target_s <= 1


def test_the_floor_goes_through_when_nothing_of_the_target_remains():
    floor = 24
    sched, budget, clock = make_scheduler(ExactCostModel(), 0.0001, floor)  # below any decode step
    records = simulate(sched, budget, clock, staggered())
    budgeted = [r for r in records if r[0] == "prefill" and r[2]]
    assert budgeted
    for _, tokens, _, _, work in budgeted:
        assert tokens == floor or tokens == work["tokens"] < floor  # the floor, or a prompt's tail
    assert budget.stats.floor_steps == len(budgeted)


def test_without_decodes_the_budget_does_not_bind():
    sched, budget, clock = make_scheduler(ExactCostModel(), 0.0001, floor=16)
    records = simulate(sched, budget, clock, {0: [seq(0, 600, 2)]})
    assert [t for p, t, *_ in records if p == "prefill"] == [CHUNK, CHUNK, 600 - 2 * CHUNK]
    assert budget.stats.budgeted_steps == 0


def test_auto_target_is_a_multiple_of_the_decode_step():
    sched, budget, clock = make_scheduler(ExactCostModel(), None, floor=16)
    simulate(sched, budget, clock, staggered())
    s = budget.stats
    assert s.budgeted_steps > 0
    last_decode = s.last_target_s / AUTO_FACTOR
    assert 0.002 < last_decode < 0.01  # one decode step of the fake device at a small batch


def test_the_online_fit_learns_the_device_and_keeps_the_budget():
    target = 0.012
    model = StepCostModel({"prefill": "bf16/bf16", "decode": "int4/int8"})
    sched, budget, clock = make_scheduler(model, target, floor=16)
    records = simulate(sched, budget, clock, staggered())
    late = [r for r in records if r[0] == "prefill" and r[2]][3:]  # after the first few timed steps
    assert late
    for _, _, _, decode_s, work in late:
        assert decode_s + device_seconds("prefill", work) <= target * 1.05
    for phase, work in (("decode", {"batch": 6, "pages": 30}), ("prefill", {"tokens": 100, "pages": 20})):
        assert model.predict(phase, work) == pytest.approx(device_seconds(phase, work), rel=0.05)
    assert set(model.coefficients()) == {"prefill:bf16/bf16", "decode:int4/int8"}


def test_linear_fit_recovers_coefficients_and_stays_non_negative():
    model = StepCostModel()
    for b in range(1, 40):
        work = {"batch": b, "pages": 3 * b + (b % 5)}
        model.observe("decode", work, device_seconds("decode", work))
    coef = model.coefficients()["decode"]
    assert coef["step"] == pytest.approx(0.002, rel=0.02)
    assert coef["batch"] == pytest.approx(0.0005, rel=0.02)
    # a device whose time falls with pages: the fit pins that coefficient to 0, never below
    for t in range(1, 30):
        model.observe("prefill", {"tokens": 10 * t, "pages": 40 - t}, 0.001 * t)
    assert min(model.coefficients()["prefill"].values()) >= 0
    assert pages_of(17, 16) == 2


def test_the_floor_is_capped_at_the_step_token_limit_and_must_be_positive():
    from pagoda.node_agent.engine.build import step_budget
    from pagoda.node_agent.engine.config import ConfigError, EngineConfig

    cfg = EngineConfig(max_num_batched_tokens=16, itl_target_ms=50.0)  # the default floor is 32
    assert step_budget(cfg).floor == 16
    with pytest.raises(ConfigError, match="min_prefill_tokens"):
        EngineConfig(min_prefill_tokens=0).validate()


def test_bench_hold_keeps_every_sequence_for_a_full_batch_under_the_floor():
    """``bench``'s full-batch window (stepping.tokens_to_hold_batch) must exist when the time budget
    cuts every prefill step beside running decodes down to the floor: 32 prompts of 127 tokens."""
    from types import SimpleNamespace

    from pagoda.node_agent.bench.stepping import tokens_to_hold_batch

    floor, c, prompt = 32, 32, 127
    engine = SimpleNamespace(
        config=SimpleNamespace(max_num_batched_tokens=CHUNK, itl_target_ms=0.0, min_prefill_tokens=floor)
    )
    hold = tokens_to_hold_batch(engine, prompt, c, decode_steps=4)
    sched, budget, clock = make_scheduler(ExactCostModel(), 0.0001, floor)
    sched.config.max_num_seqs = c
    records = simulate(sched, budget, clock, {0: [seq(i, prompt, hold) for i in range(c)]})
    full = [r for r in records if r[0] == "decode" and r[4]["batch"] == c]
    assert len(full) >= 4, "some decode steps held every sequence"
