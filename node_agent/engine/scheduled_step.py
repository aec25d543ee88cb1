"""One scheduled step: its phase, its sequences and how many tokens each computes."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from pagoda.node_agent.engine.sequence import Sequence


@dataclass
class ScheduledStep:
    phase: str  # "prefill" | "decode"
    seqs: list[Sequence]
    num_new_tokens: list[int]  # tokens each sequence computes in this step
    preempted: list[Sequence] = field(default_factory=list)

    def excluding(self, drop: Collection[Sequence]) -> ScheduledStep | None:
        """The same step without ``drop`` (failed its integrity check); None when nothing is left."""
        keep = [(s, n) for s, n in zip(self.seqs, self.num_new_tokens, strict=True) if s not in drop]
        if not keep:
            return None
        return ScheduledStep(self.phase, [s for s, _ in keep], [n for _, n in keep], self.preempted)

    def only(self, seqs: Collection[Sequence]) -> ScheduledStep:
        """The same step for ``seqs`` alone (each with its token count), to isolate a failure."""
        keep = [(s, n) for s, n in zip(self.seqs, self.num_new_tokens, strict=True) if s in seqs]
        return ScheduledStep(self.phase, [s for s, _ in keep], [n for _, n in keep])
