"""The paged KV cache: one preallocated tensor per layer and component, a free list, reference
counts, per-page generation tags, and the prefix-cache index of sealed pages.

A page holds ``page_size`` tokens. What one token stores is generic: ``components`` maps a name to
a per-token shape, ``{"k": (Hkv, D), "v": (Hkv, D)}`` for GQA models, ``{"latent": (1, R),
"rope_k": (1, Dr)}`` for multi-head latent attention (DeepSeek-V3). FP8 pools keep, per layer and
component, either a static float32 scale per head or (the ``token_scaled`` components) a bfloat16
scale per token and head stored beside the pages: ``layers[l]["k.scale"]`` ``[num_pages,
page_size, heads]``, part of the page like its values, so it moves, hands off and is checksummed
with it. INT8 pools scale every component that way. Every allocation bumps the page's generation
tag; block tables keep ``(page, expected_tag)`` so a stale mapping is detectable before a read.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from dataclasses import dataclass

import torch

from pagoda.kernels.fp8_format import TOKEN_SCALE_DTYPE
from pagoda.kernels.integrity import next_tag
from pagoda.kernels.paged_attention import SCALED_DTYPES, empty_page_scales
from pagoda.vocabulary import KV_CACHE_FORMATS

log = logging.getLogger("pagoda.kv")

# element dtype per KV format name (None: the compute dtype); fp32 only for calibration scratch pools
KV_FORMATS = {"bf16": None, "fp32": torch.float32, "fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8}
TAG_BYTES = 4  # int32 generation tag per page
PAGE_SCALE_SUFFIX = ".scale"  # layers[l][component + suffix]: per-token scales beside the pages
TOKEN_SCALE_BYTES = torch.empty((), dtype=TOKEN_SCALE_DTYPE).element_size()


def page_scale_key(component: str) -> str:
    """The layer-dict key of a component's per-token page scales."""
    return component + PAGE_SCALE_SUFFIX


def is_page_scale_key(key: str) -> bool:
    return key.endswith(PAGE_SCALE_SUFFIX)


class OutOfPages(RuntimeError):
    """No free or evictable page is left."""


@dataclass(frozen=True)
class PageRef:
    """One block-table entry: a physical page and the generation tag it had when mapped."""

    page: int
    tag: int


