"""Checksums of whole KV pages (every layer, every component) for ``integrity=audit``.

A valid generation tag proves a page was not reallocated; it cannot prove the bytes were not
overwritten. Audit mode records a checksum of each sealed (full, immutable) page and verifies it
when the page is reused from the prefix cache or arrives in a handoff payload.

The checksum is an error-detecting code, not a cryptographic hash: each page's bytes are read as
64-bit words, multiplied by odd position weights and summed modulo 2**64, per layer and component,
and the sums are chained. Any change of a single word, and any swap of two distinct words except in
contrived cases, changes it; it runs as a few vectorized torch ops on the pool's device.
"""

from __future__ import annotations

import torch
from torch import Tensor

_MIX = 1_000_003
_weights: dict[tuple[int, torch.device], Tensor] = {}


def _words(pages: Tensor) -> Tensor:
    """[n, ...] page contents -> [n, W] int64 words (bytes padded with zeros to whole words)."""
    raw = pages.contiguous().view(torch.uint8).reshape(pages.shape[0], -1)
    pad = -raw.shape[1] % 8
    if pad:
        raw = torch.nn.functional.pad(raw, (0, pad))
    return raw.view(torch.int64)


def _odd_weights(n: int, device: torch.device) -> Tensor:
    w = _weights.get((n, device))
    if w is None:
        w = torch.arange(n, dtype=torch.int64, device=device) * 2 + 1
        _weights[(n, device)] = w
    return w


def page_checksums(layers: list[dict[str, Tensor]], index: Tensor | list[int]) -> list[int]:
    """Checksum of pages ``index`` (page rows of every ``layers[l][component]`` tensor)."""
    if not layers:
        return []
    first = next(iter(layers[0].values()))
    idx = torch.as_tensor(index, dtype=torch.long, device=first.device)
    acc = torch.zeros(idx.numel(), dtype=torch.int64, device=first.device)
    for layer in layers:
        for name in sorted(layer):
            words = _words(layer[name].index_select(0, idx))
            acc = acc * _MIX + (words * _odd_weights(words.shape[1], words.device)).sum(dim=1)
    return acc.tolist()


def pool_page_checksums(pool, pages: list[int]) -> list[int]:
    """Checksums of the given pages of a KVPagePool."""
    return page_checksums(pool.layers, pages) if pages else []


def payload_checksums(layers: list[dict[str, Tensor]]) -> list[int]:
    """Checksums of every page of a handoff payload (``layers[l][c]`` is [num_pages, ...])."""
    if not layers:
        return []
    n = next(iter(layers[0].values())).shape[0]
    return page_checksums(layers, list(range(n)))
