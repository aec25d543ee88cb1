"""Step an engine through a workload and keep what every step did, so a bench can time exactly the
window it names (pure decode steps, all ``c`` sequences running) instead of a whole run."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pagoda.node_agent.params import SamplingParams


@dataclass
class StepRecord:
    """One ``engine.step()``: wall seconds, tokens by phase, migrations, and a probe's extras."""

    seconds: float
    prefill_tokens: int
    decode_tokens: int
    migrations: int
    preemptions: int
    extra: dict = field(default_factory=dict)

    @property
    def pure_decode(self) -> bool:
        """A decode step with no prefill (nor recompute, which is prefill) or pool migration in it.

        A step that preempted a sequence still counts: preempting only frees pages; the recompute
        it causes runs later as prefill steps, which are left out."""
        return self.decode_tokens > 0 and not self.prefill_tokens and not self.migrations


@dataclass
class Trace:
    """Every step of one run, and the time from submission to each request's first token."""

    steps: list[StepRecord]
    ttft_s: list[float]
    total_s: float

    def window(self, batch: int | None = None) -> list[StepRecord]:
        """Pure decode steps; with ``batch``, only those that decoded exactly ``batch`` sequences."""
        return [s for s in self.steps if s.pure_decode and (batch is None or s.decode_tokens == batch)]

    def decode_rate(self, batch: int | None = None) -> dict:
        """Tokens/s over ``window(batch)``, with its step count and mean batch (0s if it is empty)."""
        w = self.window(batch)
        secs = sum(s.seconds for s in w)
        toks = sum(s.decode_tokens for s in w)
        return {
            "decode_tok_s": toks / secs if secs > 0 else 0.0,
            "window_steps": len(w),
            "window_mean_batch": toks / len(w) if w else 0.0,
            "decode_step_s": secs / len(w) if w else 0.0,
        }

    def full_batch_rate(self, batch: int) -> dict:
        """``decode_rate(batch)``, refusing a run in which no decode step held all ``batch``
        sequences (a figure of 0 would read as a measurement)."""
        rate = self.decode_rate(batch)
        if not rate["window_steps"]:
            raise ValueError(
                f"no decode step ran all {batch} sequences at once: the KV budget (--kv-memory) or "
                f"--max-num-seqs is too small for concurrency {batch}"
            )
        return rate

    def median_ttft(self) -> float:
        t = sorted(self.ttft_s)
        return t[len(t) // 2] if t else 0.0


def tokens_to_hold_batch(engine, prompt_tokens: int, concurrency: int, decode_steps: int) -> int:
    """max_tokens that keeps all ``concurrency`` sequences decoding together for ``decode_steps``
    steps: the scheduler alternates prefill and decode steps, so the first sequence admitted can
    decode once per prefill step before the last prompt is in. With a time budget
    (``itl_target_ms``) a prefill step beside running decodes may take only the floor
    (``min_prefill_tokens``), one prompt's chunk at a time at worst."""
    cfg = engine.config
    prompt = max(1, prompt_tokens)
    budget = max(1, cfg.max_num_batched_tokens)
    prefill_steps = math.ceil(concurrency * prompt / budget)
    if cfg.itl_target_ms is not None:
        floor = max(1, min(cfg.min_prefill_tokens, budget))
        prefill_steps = max(prefill_steps, concurrency * math.ceil(prompt / floor))
    return decode_steps + prefill_steps + 1


def run_steps(
    engine,
    prompts: list,
    max_tokens: int,
    probe: Callable[[], dict] | None = None,
    guided: dict | None = None,
) -> Trace:
    """Submit every prompt at once (greedy, EOS ignored) and step to the end, recording each step.

    ``probe()`` is called after every step; what it returns is stored in that step's ``extra``.
    ``guided``: every request's decoding constraint (SamplingParams.guided)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, guided=guided)
    stats, sched = engine.stats, engine.scheduler
    t0 = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    first: dict[str, float] = {}
    steps: list[StepRecord] = []
    while engine.has_unfinished():
        before = (stats.prefill_tokens, stats.decode_tokens, stats.migrations, sched.num_preemptions)
        ts = time.perf_counter()
        outs = engine.step()
        now = time.perf_counter()
        steps.append(
            StepRecord(
                seconds=now - ts,
                prefill_tokens=stats.prefill_tokens - before[0],
                decode_tokens=stats.decode_tokens - before[1],
                migrations=stats.migrations - before[2],
                preemptions=sched.num_preemptions - before[3],
                extra=probe() if probe is not None else {},
            )
        )
        for o in outs:
            if o.error:
                raise RuntimeError(f"bench request {o.request_id} failed: {o.error}")
            if o.token_ids:
                first.setdefault(o.request_id, now)
    end = time.perf_counter()
    return Trace(steps=steps, ttft_s=[first[i] - t0 for i in ids if i in first], total_s=end - t0)
