"""The paged KV cache behind one facade: page storage (storage.py), the page allocator with its
free list, refcounts and generation tags (allocator.py) and the prefix-cache index (prefix_index.py).

A page holds ``page_size`` tokens; what one token stores is generic (``components``, see
storage.py). The pool's KV format (formats.py) decides which components carry per-token scales
and which take static ones. Every allocation bumps the page's generation tag; block tables keep
``(page, expected_tag)`` so a stale mapping is detectable before a read.
"""

from __future__ import annotations

from collections import OrderedDict, deque

import torch

from pagoda.node_agent.kv import formats
from pagoda.node_agent.kv.allocator import OutOfPages, PageAllocator, PageRef
from pagoda.node_agent.kv.prefix_index import PrefixIndex
from pagoda.node_agent.kv.storage import (
    TAG_BYTES,
    PageStorage,
    bytes_per_page,
    is_page_scale_key,
    page_scale_key,
    static_scale_bytes,
)

__all__ = [
    "TAG_BYTES",
    "KVPagePool",
    "OutOfPages",
    "PageRef",
    "is_page_scale_key",
    "page_scale_key",
    "storage_dtype",
]


def storage_dtype(kv_format: str, compute_dtype: torch.dtype) -> torch.dtype:
    """Element dtype of the pages for a KV format name ("bf16" follows the compute dtype)."""
    return formats.get(kv_format).storage_dtype(compute_dtype)


