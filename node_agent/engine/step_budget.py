"""The time-budgeted step: how many prompt tokens the next prefill step may take so that running
streams are not stalled past an inter-token target.

Steps alternate (scheduler.py): between two decode steps runs at most one prefill step, so a
running stream waits one decode step plus one prefill step for its next token. Decodes come first:
the cost model (step_cost.py) predicts the decode step of the running batch, and the prefill step
gets what remains of the target, ``target - decode``. Its chunks are sized against the model's
prefill prediction. A floor (``min_prefill_tokens``) is granted even when nothing remains, so that
prefill always progresses and time to first token stays bounded. With no decode running (the
first request, a prefill-only worker) nothing is stalled and the budget does not bind: the token
budget (``max_num_batched_tokens``) alone applies.

The target is fixed (``--itl-target-ms``) or, by default, derived from the device: ``AUTO_FACTOR``
times the decode step the model predicts for the running batch, so that a prefill step takes at
most as long as the decode step it follows. Every step is timed, from ``schedule()`` to the end of
the engine's step, and refines the model.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from pagoda.node_agent.engine.sequence import Sequence
from pagoda.node_agent.engine.step_cost import StepCostModel

AUTO_FACTOR = 2.0  # the default target: this many decode steps of the running batch
DEFAULT_MIN_PREFILL_TOKENS = 32


def _phases() -> dict[str, float]:
    return {"prefill": 0.0, "decode": 0.0}


@dataclass
class BudgetStats:
    """Counters of the budget: predicted and measured step seconds (steps the model could predict),
    and the budgeted prefill steps' planned stall against their target."""

    timed_steps: dict[str, float] = field(default_factory=_phases)
    predicted_s: dict[str, float] = field(default_factory=_phases)
    actual_s: dict[str, float] = field(default_factory=_phases)
    budgeted_steps: int = 0  # prefill steps planned while decodes were running
    planned_s: float = 0.0  # their predicted stall (decode + prefill step), summed
    target_s: float = 0.0  # their targets, summed: utilisation = planned_s / target_s
    floor_steps: int = 0  # budgeted steps the floor pushed past the target
    last_target_s: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def pages_of(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


class PrefillPlan:
    """One prefill step under a binding budget: the chunks taken so far and the time left for them."""

    def __init__(self, model: StepCostModel, remaining_s: float, floor: int, page_size: int) -> None:
        self.model, self.remaining_s, self.floor, self.page_size = model, remaining_s, floor, page_size
        self.tokens = 0
        self.pages = 0

    def predicted(self, tokens: int | None = None, pages: int | None = None) -> float:
        work = {
            "tokens": self.tokens if tokens is None else tokens,
            "pages": self.pages if pages is None else pages,
        }
        return self.model.predict("prefill", work) or 0.0

    def fit(self, seq: Sequence, n: int) -> int:
        """The most of ``n`` new tokens of ``seq`` the step may take: what fits the time left, and at
        least what the floor still grants."""
        granted = min(n, max(0, self.floor - self.tokens))
        if not self.model.seeded("prefill"):
            return granted
        c, ps = seq.num_computed_tokens, self.page_size

        def fits(m: int) -> bool:
            return self.predicted(self.tokens + m, self.pages + pages_of(c + m, ps)) <= self.remaining_s

        lo, hi = 0, n  # the largest m with fits(m): binary search (the prediction grows with m)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return max(granted, lo)

    def take(self, seq: Sequence, n: int) -> None:
        """Count ``n`` tokens of ``seq`` as scheduled (before they are computed)."""
        self.tokens += n
        self.pages += pages_of(seq.num_computed_tokens + n, self.page_size)


class StepBudget:
    """The budget of one scheduler: its cost model, target and floor, and the step being timed.

    ``target_s`` None derives the target from the device (AUTO_FACTOR x the decode step); ``clock``
    is injectable so that tests drive it."""

    def __init__(
        self,
        model: StepCostModel,
        target_s: float | None = None,
        floor: int = DEFAULT_MIN_PREFILL_TOKENS,
        page_size: int = 16,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.model, self.target_s, self.floor, self.page_size, self.clock = (
            model,
            target_s,
            floor,
            page_size,
            clock,
        )
        self.stats = BudgetStats()
        self._pending: tuple[str, dict[str, float], float | None, float] | None = None
        self._plan: tuple[PrefillPlan, float, float] | None = None  # plan, decode seconds, target

    def decode_work(self, seqs: list[Sequence]) -> dict[str, float]:
        return {"batch": len(seqs), "pages": sum(pages_of(s.num_tokens, self.page_size) for s in seqs)}

    def target_for(self, decode_s: float) -> float:
        """The inter-token target with a decode step of ``decode_s`` seconds running."""
        return self.target_s if self.target_s is not None else AUTO_FACTOR * decode_s

    def plan(self, decodes: list[Sequence]) -> PrefillPlan | None:
        """The plan of a prefill step with ``decodes`` running; None when the budget does not bind
        (no decode running, or no decode step timed yet)."""
        self._plan = None
        decode_s = self.model.predict("decode", self.decode_work(decodes)) if decodes else None
        if decode_s is None:
            return None
        target = self.target_for(decode_s)
        plan = PrefillPlan(self.model, target - decode_s, self.floor, self.page_size)
        self._plan = (plan, decode_s, target)
        return plan

    def started(self, phase: str, seqs: list[Sequence], counts: list[int]) -> None:
        """A step was scheduled: note its work and prediction and start its clock."""
        if phase == "decode":
            work = self.decode_work(seqs)
        else:
            pages = sum(
                pages_of(s.num_computed_tokens + n, self.page_size) for s, n in zip(seqs, counts, strict=True)
            )
            work = {"tokens": float(sum(counts)), "pages": float(pages)}
            self._account_plan(work)
        self._pending = (phase, work, self.model.predict(phase, work), self.clock())
        self._plan = None

    def _account_plan(self, work: dict[str, float]) -> None:
        if self._plan is None:
            return
        plan, decode_s, target = self._plan
        planned = decode_s + (self.model.predict("prefill", work) or 0.0)
        s = self.stats
        s.budgeted_steps += 1
        s.planned_s += planned
        s.target_s += target
        s.last_target_s = target
        if planned > target:
            s.floor_steps += 1

    def finished(self) -> None:
        """The step scheduled last has ended: feed its measured time to the model."""
        if self._pending is None:
            return
        phase, work, predicted, t0 = self._pending
        self._pending = None
        seconds = self.clock() - t0
        if predicted is not None:
            self.stats.timed_steps[phase] += 1
            self.stats.predicted_s[phase] += predicted
            self.stats.actual_s[phase] += seconds
        self.model.observe(phase, work, seconds)
