"""The prefix cache's index: chained content hashes of full KV pages (salted per tenant, so
prefixes never cross tenants), the sealed pages by hash, and the evictable ones in LRU order.

Pure Python (no tensors). The allocator asks it where a released page goes (``park``) and which
cached page to reuse when no page is free (``evict``).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterator


def root_hash(salt: str) -> bytes:
    """The chain's starting value: different for every cache salt (tenant)."""
    return hashlib.blake2b(b"pagoda-prefix:" + salt.encode(), digest_size=16).digest()


def page_hashes(
    token_ids: list[int], page_size: int, salt: str = "", parent: bytes | None = None
) -> Iterator[bytes]:
    """Yield one hash per full page: H(parent hash, the page's token ids), starting at ``parent``."""
    parent = root_hash(salt) if parent is None else parent
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(",".join(map(str, token_ids[start : start + page_size])).encode())
        parent = h.digest()
        yield parent


class PrefixIndex:
    """Sealed pages by content hash (first writer wins); unreferenced sealed pages are evictable."""

    def __init__(self) -> None:
        self.page_hash: dict[int, bytes] = {}
        self.hash_page: dict[bytes, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # least recently released first

    def seal(self, page: int, content_hash: bytes) -> None:
        """Index a full page under its chained content hash (first writer wins)."""
        if content_hash in self.hash_page or page in self.page_hash:
            return
        self.hash_page[content_hash] = page
        self.page_hash[page] = content_hash

    def page_of(self, content_hash: bytes) -> int | None:
        return self.hash_page.get(content_hash)

    def park(self, page: int) -> bool:
        """A page lost its last reference: True (now evictable) if it is sealed, else False."""
        if page not in self.page_hash:
            return False
        self.evictable[page] = None
        return True

    def unpark(self, page: int) -> None:
        """A cached page is referenced again: no longer evictable."""
        self.evictable.pop(page, None)

    def evict(self) -> int | None:
        """The least recently released cached page, dropped from the index (None: none is cached)."""
        if not self.evictable:
            return None
        page, _ = self.evictable.popitem(last=False)
        self._unindex(page)
        return page

    def forget(self, page: int) -> bool:
        """Drop a page from the index; True when it was evictable (unreferenced: the caller frees it)."""
        self._unindex(page)
        if page in self.evictable:
            del self.evictable[page]
            return True
        return False

    def clear(self) -> list[int]:
        """Forget every page; returns the evictable ones (in LRU order) for the caller to free."""
        pages = list(self.evictable)
        self.evictable.clear()
        self.page_hash.clear()
        self.hash_page.clear()
        return pages

    def _unindex(self, page: int) -> None:
        h = self.page_hash.pop(page, None)
        if h is not None:
            self.hash_page.pop(h, None)
