"""Every injected stale mapping or flipped tag is detected, only its request fails, pages come back."""

from __future__ import annotations

import random

from pagoda.node_agent.engine.fault_injection import flip_expected_tag, make_stale
from pagoda.node_agent.engine.integrity import TagTracker, release_owned
from pagoda.node_agent.engine.sequence import Sequence
from pagoda.node_agent.params import SamplingParams

from .pool_helpers import random_sequences, small_pool

TRIALS = 2500


def _release(seqs, bad, pool) -> None:
    """Fail the flagged sequences safely, finish the others normally."""
    for seq in seqs:
        if seq in bad:
            release_owned(seq, pool, seqs)
    for seq in seqs:
        if seq not in bad:
            pool.release_all(seq.block_table)
            seq.block_table = []


def test_every_injected_fault_is_flagged_and_only_it():
    rng = random.Random(1234)
    pool = small_pool()
    tracker = TagTracker(backend="cpu")
    injected_total = 0
    for _ in range(TRIALS):
        seqs = random_sequences(pool, rng, rng.randint(1, 8))
        mapped = [s for s in seqs if s.block_table]
        victims = rng.sample(mapped, rng.randint(1, min(3, len(mapped))))
        for v in victims:
            if rng.random() < 0.75:
                make_stale(pool, v, rng=rng)
            else:
                flip_expected_tag(v, rng=rng)
        injected_total += len(victims)
        # an unrelated allocation may take the freed page, as a real use-after-free would
        extra = pool.allocate() if pool.num_free and rng.random() < 0.5 else None
        bad = tracker.check(seqs, pool)
        assert set(bad) == set(victims)
        for seq, err in bad.items():
            assert seq.request_id in str(err) and "expected generation tag" in str(err)
        _release(seqs, bad, pool)
        if extra is not None:
            pool.release(extra.page)
        pool.check_idle()
    assert injected_total >= TRIALS
    assert tracker.counters.mismatches == injected_total == tracker.counters.requests_aborted


def test_page_reused_by_another_sequence_keeps_its_new_owner():
    pool = small_pool(num_pages=3)
    tracker = TagTracker(backend="cpu")
    a = Sequence("a", [1], SamplingParams())
    b = Sequence("b", [1], SamplingParams())
    c = Sequence("c", [1], SamplingParams())
    a.block_table = [pool.allocate(), pool.allocate()]
    b.block_table = [pool.allocate()]
    fault = make_stale(pool, a, slot=0)
    c.block_table = [pool.allocate()]  # the freed page goes straight to a new owner
    assert c.block_table[0].page == fault.page == a.block_table[0].page
    bad = tracker.check([a, b, c], pool)
    assert list(bad) == [a]
    assert "block 0" in str(bad[a]) and f"page {fault.page}" in str(bad[a])
    kept = release_owned(a, pool, [a, b, c])
    assert [r.page for r in kept] == [fault.page]
    assert pool.refcount[fault.page] == 1  # c still owns it
    assert tracker.check([b, c], pool) == {}
    pool.release_all(b.block_table + c.block_table)
    pool.check_idle()


def test_flipped_tag_releases_the_page_it_still_owns():
    pool = small_pool(num_pages=2)
    a = Sequence("a", [1], SamplingParams())
    a.block_table = [pool.allocate(), pool.allocate()]
    flip_expected_tag(a, slot=1)
    assert list(TagTracker().check([a], pool)) == [a]
    assert release_owned(a, pool, [a]) == []
    pool.check_idle()
