"""One page layout for every mover: which tensors a page set holds, in which order, with which scales.

A page set (a pool's pages, a handoff payload, a tensor-parallel transfer, the PAGE frames of the
KV wire) holds per layer the values of each component, in the pool's component order, then the
per-token scales of the ``page_scaled`` components (``"k.scale"``: bfloat16 ``[n, page_size,
heads]``), and once per layer the static float32 ``[heads]`` scales of the ``static_scaled`` ones.
Handoff payloads (engine/handoff.py), TP scatter/gather (engine/parallel/steps.py) and the KV wire
(serving/worker/kv_transport.py) all take their tensor lists and orders from here; ``check_page_set`` is
the one rule of what a page set of a format may look like (int8: every component scaled per token).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pagoda.kernels.fp8_format import TOKEN_SCALE_DTYPE
from pagoda.node_agent.kv import formats
from pagoda.node_agent.kv.storage import component_of, is_page_scale_key, page_scale_key

Layers = list[dict[str, torch.Tensor]]


@dataclass(frozen=True)
class PageLayout:
    """The tensors of a page set, in order: per layer ``page_keys``, then per layer ``static_scaled``."""

    components: tuple[str, ...]
    page_scaled: tuple[str, ...] = ()  # components with per-token scales beside the pages
    static_scaled: tuple[str, ...] = ()  # components with static per-head scales

    @classmethod
    def of_pool(cls, pool: Any) -> PageLayout:
        """The layout of a pool's pages (a KVPagePool: its components, per-token and static scales)."""
        comps = tuple(pool.components)
        static = pool.static_scales[0] if pool.static_scales else {}
        return cls(
            comps, tuple(c for c in comps if c in pool.token_scaled), tuple(c for c in comps if c in static)
        )

    @classmethod
    def of_pages(cls, layers: Layers, scales: Layers | None) -> PageLayout:
        """The layout a page set holds, read from its first layer (values in their order, page
        scales by name, static scales from ``scales``)."""
        keys = list(layers[0]) if layers else []
        comps = tuple(k for k in keys if not is_page_scale_key(k))
        static = scales[0] if scales else {}
        return cls(
            comps,
            tuple(c for c in comps if page_scale_key(c) in keys),
            tuple(c for c in comps if c in static),
        )

    @property
    def page_keys(self) -> tuple[str, ...]:
        """One layer's tensors of a page, in order: the values, then the per-token scales."""
        return self.components + tuple(page_scale_key(c) for c in self.page_scaled)

    def layer_tensors(self, layer: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        return [layer[k] for k in self.page_keys]

    def tensors(self, layers: Layers, scales: Layers | None) -> list[torch.Tensor]:
        """Every tensor of the page set in transfer order: each layer's pages, then each layer's
        static scales."""
        out = [t for layer in layers for t in self.layer_tensors(layer)]
        return out + [s[c] for s in (scales or []) for c in self.static_scaled]

    def select(
        self, layers: Layers, scales: Layers | None, idx: torch.Tensor
    ) -> tuple[Layers, Layers | None]:
        """Pages ``idx`` of every layer (copied to the CPU) and a CPU copy of the static scales."""
        pages = [{k: layer[k][idx].cpu() for k in self.page_keys} for layer in layers]
        if not self.static_scaled:
            return pages, None
        return pages, [{c: s[c].cpu().clone() for c in self.static_scaled} for s in scales or []]

    @staticmethod
    def page_shape(key: str, page_size: int, shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
        """One page's shape of ``key``: ``[page_size, *shape]``, or ``[page_size, heads]`` for scales."""
        shape = shapes[component_of(key)]
        return (page_size, shape[0]) if is_page_scale_key(key) else (page_size, *shape)

    @staticmethod
    def key_dtype(key: str, dtype: torch.dtype) -> torch.dtype:
        """The element type of ``key`` in pages of ``dtype`` (per-token scales: bfloat16)."""
        return TOKEN_SCALE_DTYPE if is_page_scale_key(key) else dtype


def transfer_dtypes() -> tuple[torch.dtype, ...]:
    """Every element type a page set may hold (each format's wire and storage dtypes, the per-token
    and static scales), in registration order: the codes a tensor-parallel transfer carries."""
    seen: dict[torch.dtype, None] = {}
    for name in formats.names():
        fmt = formats.get(name)
        for d in (*fmt.wire_dtypes, fmt.dtype):
            if d is not None:
                seen[d] = None
    seen.update({TOKEN_SCALE_DTYPE: None, torch.float32: None})
    return tuple(seen)


class LayoutError(ValueError):
    """A page set that breaks its format's rules; ``rule`` names which (callers word it)."""

    DTYPE = "dtype"  # the pages' element type is not one of the format's wire dtypes
    UNSCALED = "unscaled"  # per-token scales beside pages of a format that has none
    EVERY = "every"  # a format that scales every component per token misses some

    def __init__(self, rule: str, fmt: formats.KVFormat) -> None:
        super().__init__(f"{rule} ({fmt.name})")
        self.rule = rule
        self.format = fmt


def check_page_set(
    kv_format: str, dtype: torch.dtype | str, components: Sequence[str], page_scaled: Iterable[str]
) -> PageLayout:
    """The layout of a page set of format ``kv_format`` (a registered name) whose pages are in
    ``dtype`` (a torch dtype or its wire name) with per-token scales for ``page_scaled``; raises
    LayoutError when the format forbids it. Components without per-token scales take static ones
    when the format has them (fp8_e4m3), none otherwise."""
    fmt = formats.get(kv_format)
    accepted = fmt.wire_names if isinstance(dtype, str) else fmt.wire_dtypes
    if dtype not in accepted:
        raise LayoutError(LayoutError.DTYPE, fmt)
    scaled = set(page_scaled)
    ps = tuple(c for c in components if c in scaled)
    if ps and fmt.token_scales == formats.NO_TOKEN_SCALES:
        raise LayoutError(LayoutError.UNSCALED, fmt)
    if fmt.token_scales == formats.EVERY_COMPONENT and scaled != set(components):
        raise LayoutError(LayoutError.EVERY, fmt)
    static = tuple(c for c in components if c not in scaled) if fmt.static_scales else ()
    return PageLayout(tuple(components), ps, static)
