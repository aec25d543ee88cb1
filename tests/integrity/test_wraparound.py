"""Generation tags wrap from 2**31 - 1 to 1 (never 0) and an old tag never matches a reused page."""

from __future__ import annotations

from pagoda.kernels.integrity import TAG_MAX
from pagoda.node_agent.engine.integrity import TagTracker
from pagoda.node_agent.engine.sequence import Sequence
from pagoda.node_agent.params import SamplingParams

from .engine_helpers import run_all
from .pool_helpers import small_pool


def _set_tag(pool, page: int, tag: int) -> None:
    pool._tags[page] = tag
    pool.tag_table[page] = tag


def test_tags_wrap_and_old_mappings_never_match_again():
    pool = small_pool(num_pages=1)
    _set_tag(pool, 0, TAG_MAX - 5)
    tracker = TagTracker(backend="cpu")
    old: list[Sequence] = []
    seen = []
    for i in range(3000):  # many reuse cycles of the same physical page across the wrap
        ref = pool.allocate()
        seen.append(ref.tag)
        live = Sequence(f"live{i}", [1], SamplingParams())
        live.block_table = [ref]
        assert tracker.check([live], pool) == {}
        pool.release(ref.page)
        old.append(live)
    assert seen[:8] == [TAG_MAX - 4, TAG_MAX - 3, TAG_MAX - 2, TAG_MAX - 1, TAG_MAX, 1, 2, 3]
    assert 0 not in seen and len(set(seen)) == len(seen)
    pool.allocate()  # reused once more: every earlier mapping is stale
    assert set(tracker.check(old, pool)) == set(old)


def test_engine_runs_across_the_wrap(make_engine):
    eng = make_engine(kv_memory=12 << 20, enable_prefix_caching=False)
    for p in range(eng.decode_pool.num_pages):
        _set_tag(eng.decode_pool, p, TAG_MAX - 1)
    first = run_all(eng)  # pages go to 2**31 - 1, then wrap to 1 as the free list cycles
    runs = 1
    while 1 not in eng.decode_pool._tags and runs < 20:
        again = run_all(eng, prefix=f"r{runs}-")
        assert [o.token_ids for o in again.values()] == [o.token_ids for o in first.values()]
        runs += 1
    assert max(eng.decode_pool._tags) == TAG_MAX and 1 in eng.decode_pool._tags
    assert eng.integrity.counters.mismatches == 0
    eng.decode_pool.check_idle()
