"""Counters and a typed snapshot of an engine, for servers, reporters and benchmarks."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class EngineStats:
    """Running totals the engine loop keeps."""

    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    migrations: int = 0  # sequences moved from the prefill pool to the decode pool
    step_seconds: dict[str, float] = field(default_factory=lambda: {"prefill": 0.0, "decode": 0.0})


@dataclass(frozen=True)
class KVPoolState:
    """One KV page pool's occupancy."""

    name: str
    num_pages: int
    num_used: int
    page_size: int
    capacity_tokens: int
    kv_format: str = ""


@dataclass(frozen=True)
class EngineState:
    """What an engine holds and has done, read on the engine's own thread (``LLMEngine.state()``)."""

    model: str
    formats: dict[str, str]
    pools: list[KVPoolState]
    running: int
    waiting: int
    integrity_mode: str
    integrity: dict[str, int]  # every IntegrityCounters field
    weight_bytes: int
    prefix_hit_tokens: int
    preemptions: int
    stats: EngineStats
    # the model's weight_bytes(): bytes by part, "linear", "total" and "by_format" (models/weight_bytes.py)
    weight_breakdown: dict[str, Any] = field(default_factory=dict)
    preemptions_by_pool: dict[str, int] = field(default_factory=dict)  # by the KV pool the victim was in
    # the time budget's BudgetStats.as_dict() (engine/step_budget.py); {} when steps are sized by tokens
    step_budget: dict[str, Any] = field(default_factory=dict)


def engine_state(engine) -> EngineState:
    """The snapshot of an ``LLMEngine`` (``LLMEngine.state()``)."""
    return EngineState(
        model=engine.config.model,
        formats=engine.config.formats.as_dict(),
        pools=[
            KVPoolState(name, p.num_pages, p.num_used, p.page_size, p.capacity_tokens, p.kv_format)
            for name, p in engine.pools().items()
        ],
        running=len(engine.scheduler.running),
        waiting=len(engine.scheduler.waiting),
        integrity_mode=engine.integrity.mode,
        integrity=dataclasses.asdict(engine.integrity.counters),
        weight_bytes=engine._weight_bytes,
        weight_breakdown=engine._weight_breakdown,
        prefix_hit_tokens=engine.scheduler.prefix_hit_tokens,
        preemptions=engine.scheduler.num_preemptions,
        preemptions_by_pool=dict(engine.scheduler.preemptions_by_pool),
        step_budget=engine.scheduler.budget.stats.as_dict() if engine.scheduler.budget else {},
        stats=dataclasses.replace(engine.stats, step_seconds=dict(engine.stats.step_seconds)),
    )
