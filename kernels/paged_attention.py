"""Paged KV cache ops: write, decode/prefill attention, page conversion, FP8 scale calibration.

Layout per layer: ``k_cache``/``v_cache`` [num_pages, page_size, num_kv_heads, head_dim] in
float32, bfloat16 or float8_e4m3fn. FP8 caches carry static float32 scales per KV head
(``k_scale``/``v_scale`` [num_kv_heads]; dequant ``q.float() * scale[h]``).
A slot is ``page * page_size + offset``; negative slots in ``write_kv`` are skipped (padding).
A sequence with ``context_len == 0`` produces zeros.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .dispatch import resolve
from .fp8_format import (
    FP8_BF16_BIAS,
    FP8_DTYPE,
    amax_scale,
    fp8_to_float_scaled_down,
    quantize_fp8,
    raw_bytes,
)

KV_DTYPES = (torch.float32, torch.bfloat16, FP8_DTYPE)
# Measured on SmolLM2-135M K/V (calibrate on one text, serve another): headroom 1.0 clips ~0.1% of
# values and raises the error to 2.8-3.4%; 1.5 clips none at 2.6% (see docs/kernels.md).
RECOMMENDED_KV_HEADROOM = 1.5


def _check_cache(cache: Tensor, scale: Tensor | None, name: str) -> None:
    if cache.dim() != 4:
        raise ValueError(
            f"{name} must be [num_pages, page_size, kv_heads, head_dim], got {tuple(cache.shape)}"
        )
    if cache.dtype not in KV_DTYPES:
        raise ValueError(f"{name} dtype {cache.dtype} not in {KV_DTYPES}")
    if cache.dtype == FP8_DTYPE and scale is None:
        raise ValueError(f"{name} is float8_e4m3fn and needs a per-head scale")


def _encode(x: Tensor, dtype: torch.dtype, scale: Tensor | None) -> Tensor:
    """Values [..., H, D] -> cache dtype (quantizing with per-head scales for fp8)."""
    if dtype == FP8_DTYPE:
        return quantize_fp8(x, scale.float()[:, None])
    return x.to(dtype)


def _decode(x: Tensor, scale: Tensor | None) -> Tensor:
    """Cache values [..., H, D] -> float32."""
    if x.dtype == FP8_DTYPE:
        return x.float() * scale.float()[:, None]
    return x.float()


# --------------------------------------------------------------------------------------- write


def write_kv(
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor,
    v: Tensor,
    slot_mapping: Tensor,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    backend: str | None = None,
) -> None:
    """Scatter ``k``/``v`` [T, Hkv, D] into the caches at ``slot_mapping`` [T] (in place)."""
    _check_cache(k_cache, k_scale, "k_cache")
    _check_cache(v_cache, v_scale, "v_cache")
    be = resolve("write_kv", k.device, backend, supports=("cpu", "reference"))
    for cache, x, scale in ((k_cache, k, k_scale), (v_cache, v, v_scale)):
        if be == "reference":
            _write_reference(cache, x, slot_mapping, scale)
        else:
            _write_vectorized(cache, x, slot_mapping, scale)


def _write_reference(cache: Tensor, x: Tensor, slots: Tensor, scale: Tensor | None) -> None:
    page_size = cache.shape[1]
    raw = raw_bytes(cache)
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        raw[slot // page_size, slot % page_size] = raw_bytes(_encode(x[t], cache.dtype, scale))


def _write_vectorized(cache: Tensor, x: Tensor, slots: Tensor, scale: Tensor | None) -> None:
    slots = slots.long()
    keep = slots >= 0
    if not bool(keep.all()):
        slots, x = slots[keep], x[keep]
    flat = raw_bytes(cache).view(-1, cache.shape[2], cache.shape[3])
    flat[slots] = raw_bytes(_encode(x, cache.dtype, scale))


# ------------------------------------------------------------------------------------- decode


def paged_decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    backend: str | None = None,
) -> Tensor:
    """One query token per sequence: ``q [B, Hq, D]`` -> ``[B, Hq, D]`` in ``q.dtype``.

    Query head h reads KV head ``h // (Hq // Hkv)``; softmax in float32.
    """
    _check_cache(k_cache, k_scale, "k_cache")
    _check_cache(v_cache, v_scale, "v_cache")
    hq, hkv = q.shape[1], k_cache.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads {hq} not a multiple of KV heads {hkv}")
    be = resolve("paged_decode_attention", q.device, backend)
    if be == "triton":
        from .triton_attention import paged_decode_attention_triton

        return paged_decode_attention_triton(
            q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale
        )
    if be == "cpu":
        return _decode_vectorized(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale)
    return _decode_reference(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale)


def _gather_seq(cache: Tensor, pages: Tensor, length: int, scale: Tensor | None) -> Tensor:
    """One sequence's first ``length`` tokens -> float32 [length, H, D]."""
    x = cache[pages.long()].reshape(-1, cache.shape[2], cache.shape[3])[:length]
    return _decode(x, scale)