class KVPagePool:
    """Fixed-size pages of KV for every layer, with tags, refcounts and a prefix index."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        components: dict[str, tuple[int, ...]],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        kv_format: str = "bf16",
        name: str = "kv",
        token_scaled: tuple[str, ...] = (),
    ) -> None:
        if num_pages < 1:
            raise ValueError("the KV budget holds no page; raise the KV memory budget")
        self.format = formats.for_pages(kv_format, dtype)  # the rules these pages follow
        self.format.check_token_scaled(components, tuple(token_scaled))
        self.name = name
        self.kv_format = kv_format
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.components = dict(components)
        # what one token stores in the whole replica (a tensor-parallel rank holds some heads of it):
        # the shapes a handoff payload carries
        self.replica_components = dict(components)
        self.dtype = dtype
        self.device = torch.device(device)
        self.storage = PageStorage(
            num_layers, num_pages, page_size, components, dtype, self.device, self.format, tuple(token_scaled)
        )
        self.index = PrefixIndex()
        self.allocator = PageAllocator(num_pages, self.index, name)

    # ------------------------------------------------------------------ storage

    @property
    def layers(self) -> list[dict[str, torch.Tensor]]:
        return self.storage.layers

    @property
    def token_scaled(self) -> tuple[str, ...]:
        return self.storage.token_scaled

    @property
    def static_scales(self) -> list[dict[str, torch.Tensor]] | None:
        return self.storage.static_scales

    @property
    def scales(self) -> list[dict[str, torch.Tensor]] | None:
        return self.storage.scales

    @property
    def tag_table(self) -> torch.Tensor:
        return self.storage.tag_table

    def layer_cache(self, layer: int) -> dict[str, torch.Tensor]:
        """The page tensors of one layer, by component (page scales under ``page_scale_key``)."""
        return self.storage.layer_cache(layer)

    def layer_scales(self, layer: int) -> dict[str, torch.Tensor]:
        """Dequantization scales of one layer by component ({} for unscaled pages)."""
        return self.storage.layer_scales(layer)

    @property
    def total_bytes(self) -> int:
        return self.storage.total_bytes

    # ------------------------------------------------------------------ sizing

    @staticmethod
    def bytes_per_page(
        num_layers: int,
        page_size: int,
        components: dict[str, tuple[int, ...]],
        dtype: torch.dtype,
        token_scaled: tuple[str, ...] = (),
        kv_format: str = "bf16",
    ) -> int:
        """Bytes one page costs across all layers: values, per-token scales and its tag."""
        return bytes_per_page(num_layers, page_size, components, dtype, token_scaled, kv_format)

    @staticmethod
    def pages_for_budget(
        budget_bytes: int,
        num_layers: int,
        page_size: int,
        components: dict[str, tuple[int, ...]],
        dtype: torch.dtype,
        token_scaled: tuple[str, ...] = (),
        kv_format: str = "bf16",
    ) -> int:
        """How many pages fit a byte budget, scales (static per layer and head, or per token) included."""
        fixed = static_scale_bytes(num_layers, components, dtype, token_scaled, kv_format)
        per_page = bytes_per_page(num_layers, page_size, components, dtype, token_scaled, kv_format)
        return max(0, (budget_bytes - fixed) // per_page)

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    # ------------------------------------------------------------------ allocator

    @property
    def free(self) -> deque[int]:
        return self.allocator.free

    @property
    def refcount(self) -> list[int]:
        return self.allocator.refcount

    @property
    def _tags(self) -> list[int]:
        return self.allocator.tags

    @property
    def allocations(self) -> int:
        return self.allocator.allocations

    @property
    def alloc_log(self) -> list[int] | None:
        return self.allocator.alloc_log

    @alloc_log.setter
    def alloc_log(self, log: list[int] | None) -> None:
        self.allocator.alloc_log = log

    @property
    def num_free(self) -> int:
        """Pages obtainable right now: free plus evictable cached pages."""
        return self.allocator.num_free

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    def allocate(self) -> PageRef:
        """Take a page (evicting the least recently used cached one if needed) and bump its tag."""
        ref = self.allocator.allocate()
        self.storage.set_tag(ref.page, ref.tag)
        return ref

    def bump_tags(self, pages: list[int]) -> None:
        """Another rank allocated these pages (in this order): move this rank's tags on likewise."""
        self.allocator.bump_tags(pages)
        for page in pages:
            self.storage.set_tag(page, self.allocator.tags[page])

    def allocate_pages(self, n: int) -> list[PageRef]:
        """``n`` fresh pages, all or none (raises OutOfPages and keeps nothing)."""
        refs: list[PageRef] = []
        try:
            for _ in range(n):
                refs.append(self.allocate())
        except OutOfPages:
            self.release_all(refs)
            raise
        return refs

    def incref(self, page: int) -> None:
        """Share a page (prefix reuse); a cached unreferenced page leaves the evictable set."""
        self.allocator.incref(page)

    def release(self, page: int) -> None:
        """Drop one reference; the last one frees the page or parks it as an evictable cache entry."""
        self.allocator.release(page)

    def release_all(self, refs: list[PageRef]) -> None:
        """Drop the references; a stale one (its page since reallocated) owns nothing and is skipped."""
        for ref in refs:
            if not self.allocator.is_stale(ref):
                self.allocator.release(ref.page)

    def current_tag(self, page: int) -> int:
        return self.allocator.tags[page]

    # ------------------------------------------------------------------ prefix index

    @property
    def page_hash(self) -> dict[int, bytes]:
        return self.index.page_hash

    @property
    def hash_page(self) -> dict[bytes, int]:
        return self.index.hash_page

    @property
    def evictable(self) -> OrderedDict[int, None]:
        return self.index.evictable

    def seal(self, page: int, content_hash: bytes) -> None:
        """Index a full page under its chained content hash (first writer wins)."""
        self.index.seal(page, content_hash)

    def lookup(self, content_hash: bytes) -> PageRef | None:
        """A cached page with this content, referenced for the caller, or None."""
        return self.allocator.lookup(content_hash)

    def uncache(self, page: int) -> None:
        """Drop a page from the prefix index (e.g. its bytes failed an audit); free it if unreferenced."""
        self.allocator.uncache(page)

    def clear_prefix_cache(self) -> None:
        """Forget every cached page (referenced ones stay mapped; unreferenced ones become free)."""
        self.allocator.clear_cache()

    def check_idle(self) -> None:
        """Assert every page is unreferenced (used by tests and after drains)."""
        leaked = self.allocator.leaked()
        if leaked:
            raise AssertionError(f"{self.name}: pages still referenced: {leaked[:8]}")
        assert self.num_free == self.num_pages
