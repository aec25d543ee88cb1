"""Zero false positives: long randomized allocate / share / free / preempt / reuse runs never flag."""

from __future__ import annotations

import random

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagoda.node_agent.engine.integrity import TagTracker
from pagoda.node_agent.engine.sequence import Sequence
from pagoda.node_agent.kv.pool import OutOfPages
from pagoda.node_agent.params import SamplingParams

from .pool_helpers import small_pool


class PoolMachine(RuleBasedStateMachine):
    """Sequences grow, share cached prefix pages, finish, get preempted and reuse sealed pages; the
    tag check over every live block table must never flag one, and refcounts must add up."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = small_pool(num_pages=12, num_layers=1)
        self.tracker = TagTracker(backend="cpu")
        self.seqs: list[Sequence] = []
        self.n = 0
        self.sealed: list[bytes] = []

    def _new(self) -> Sequence:
        self.n += 1
        seq = Sequence(f"s{self.n}", [1], SamplingParams())
        self.seqs.append(seq)
        return seq

    @rule()
    def admit(self):
        seq = self._new()
        try:
            seq.block_table.append(self.pool.allocate())
        except OutOfPages:
            self.seqs.remove(seq)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 63), k=st.integers(1, 3))
    def grow(self, i, k):
        seq = self.seqs[i % len(self.seqs)]
        for _ in range(k):
            try:
                seq.block_table.append(self.pool.allocate())
            except OutOfPages:
                return

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 63))
    def seal_first_page(self, i):
        seq = self.seqs[i % len(self.seqs)]
        if seq.block_table:
            h = f"prefix-{seq.request_id}".encode()
            self.pool.seal(seq.block_table[0].page, h)
            self.sealed.append(h)

    @precondition(lambda self: self.sealed)
    @rule(i=st.integers(0, 63))
    def reuse_prefix(self, i):
        ref = self.pool.lookup(self.sealed[i % len(self.sealed)])
        if ref is not None:
            self._new().block_table.append(ref)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 63))
    def finish(self, i):
        seq = self.seqs.pop(i % len(self.seqs))
        self.pool.release_all(seq.block_table)
        seq.block_table = []

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 63))
    def preempt_and_readmit(self, i):
        seq = self.seqs[i % len(self.seqs)]
        n = len(seq.block_table)
        self.pool.release_all(seq.block_table)
        seq.block_table = []
        for _ in range(n):
            try:
                seq.block_table.append(self.pool.allocate())
            except OutOfPages:
                break

    @rule()
    def drop_prefix_cache(self):
        self.pool.clear_prefix_cache()
        self.sealed.clear()

    @invariant()
    def no_false_positive(self):
        assert self.tracker.check(self.seqs, self.pool) == {}

    @invariant()
    def refcounts_add_up(self):
        held = [0] * self.pool.num_pages
        for seq in self.seqs:
            for ref in seq.block_table:
                held[ref.page] += 1
        assert held == self.pool.refcount

    def teardown(self):
        for seq in self.seqs:
            self.pool.release_all(seq.block_table)
        self.pool.check_idle()


PoolMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestPoolMachine = PoolMachine.TestCase


@pytest.mark.slow
def test_engine_with_preemption_and_prefix_sharing_never_aborts(make_engine):
    """A randomized run on a tiny KV budget: staggered arrivals sharing cached prefixes, preemption."""
    rng = random.Random(5)
    eng = make_engine(kv_memory=6 << 20, max_num_seqs=8, max_num_batched_tokens=64)
    shared = "Answer in one short sentence, as a helpful and careful assistant would: "
    pending = [
        shared + q for q in ("Why is the sea salty?", "What is a prime number?", "Who wrote Hamlet?")
    ] * 3
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    final = {}
    n = 0
    while pending or eng.has_unfinished():
        while pending and rng.random() < 0.5:
            eng.add_request(pending.pop(), params, request_id=f"q{n}")
            n += 1
        for o in eng.step():
            if o.finished:
                final[o.request_id] = o
        if not eng.has_unfinished() and pending:
            eng.add_request(pending.pop(), params, request_id=f"q{n}")
            n += 1
    assert len(final) == 9 and all(o.finish_reason == "length" for o in final.values())
    assert eng.scheduler.num_preemptions > 0 and eng.scheduler.prefix_hit_tokens > 0
    c = eng.integrity.counters
    assert c.checks > 0 and c.mismatches == 0 and c.requests_aborted == 0
    eng.decode_pool.check_idle()