def _attend_reference(q: Tensor, k: Tensor, v: Tensor, scale: float, causal_offset: int | None) -> Tensor:
    """q [Tq, Hq, D] float32 over k/v [L, Hkv, D]; row i sees keys j <= causal_offset + i."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if causal_offset is not None:
        pos = torch.arange(q.shape[0])[:, None] + causal_offset
        scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)


def _decode_reference(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale) -> Tensor:
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    page_size = k_cache.shape[1]
    for b in range(q.shape[0]):
        length = int(context_lens[b])
        if length == 0:
            continue
        pages = block_tables[b, : math.ceil(length / page_size)]
        k = _gather_seq(k_cache, pages, length, k_scale)
        v = _gather_seq(v_cache, pages, length, v_scale)
        out[b] = _attend_reference(q[b : b + 1].float(), k, v, scale, None)[0]
    return out.to(q.dtype)


# Temporaries per chunk of sequences stay below this many bytes: large fresh allocations are
# dominated by page faults on some VMs (50 MB costs ~40 ms there), smaller ones are reused.
_CHUNK_BYTES = 1 << 20


def _decode_vectorized(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale) -> Tensor:
    bsz, hq, d = q.shape
    _, page_size, hkv, _ = k_cache.shape
    lens = context_lens.to(q.device).long()
    max_len = int(lens.max()) if bsz else 0
    if max_len == 0:
        return torch.zeros_like(q)
    n_pages = math.ceil(max_len / page_size)
    per_seq = n_pages * page_size * hkv * d * 4
    chunk = max(1, _CHUNK_BYTES // per_seq)
    out = torch.empty(bsz, hq, d, dtype=q.dtype, device=q.device)
    for b0 in range(0, bsz, chunk):
        b1 = min(bsz, b0 + chunk)
        out[b0:b1] = _decode_chunk(
            q[b0:b1], k_cache, v_cache, block_tables[b0:b1, :n_pages], lens[b0:b1], scale, k_scale, v_scale
        )
    return out


def _decode_chunk(q, k_cache, v_cache, tables, lens, scale, k_scale, v_scale) -> Tensor:
    """Vectorized decode for a few sequences: gather pages, masked fp32 softmax."""
    bsz, hq, d = q.shape
    _, page_size, hkv, _ = k_cache.shape
    group = hq // hkv
    span = tables.shape[1] * page_size
    flat = tables.reshape(-1).long()

    def gather(cache: Tensor) -> Tensor:  # -> float32 [B, Hkv, span, D]
        x = raw_bytes(cache).index_select(0, flat)
        x = fp8_to_float_scaled_down(x) if cache.dtype == FP8_DTYPE else x.float()
        return x.view(bsz, span, hkv, d).transpose(1, 2)

    # fp8 per-head scales (and the 2**120 of the fast decode) fold into q (K) and the output (V).
    qf = q.float().view(bsz, hkv, group, d) * scale
    if k_cache.dtype == FP8_DTYPE:
        qf = qf * (k_scale.float() * FP8_BF16_BIAS).view(1, hkv, 1, 1)
    scores = torch.matmul(qf, gather(k_cache).transpose(-1, -2))  # [B, Hkv, G, span]
    valid = torch.arange(span, device=q.device)[None, :] < lens[:, None]
    scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
    probs = scores.softmax(dim=-1).nan_to_num_(0.0)  # empty sequences -> zeros
    out = torch.matmul(probs, gather(v_cache))  # [B, Hkv, G, D]
    if v_cache.dtype == FP8_DTYPE:
        out = out * (v_scale.float() * FP8_BF16_BIAS).view(1, hkv, 1, 1)
    return out.reshape(bsz, hq, d).to(q.dtype)


# ------------------------------------------------------------------------------------ prefill


def paged_prefill_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    cu_q_lens: Tensor,
    context_lens: Tensor,
    scale: float,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    backend: str | None = None,
) -> Tensor:
    """Ragged causal attention over the paged cache: ``q [T, Hq, D]`` -> ``[T, Hq, D]``.

    Query i of sequence b sits at position ``context_lens[b] - q_len_b + i`` and sees keys at
    positions <= its own (chunked prefill and cached prefixes). Its K/V are already written.
    """
    _check_cache(k_cache, k_scale, "k_cache")
    _check_cache(v_cache, v_scale, "v_cache")
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"query heads {q.shape[1]} not a multiple of KV heads {k_cache.shape[2]}")
    be = resolve("paged_prefill_attention", q.device, backend)
    if be == "triton":
        from .triton_attention import paged_prefill_attention_triton

        return paged_prefill_attention_triton(
            q, k_cache, v_cache, block_tables, cu_q_lens, context_lens, scale, k_scale, v_scale
        )
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    page_size = k_cache.shape[1]
    cu = cu_q_lens.tolist()
    lens = context_lens.tolist()
    for b, length in enumerate(lens):
        start, end = cu[b], cu[b + 1]
        q_len = end - start
        if q_len == 0:
            continue
        if q_len > length:
            raise ValueError(f"sequence {b}: {q_len} queries but only {length} tokens in the cache")
        pages = block_tables[b, : math.ceil(length / page_size)]
        k = _gather_seq(k_cache, pages, length, k_scale)
        v = _gather_seq(v_cache, pages, length, v_scale)
        qb = q[start:end].float()
        if be == "reference":
            out[start:end] = _attend_reference(qb, k, v, scale, length - q_len)
        else:
            out[start:end] = _attend_sdpa(qb, k, v, scale, length - q_len)
    return out.to(q.dtype)


def _attend_sdpa(q: Tensor, k: Tensor, v: Tensor, scale: float, offset: int) -> Tensor:
    """torch SDPA with GQA; causal flag when there is no prefix, an explicit mask otherwise."""
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [H, L, D]
    if offset == 0:
        mask, causal = None, True
    else:
        rows = torch.arange(q.shape[0], device=q.device)[:, None] + offset
        mask, causal = torch.arange(k.shape[0], device=q.device)[None, :] <= rows, False
    out = F.scaled_dot_product_attention(
        qh, kh, vh, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=qh.shape[0] != kh.shape[0]
    )
    return out.transpose(0, 1)


# ------------------------------------------------------------------------------ page convert


def convert_pages(
    src_k: Tensor,
    src_v: Tensor,
    dst_k: Tensor,
    dst_v: Tensor,
    src_pages: Tensor,
    dst_pages: Tensor,
    dst_k_scale: Tensor | None = None,
    dst_v_scale: Tensor | None = None,
    src_k_scale: Tensor | None = None,
    src_v_scale: Tensor | None = None,
    backend: str | None = None,
) -> None:
    """Copy whole K and V pages between pools (bf16 -> fp8 quantizes with the destination scales)."""
    for cache, scale, name in (
        (src_k, src_k_scale, "src_k"),
        (src_v, src_v_scale, "src_v"),
        (dst_k, dst_k_scale, "dst_k"),
        (dst_v, dst_v_scale, "dst_v"),
    ):
        _check_cache(cache, scale, name)
    if src_k.shape[1:] != dst_k.shape[1:] or src_v.shape[1:] != dst_v.shape[1:]:
        raise ValueError("source and destination pools differ in page_size, kv heads or head_dim")
    for src, dst, s_scale, d_scale in (
        (src_k, dst_k, src_k_scale, dst_k_scale),
        (src_v, dst_v, src_v_scale, dst_v_scale),
    ):
        convert_component_pages(src, dst, src_pages, dst_pages, d_scale, s_scale, backend)


def convert_component_pages(
    src: Tensor,
    dst: Tensor,
    src_pages: Tensor,
    dst_pages: Tensor,
    dst_scale: Tensor | None = None,
    src_scale: Tensor | None = None,
    backend: str | None = None,
) -> None:
    """Copy whole pages of one cache component (K, V, an MLA latent or rope key: any
    ``[num_pages, page_size, heads, dim]`` page tensor) between pools, converting the format
    (bf16 -> fp8 quantizes with the destination's per-head scales)."""
    _check_cache(src, src_scale, "source pages")
    _check_cache(dst, dst_scale, "destination pages")
    if src.shape[1:] != dst.shape[1:]:
        raise ValueError(
            f"source and destination pages differ in page_size, heads or dim: "
            f"{tuple(src.shape[1:])} vs {tuple(dst.shape[1:])}"
        )
    if src_pages.numel() != dst_pages.numel():
        raise ValueError("src_pages and dst_pages differ in length")
    be = resolve("convert_pages", src.device, backend, supports=("cpu", "reference"))
    if be == "reference":
        for sp, dp in zip(src_pages.tolist(), dst_pages.tolist(), strict=True):
            raw_bytes(dst)[dp] = raw_bytes(_convert(src[sp], dst.dtype, src_scale, dst_scale))
    else:
        vals = _convert(src[src_pages.long()], dst.dtype, src_scale, dst_scale)
        raw_bytes(dst)[dst_pages.long()] = raw_bytes(vals)


def _convert(x: Tensor, dtype: torch.dtype, s_scale: Tensor | None, d_scale: Tensor | None) -> Tensor:
    same_fp8 = x.dtype == dtype == FP8_DTYPE and s_scale is not None and torch.equal(s_scale, d_scale)
    if x.dtype == dtype and (dtype != FP8_DTYPE or same_fp8):
        return x
    return _encode(_decode(x, s_scale), dtype, d_scale)


# ------------------------------------------------------------------------------ calibration


def calibrate_kv_scales(k: Tensor, v: Tensor, headroom: float = 1.0) -> tuple[Tensor, Tensor]:
    """Per-KV-head FP8 scales from calibration K/V [T, Hkv, D]: ``amax * headroom / 448``.

    ``headroom > 1`` leaves room for activations larger than any seen in calibration (values
    beyond the calibrated range clamp to +-448 * scale).
    """
    return calibrate_head_scales(k, headroom), calibrate_head_scales(v, headroom)


def calibrate_head_scales(x: Tensor, headroom: float = 1.0) -> Tensor:
    """Per-head FP8 scales ``amax * headroom / 448`` of one cache component's calibration values
    [T, heads, dim] (K or V of a GQA model; an MLA latent or rope key with its single head)."""
    if headroom <= 0:
        raise ValueError(f"headroom must be positive, got {headroom}")
    return amax_scale(x.abs().amax(dim=(0, 2)), headroom)
