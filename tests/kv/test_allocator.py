"""The page allocator and the prefix index without tensors: free list, refcounts, tag bumps and
their wrap, running out of pages, stale references and the eviction order of cached pages."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagoda.node_agent.kv.allocator import TAG_MAX, OutOfPages, PageAllocator, PageRef, next_tag
from pagoda.node_agent.kv.prefix_index import PrefixIndex


def test_allocation_takes_free_pages_in_order_and_bumps_each_tag() -> None:
    a = PageAllocator(3)
    refs = [a.allocate() for _ in range(3)]
    assert [r.page for r in refs] == [0, 1, 2] and all(r.tag == 1 for r in refs)
    assert a.refcount == [1, 1, 1] and a.num_free == 0 and a.allocations == 3
    a.release(1)
    again = a.allocate()
    assert again == PageRef(1, 2) and a.tags == [1, 2, 1]


def test_out_of_pages_and_double_free() -> None:
    a = PageAllocator(1, name="pool")
    a.allocate()
    with pytest.raises(OutOfPages, match="pool: all 1 pages are in use"):
        a.allocate()
    a.release(0)
    with pytest.raises(RuntimeError, match="double free of page 0"):
        a.release(0)


def test_refcounts_share_a_page_until_the_last_release() -> None:
    a = PageAllocator(2)
    ref = a.allocate()
    a.incref(ref.page)
    a.release(ref.page)
    assert a.refcount[ref.page] == 1 and ref.page not in a.free
    a.release(ref.page)
    assert a.refcount[ref.page] == 0 and list(a.free) == [1, 0] and not a.leaked()


def test_tags_wrap_to_one_skipping_zero_and_agree_with_the_kernel_rule() -> None:
    assert next_tag(0) == 1 and next_tag(5) == 6 and next_tag(TAG_MAX) == 1
    with pytest.raises(ValueError):
        next_tag(-1)
    with pytest.raises(ValueError):
        next_tag(TAG_MAX + 1)
    import torch

    from pagoda.kernels import integrity

    assert integrity.TAG_MAX == TAG_MAX
    for tag in (0, 1, 2, 1000, TAG_MAX - 1, TAG_MAX):
        assert next_tag(tag) == integrity.next_tag(tag)
    tags = torch.tensor([0, 7, TAG_MAX - 1, TAG_MAX], dtype=torch.int32)
    assert integrity.next_tags(tags).tolist() == [next_tag(int(t)) for t in tags]
    a = PageAllocator(1)
    a.tags[0] = TAG_MAX
    assert a.allocate() == PageRef(0, 1)


def test_stale_references_own_nothing() -> None:
    a = PageAllocator(1)
    old = a.allocate()
    a.release(old.page)
    new = a.allocate()
    assert a.is_stale(old) and not a.is_stale(new)


def test_bump_tags_mirrors_another_ranks_allocations_and_the_log_records_them() -> None:
    rank0, rank1 = PageAllocator(3), PageAllocator(3)
    rank0.alloc_log = []
    for _ in range(2):
        rank0.allocate()
    rank0.release(0)
    rank0.allocate()  # page 2, then page 0 again
    rank0.allocate()
    rank1.bump_tags(rank0.alloc_log)
    assert rank0.alloc_log == [0, 1, 2, 0] and rank1.tags == rank0.tags == [2, 1, 1]
    assert rank1.allocations == 0  # mirroring is not allocating


def test_cached_pages_are_evicted_least_recently_released_first() -> None:
    index = PrefixIndex()
    a = PageAllocator(3, index)
    refs = [a.allocate() for _ in range(3)]
    for r, h in zip(refs, (b"a", b"b", b"c"), strict=True):
        index.seal(r.page, h)
    for page in (2, 0, 1):  # released in this order: evicted in this order
        a.release(page)
    assert a.num_free == 3 and not a.free and list(index.evictable) == [2, 0, 1]
    hit = a.lookup(b"a")  # page 0 is referenced again: no longer evictable
    assert hit == PageRef(0, 1) and list(index.evictable) == [2, 1]
    first, second = a.allocate(), a.allocate()
    assert (first.page, second.page) == (2, 1) and first.tag == 2
    assert index.page_of(b"c") is None and index.page_of(b"b") is None and index.page_of(b"a") == 0
    with pytest.raises(OutOfPages):
        a.allocate()


def test_uncache_and_clear_free_unreferenced_cached_pages() -> None:
    index = PrefixIndex()
    a = PageAllocator(3, index)
    refs = [a.allocate() for _ in range(3)]
    for r in refs:
        index.seal(r.page, bytes([r.page]))
    index.seal(refs[0].page, b"other")  # first writer wins
    assert index.page_of(b"other") is None
    a.release(0)
    a.release(1)
    a.uncache(0)  # cached and unreferenced: free now
    a.uncache(2)  # referenced: stays mapped, only leaves the index
    assert list(a.free) == [0] and list(index.evictable) == [1] and 2 not in index.page_hash
    a.clear_cache()
    assert list(a.free) == [0, 1] and not index.page_hash and not index.hash_page
    assert a.leaked() == [2]


def test_the_allocator_and_the_prefix_index_import_no_torch() -> None:
    code = (
        "import sys; import pagoda.node_agent.kv.allocator, pagoda.node_agent.kv.prefix_index; "
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    proc = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr or "torch was imported"
