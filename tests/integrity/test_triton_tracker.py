"""The tracker with the Triton tag-check kernel (the interpreter on CPU) agrees with the reference."""

from __future__ import annotations

import random

import pytest

from pagoda.kernels.dispatch import triton_available
from pagoda.node_agent.engine.fault_injection import make_stale
from pagoda.node_agent.engine.integrity import TagTracker, release_owned

from .pool_helpers import random_sequences, small_pool


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_triton_tracker_flags_exactly_like_the_reference():
    rng = random.Random(11)
    pool = small_pool()
    triton, ref = TagTracker(backend="triton"), TagTracker(backend="reference")
    for _ in range(40):
        seqs = random_sequences(pool, rng, rng.randint(1, 6))
        victims = [s for s in seqs if s.block_table and rng.random() < 0.4]
        for v in victims:
            make_stale(pool, v, rng=rng)
        got = triton.check(seqs, pool)
        assert set(got) == set(ref.check(seqs, pool)) == set(victims)
        for seq in seqs:
            release_owned(seq, pool, seqs)
        pool.check_idle()