def storage_dtype(kv_format: str, compute_dtype: torch.dtype) -> torch.dtype:
    """Element dtype of the pages for a KV format name ("bf16" follows the compute dtype)."""
    if kv_format not in KV_FORMATS:
        raise ValueError(f"unknown KV cache format {kv_format!r}; accepted: {', '.join(KV_CACHE_FORMATS)}")
    dt = KV_FORMATS[kv_format]
    return compute_dtype if dt is None else dt


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
        if not set(token_scaled) <= set(components):
            raise ValueError(f"token_scaled {token_scaled} names no component of {sorted(components)}")
        if dtype == torch.int8 and set(token_scaled) != set(components):
            raise ValueError(f"int8 pages scale every component per token, got token_scaled {token_scaled}")
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
        self.layers: list[dict[str, torch.Tensor]] = [
            {
                c: torch.zeros((num_pages, page_size, *shape), dtype=dtype, device=self.device)
                for c, shape in components.items()
            }
            for _ in range(num_layers)
        ]
        # FP8 pages dequantize with static scales per layer and head, set by calibration, or (the
        # token_scaled components; every component of int8 pages) with per-token scales written
        # beside the pages with the values.
        self.token_scaled = tuple(token_scaled) if dtype in SCALED_DTYPES else ()
        for layer in self.layers:
            for c in self.token_scaled:
                layer[page_scale_key(c)] = empty_page_scales(
                    num_pages, page_size, components[c][0], self.device
                )
        # static_scales: the calibrated ones only; scales: what the model reads, static or per page
        self.static_scales: list[dict[str, torch.Tensor]] | None = None
        self.scales: list[dict[str, torch.Tensor]] | None = None
        if dtype in SCALED_DTYPES:
            self.static_scales = [
                {
                    c: torch.ones(shape[0], dtype=torch.float32, device=self.device)
                    for c, shape in components.items()
                    if c not in self.token_scaled
                }
                for _ in range(num_layers)
            ]
            self.scales = [
                {c: static.get(c, layer.get(page_scale_key(c))) for c in components}
                for static, layer in zip(self.static_scales, self.layers, strict=True)
            ]
        self.tag_table = torch.zeros(num_pages, dtype=torch.int32, device=self.device)
        self._tags = [0] * num_pages  # host mirror; 0 = never allocated
        self.refcount = [0] * num_pages
        self.free: deque[int] = deque(range(num_pages))
        # prefix cache: sealed pages by content hash; unreferenced ones are evictable in LRU order
        self.page_hash: dict[int, bytes] = {}
        self.hash_page: dict[bytes, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.allocations = 0
        # tensor parallelism: rank 0 logs each allocated page for the other ranks to mirror
        self.alloc_log: list[int] | None = None

    # ------------------------------------------------------------------ sizing

    @staticmethod
    def bytes_per_page(
        num_layers: int,
        page_size: int,
        components: dict[str, tuple[int, ...]],
        dtype: torch.dtype,
        token_scaled: tuple[str, ...] = (),
    ) -> int:
        """Bytes one page costs across all layers: values, per-token scales and its tag."""
        elem = torch.empty((), dtype=dtype).element_size()
        per_token = sum(int(torch.Size(s).numel()) for s in components.values()) * elem
        if dtype in SCALED_DTYPES:
            per_token += sum(components[c][0] for c in token_scaled) * TOKEN_SCALE_BYTES
        return num_layers * page_size * per_token + TAG_BYTES

    @classmethod
    def pages_for_budget(
        cls,
        budget_bytes: int,
        num_layers: int,
        page_size: int,
        components: dict[str, tuple[int, ...]],
        dtype: torch.dtype,
        token_scaled: tuple[str, ...] = (),
    ) -> int:
        """How many pages fit a byte budget, scales (static per layer and head, or per token) included."""
        scale_bytes = 0
        if dtype in SCALED_DTYPES:
            static = [s for c, s in components.items() if c not in token_scaled]
            scale_bytes = num_layers * sum(s[0] for s in static) * 4
        per_page = cls.bytes_per_page(num_layers, page_size, components, dtype, token_scaled)
        return max(0, (budget_bytes - scale_bytes) // per_page)

    # ------------------------------------------------------------------ what a model reads

    def layer_cache(self, layer: int) -> dict[str, torch.Tensor]:
        """The page tensors of one layer, by component ([num_pages, page_size, *shape] each; page
        scales under ``page_scale_key(component)``)."""
        return self.layers[layer]

    def layer_scales(self, layer: int) -> dict[str, torch.Tensor]:
        """FP8 dequantization scales of one layer by component: static [heads] float32, or the
        per-token page scales [num_pages, page_size, heads] ({} for unscaled pages)."""
        return self.scales[layer] if self.scales is not None else {}

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def total_bytes(self) -> int:
        data = sum(t.numel() * t.element_size() for layer in self.layers for t in layer.values())
        scales = sum(t.numel() * 4 for layer in (self.static_scales or []) for t in layer.values())
        return data + scales + self.tag_table.numel() * TAG_BYTES

    @property
    def num_free(self) -> int:
        """Pages obtainable right now: free plus evictable cached pages."""
        return len(self.free) + len(self.evictable)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    # ------------------------------------------------------------------ allocation

    def allocate(self) -> PageRef:
        """Take a page (evicting the least recently used cached one if needed) and bump its tag."""
        if self.free:
            page = self.free.popleft()
        elif self.evictable:
            page, _ = self.evictable.popitem(last=False)
            self._unindex(page)
        else:
            raise OutOfPages(f"{self.name}: all {self.num_pages} pages are in use")
        tag = next_tag(self._tags[page])
        self._tags[page] = tag
        self.tag_table[page] = tag
        self.refcount[page] = 1
        self.allocations += 1
        if self.alloc_log is not None:
            self.alloc_log.append(page)
        return PageRef(page, tag)

    def bump_tags(self, pages: list[int]) -> None:
        """Another rank allocated these pages (in this order): move this rank's tags on likewise."""
        for page in pages:
            tag = next_tag(self._tags[page])
            self._tags[page] = tag
            self.tag_table[page] = tag

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
        if self.refcount[page] == 0:
            self.evictable.pop(page, None)
        self.refcount[page] += 1

    def release(self, page: int) -> None:
        """Drop one reference; the last one frees the page or parks it as an evictable cache entry."""
        rc = self.refcount[page]
        if rc <= 0:
            raise RuntimeError(f"{self.name}: double free of page {page}")
        self.refcount[page] = rc - 1
        if rc == 1:
            if page in self.page_hash:
                self.evictable[page] = None
            else:
                self.free.append(page)

    def release_all(self, refs: list[PageRef]) -> None:
        """Drop the references; a stale one (its page since reallocated) owns nothing and is skipped."""
        for ref in refs:
            if self._tags[ref.page] != ref.tag:
                log.error(
                    "%s: not releasing stale reference to page %d (tag %d, now %d)",
                    self.name,
                    ref.page,
                    ref.tag,
                    self._tags[ref.page],
                )
                continue
            self.release(ref.page)

    def current_tag(self, page: int) -> int:
        return self._tags[page]

    # ------------------------------------------------------------------ prefix index

    def seal(self, page: int, content_hash: bytes) -> None:
        """Index a full page under its chained content hash (first writer wins)."""
        if content_hash in self.hash_page or page in self.page_hash:
            return
        self.hash_page[content_hash] = page
        self.page_hash[page] = content_hash

    def lookup(self, content_hash: bytes) -> PageRef | None:
        """A cached page with this content, referenced for the caller, or None."""
        page = self.hash_page.get(content_hash)
        if page is None:
            return None
        self.incref(page)
        return PageRef(page, self._tags[page])

    def uncache(self, page: int) -> None:
        """Drop a page from the prefix index (e.g. its bytes failed an audit); free it if unreferenced."""
        self._unindex(page)
        if self.refcount[page] == 0 and page in self.evictable:
            del self.evictable[page]
            self.free.append(page)

    def _unindex(self, page: int) -> None:
        h = self.page_hash.pop(page, None)
        if h is not None:
            self.hash_page.pop(h, None)

    def clear_prefix_cache(self) -> None:
        """Forget every cached page (referenced ones stay mapped; unreferenced ones become free)."""
        for page in list(self.evictable):
            self.free.append(page)
        self.evictable.clear()
        self.page_hash.clear()
        self.hash_page.clear()

    def check_idle(self) -> None:
        """Assert every page is unreferenced (used by tests and after drains)."""
        leaked = [p for p, rc in enumerate(self.refcount) if rc]
        if leaked:
            raise AssertionError(f"{self.name}: pages still referenced: {leaked[:8]}")
        assert self.num_free == self.num_pages
