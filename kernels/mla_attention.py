"""Multi-head latent attention (DeepSeek-V3 MLA) over paged latent caches, in the absorbed form.

Per token and layer the cache holds one shared "head": the compressed latent ``c`` [R] (after
kv_a_layernorm) in ``latent_cache`` [num_pages, page_size, 1, R] and the rope key ``k_r`` [Dr]
(after RoPE) in ``rope_cache`` [num_pages, page_size, 1, Dr], float32 / bfloat16 / float8_e4m3fn
(FP8 with a static float32 scale ``[1]`` per cache) / int8 (per-token page scales
``[num_pages, page_size, 1]``, as ``paged_attention``'s). The caller folds W_UK into the query
(``q_lat = q_nope @ W_UK`` per head) so that

    score(h, j) = scale * (q_lat[h] . c_j + q_rope[h] . k_r_j)
    out[h]      = sum_j softmax(score)[h, j] * c_j           (latent space, [R])

and applies W_UV to ``out`` afterwards: the latent is never decompressed per step. Writes use
``paged_attention.write_kv`` (each cache is a one-head page tensor).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .dispatch import resolve
from .fp8_format import raw_bytes
from .paged_attention import _check_cache, _decode, _gather_seq, is_page_scale


def _attend(q_lat: Tensor, q_rope: Tensor, c: Tensor, kr: Tensor, scale: float, offset: int) -> Tensor:
    """q [Tq, H, *] float32 over c [L, R], kr [L, Dr]; query i sees keys j <= offset + i."""
    scores = (torch.einsum("qhr,kr->hqk", q_lat, c) + torch.einsum("qhd,kd->hqk", q_rope, kr)) * scale
    rows = torch.arange(q_lat.shape[0], device=q_lat.device)[:, None] + offset
    scores = scores.masked_fill(torch.arange(c.shape[0], device=c.device)[None, :] > rows, float("-inf"))
    return torch.einsum("hqk,kr->qhr", scores.softmax(dim=-1), c)


def paged_mla_attention(
    q_lat: Tensor,
    q_rope: Tensor,
    latent_cache: Tensor,
    rope_cache: Tensor,
    block_tables: Tensor,
    cu_q_lens: Tensor,
    context_lens: Tensor,
    scale: float,
    latent_scale: Tensor | None = None,
    rope_scale: Tensor | None = None,
    backend: str | None = None,
) -> Tensor:
    """Ragged causal MLA: ``q_lat [T, H, R]``, ``q_rope [T, H, Dr]`` -> ``[T, H, R]`` in q_lat's dtype.

    Query i of sequence b sits at position ``context_lens[b] - q_len_b + i`` (its own latent is
    already written) and sees the positions <= its own: chunked prefill, cached prefixes and
    decode (one query per sequence) alike. Softmax in float32; empty sequences give zeros.
    Backends: ``reference`` loops over the sequences; ``cpu`` (any other on any device) runs a step
    whose queries are one per sequence as one batched masked softmax, and loops otherwise."""
    _check_cache(latent_cache, latent_scale, "latent_cache")
    _check_cache(rope_cache, rope_scale, "rope_cache")
    if (
        latent_cache.shape[2] != 1
        or rope_cache.shape[2] != 1
        or latent_cache.shape[:2] != rope_cache.shape[:2]
    ):
        raise ValueError(
            f"MLA caches must be one-head pages of equal geometry, got {tuple(latent_cache.shape)} "
            f"and {tuple(rope_cache.shape)}"
        )
    t, h, r = q_lat.shape
    if r != latent_cache.shape[3] or tuple(q_rope.shape) != (t, h, rope_cache.shape[3]):
        raise ValueError(
            f"query shapes {tuple(q_lat.shape)} / {tuple(q_rope.shape)} do not match the caches' "
            f"latent {latent_cache.shape[3]} / rope {rope_cache.shape[3]} dims"
        )
    be = resolve("paged_mla_attention", q_lat.device, backend, supports=("cpu", "reference"))
    if be == "cpu" and t == context_lens.numel() and t and bool((cu_q_lens.diff() == 1).all()):
        return _decode_batched(
            q_lat,
            q_rope,
            latent_cache,
            rope_cache,
            block_tables,
            context_lens,
            scale,
            latent_scale,
            rope_scale,
        )
    out = torch.zeros(q_lat.shape, dtype=torch.float32, device=q_lat.device)
    page_size = latent_cache.shape[1]
    cu = cu_q_lens.tolist()
    for b, length in enumerate(context_lens.tolist()):
        start, end = cu[b], cu[b + 1]
        if end == start or length == 0:
            continue
        if end - start > length:
            raise ValueError(f"sequence {b}: {end - start} queries but only {length} tokens in the cache")
        pages = block_tables[b, : math.ceil(length / page_size)]
        c = _gather_seq(latent_cache, pages, length, latent_scale)[:, 0]
        kr = _gather_seq(rope_cache, pages, length, rope_scale)[:, 0]
        out[start:end] = _attend(
            q_lat[start:end].float(), q_rope[start:end].float(), c, kr, scale, length - (end - start)
        )
    return out.to(q_lat.dtype)


# Per chunk of sequences the gathered pages stay below this many bytes (as paged_attention's decode).
_CHUNK_BYTES = 1 << 20


def _gather_pages(cache: Tensor, pages: Tensor, scale: Tensor | None) -> Tensor:
    """Whole pages -> float32 (through a byte view: fp8 lacks some indexing ops on the CPU); page
    scales are gathered with their pages."""
    if is_page_scale(scale):
        scale = scale.index_select(0, pages)
    return _decode(raw_bytes(cache).index_select(0, pages).view(cache.dtype), scale)


def _decode_batched(q_lat, q_rope, latent_cache, rope_cache, tables, lens, scale, ls, rs) -> Tensor:
    """One query per sequence: gather every sequence's pages at once (chunks of sequences), mask
    the positions past each length, float32 softmax."""
    bsz, h, r = q_lat.shape
    page_size = latent_cache.shape[1]
    lens = lens.to(q_lat.device).long()
    max_len = int(lens.max())
    if max_len == 0:
        return torch.zeros_like(q_lat)
    n_pages = math.ceil(max_len / page_size)
    span = n_pages * page_size
    chunk = max(1, _CHUNK_BYTES // (span * (r + rope_cache.shape[3]) * 4))
    out = torch.empty(bsz, h, r, dtype=q_lat.dtype, device=q_lat.device)
    for b0 in range(0, bsz, chunk):
        b1 = min(bsz, b0 + chunk)
        flat = tables[b0:b1, :n_pages].reshape(-1).long()
        c = _gather_pages(latent_cache, flat, ls).view(b1 - b0, span, r)
        kr = _gather_pages(rope_cache, flat, rs).view(b1 - b0, span, -1)
        scores = torch.einsum("bhr,bkr->bhk", q_lat[b0:b1].float(), c)
        scores += torch.einsum("bhd,bkd->bhk", q_rope[b0:b1].float(), kr)
        scores *= scale
        valid = torch.arange(span, device=q_lat.device)[None, :] < lens[b0:b1, None]
        scores.masked_fill_(~valid[:, None, :], float("-inf"))
        probs = scores.softmax(dim=-1).nan_to_num_(0.0)  # empty sequences -> zeros
        out[b0:b1] = torch.einsum("bhk,bkr->bhr", probs, c).to(q_lat.dtype)
    return out


def paged_mla_decode_attention(
    q_lat: Tensor,
    q_rope: Tensor,
    latent_cache: Tensor,
    rope_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    latent_scale: Tensor | None = None,
    rope_scale: Tensor | None = None,
    backend: str | None = None,
) -> Tensor:
    """One query per sequence (``q_lat [B, H, R]``): paged_mla_attention with unit query lengths."""
    cu = torch.arange(q_lat.shape[0] + 1, dtype=torch.int32)
    return paged_mla_attention(
        q_lat,
        q_rope,
        latent_cache,
        rope_cache,
        block_tables,
        cu,
        context_lens,
        scale,
        latent_scale,
        rope_scale,
        backend,
    )
