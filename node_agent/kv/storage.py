"""Page storage: one preallocated tensor per layer and component, the per-token page scales beside
them, the static per-head scales, and the tag table. It is what a model reads (models' ``PagedKV``).

What one token stores is generic: ``components`` maps a name to a per-token shape, ``{"k": (Hkv,
D), "v": (Hkv, D)}`` for GQA models, ``{"latent": (1, R), "rope_k": (1, Dr)}`` for multi-head latent
attention (DeepSeek-V3). The components the format scales per token (``token_scaled``) keep a
bfloat16 scale per token and head beside the pages, ``layers[l]["k.scale"]`` ``[num_pages,
page_size, heads]``, part of the page like its values, so it moves, hands off and is checksummed
with it; the other components of a statically scaled format keep a float32 scale per layer and head.
"""

from __future__ import annotations

import torch

from pagoda.kernels.paged_attention import empty_page_scales
from pagoda.node_agent.kv.formats import (
    NO_TOKEN_SCALES,
    STATIC_SCALE_BYTES,
    TOKEN_SCALE_BYTES,
    KVFormat,
    for_pages,
)

TAG_BYTES = 4  # int32 generation tag per page
PAGE_SCALE_SUFFIX = ".scale"  # layers[l][component + suffix]: per-token scales beside the pages


def page_scale_key(component: str) -> str:
    """The layer-dict key of a component's per-token page scales."""
    return component + PAGE_SCALE_SUFFIX


def is_page_scale_key(key: str) -> bool:
    return key.endswith(PAGE_SCALE_SUFFIX)


def component_of(key: str) -> str:
    """The component a layer-dict key belongs to (``"k.scale"`` -> ``"k"``)."""
    return key.removesuffix(PAGE_SCALE_SUFFIX)


class PageStorage:
    """The tensors of ``num_pages`` pages for every layer, in one format."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        components: dict[str, tuple[int, ...]],
        dtype: torch.dtype,
        device: torch.device,
        fmt: KVFormat,
        token_scaled: tuple[str, ...],
    ) -> None:
        self.format = fmt
        self.token_scaled = tuple(token_scaled) if fmt.token_scales != NO_TOKEN_SCALES else ()
        self.layers: list[dict[str, torch.Tensor]] = [
            {
                c: torch.zeros((num_pages, page_size, *s), dtype=dtype, device=device)
                for c, s in components.items()
            }
            for _ in range(num_layers)
        ]
        for layer in self.layers:
            for c in self.token_scaled:
                layer[page_scale_key(c)] = empty_page_scales(num_pages, page_size, components[c][0], device)
        # static_scales: the calibrated ones only; scales: what the model reads, static or per page
        self.static_scales: list[dict[str, torch.Tensor]] | None = None
        self.scales: list[dict[str, torch.Tensor]] | None = None
        if fmt.scaled:
            self.static_scales = [
                {
                    c: torch.ones(s[0], dtype=torch.float32, device=device)
                    for c, s in components.items()
                    if fmt.static_scales and c not in self.token_scaled
                }
                for _ in range(num_layers)
            ]
            self.scales = [
                {c: static.get(c, layer.get(page_scale_key(c))) for c in components}
                for static, layer in zip(self.static_scales, self.layers, strict=True)
            ]
        self.tag_table = torch.zeros(num_pages, dtype=torch.int32, device=device)

    def layer_cache(self, layer: int) -> dict[str, torch.Tensor]:
        """The page tensors of one layer, by component ([num_pages, page_size, *shape] each; page
        scales under ``page_scale_key(component)``)."""
        return self.layers[layer]

    def layer_scales(self, layer: int) -> dict[str, torch.Tensor]:
        """Dequantization scales of one layer by component: static [heads] float32, or the
        per-token page scales [num_pages, page_size, heads] ({} for unscaled pages)."""
        return self.scales[layer] if self.scales is not None else {}

    def set_tag(self, page: int, tag: int) -> None:
        self.tag_table[page] = tag

    @property
    def total_bytes(self) -> int:
        data = sum(t.numel() * t.element_size() for layer in self.layers for t in layer.values())
        scales = sum(
            t.numel() * STATIC_SCALE_BYTES for layer in (self.static_scales or []) for t in layer.values()
        )
        return data + scales + self.tag_table.numel() * TAG_BYTES


def bytes_per_page(
    num_layers: int,
    page_size: int,
    components: dict[str, tuple[int, ...]],
    dtype: torch.dtype,
    token_scaled: tuple[str, ...] = (),
    kv_format: str = "bf16",
) -> int:
    """Bytes one page costs across all layers: values, per-token scales and its tag."""
    elem = torch.empty((), dtype=dtype).element_size()
    per_token = sum(int(torch.Size(s).numel()) for s in components.values()) * elem
    if for_pages(kv_format, dtype).token_scales != NO_TOKEN_SCALES:
        per_token += sum(components[c][0] for c in token_scaled) * TOKEN_SCALE_BYTES
    return num_layers * page_size * per_token + TAG_BYTES


def static_scale_bytes(
    num_layers: int,
    components: dict[str, tuple[int, ...]],
    dtype: torch.dtype,
    token_scaled: tuple[str, ...],
    kv_format: str = "bf16",
) -> int:
    """Bytes of the static per-head scales a pool of ``dtype`` pages keeps (once, not per page)."""
    if not for_pages(kv_format, dtype).static_scales:
        return 0
    return num_layers * sum(s[0] for c, s in components.items() if c not in token_scaled) * STATIC_SCALE_BYTES
