"""The page allocator: free list, reference counts, generation tags and the tensor-parallel
allocation log. Pure Python (no tensors): the pool mirrors each new tag into its tag table.

A page is free, referenced (refcount > 0), or cached: sealed in the prefix index with no
reference, hence evictable in least-recently-released order. Every allocation bumps the page's
generation tag (1..2**31-1, wrapping to 1; 0 means never allocated).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from pagoda.node_agent.kv.prefix_index import PrefixIndex

log = logging.getLogger("pagoda.kv")

TAG_NEVER_ALLOCATED = 0
TAG_MAX = 2**31 - 1  # tags are int32 in the tag table


def next_tag(tag: int) -> int:
    """The tag after ``tag``: 1..2**31-1, wrapping to 1 and skipping the reserved 0 (the same rule
    as kernels/integrity.py's, without torch)."""
    if not 0 <= tag <= TAG_MAX:
        raise ValueError(f"tag {tag} outside [0, {TAG_MAX}]")
    return 1 if tag >= TAG_MAX else tag + 1


class OutOfPages(RuntimeError):
    """No free or evictable page is left."""


@dataclass(frozen=True)
class PageRef:
    """One block-table entry: a physical page and the generation tag it had when mapped."""

    page: int
    tag: int


class PageAllocator:
    """Free list, refcounts and tags of ``num_pages`` pages; cached pages live in ``index``."""

    def __init__(self, num_pages: int, index: PrefixIndex | None = None, name: str = "kv") -> None:
        self.name = name
        self.num_pages = num_pages
        self.index = index if index is not None else PrefixIndex()
        self.tags = [TAG_NEVER_ALLOCATED] * num_pages  # the host copy of the tag table
        self.refcount = [0] * num_pages
        self.free: deque[int] = deque(range(num_pages))
        self.allocations = 0
        # tensor parallelism: rank 0 logs each allocated page for the other ranks to mirror
        self.alloc_log: list[int] | None = None

    @property
    def num_free(self) -> int:
        """Pages obtainable right now: free plus evictable cached pages."""
        return len(self.free) + len(self.index.evictable)

    def allocate(self) -> PageRef:
        """Take a page (evicting the least recently released cached one if needed), bump its tag."""
        if self.free:
            page = self.free.popleft()
        else:
            page = self.index.evict()
            if page is None:
                raise OutOfPages(f"{self.name}: all {self.num_pages} pages are in use")
        tag = self.tags[page] = next_tag(self.tags[page])
        self.refcount[page] = 1
        self.allocations += 1
        if self.alloc_log is not None:
            self.alloc_log.append(page)
        return PageRef(page, tag)

    def bump_tags(self, pages: list[int]) -> None:
        """Another rank allocated these pages (in this order): move the tags on likewise."""
        for page in pages:
            self.tags[page] = next_tag(self.tags[page])

    def incref(self, page: int) -> None:
        """Share a page (prefix reuse); a cached unreferenced page stops being evictable."""
        if self.refcount[page] == 0:
            self.index.unpark(page)
        self.refcount[page] += 1

    def release(self, page: int) -> None:
        """Drop one reference; the last one frees the page or parks it as an evictable cache entry."""
        rc = self.refcount[page]
        if rc <= 0:
            raise RuntimeError(f"{self.name}: double free of page {page}")
        self.refcount[page] = rc - 1
        if rc == 1 and not self.index.park(page):
            self.free.append(page)

    def is_stale(self, ref: PageRef) -> bool:
        """True when ``ref``'s page was reallocated since (its tag moved on): it owns nothing."""
        if self.tags[ref.page] == ref.tag:
            return False
        log.error(
            "%s: not releasing stale reference to page %d (tag %d, now %d)",
            self.name,
            ref.page,
            ref.tag,
            self.tags[ref.page],
        )
        return True

    def lookup(self, content_hash: bytes) -> PageRef | None:
        """A cached page with this content, referenced for the caller, or None."""
        page = self.index.page_of(content_hash)
        if page is None:
            return None
        self.incref(page)
        return PageRef(page, self.tags[page])

    def uncache(self, page: int) -> None:
        """Drop a page from the prefix index; an unreferenced cached page becomes free."""
        if self.index.forget(page) and self.refcount[page] == 0:
            self.free.append(page)

    def clear_cache(self) -> None:
        """Forget every cached page (referenced ones stay mapped; unreferenced ones become free)."""
        self.free.extend(self.index.clear())

    def leaked(self) -> list[int]:
        """Pages still referenced."""
        return [p for p, rc in enumerate(self.refcount) if rc]
