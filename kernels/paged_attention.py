"""Paged KV cache ops: write, decode/prefill attention, page conversion, FP8 scale calibration.

Layout per layer: ``k_cache``/``v_cache`` [num_pages, page_size, num_kv_heads, head_dim] in
float32, bfloat16, float8_e4m3fn or int8. An int8 cache (``int8_format``) always has per-token page
scales (below). An FP8 cache has a scale tensor (``k_scale``/``v_scale``) of one of two kinds, told
apart by its rank:

* static: float32 ``[num_kv_heads]``, fixed by calibration (per head; per tensor = one value
  repeated); dequant ``q.float() * scale[h]``;
* per token ("page scales"): bfloat16 ``[num_pages, page_size, num_kv_heads]`` beside the pages,
  written together with them from each token's own amax (``write_kv``, ``convert_pages``);
  dequant ``q.float() * scale[page, slot, h]``.

A slot is ``page * page_size + offset``; negative slots in ``write_kv`` are skipped (padding).
A sequence with ``context_len == 0`` produces zeros.

Sliding windows (``window``, Mistral / Qwen2 style): a query at position p sees the keys at
positions p - window < j <= p, itself included, as transformers' sliding-window mask. The fast
paths read only the pages that hold such keys; pages wholly before every query's window are never
read, so their block-table entries are not looked at (the native and Triton kernels check only the
page ids they read).

The "cpu" backend runs ``write_kv`` and ``paged_decode_attention`` on float32, FP8 and int8 pages as one
native call each (``cpu_attention_native``; ``PAGODA_NATIVE_ATTENTION=0`` turns that off) and falls
back to the vectorized torch code here for other pools or when the native library is unavailable.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .attention_window import check_window, window_tables
from .cpu_attention_native import native_paged_decode, native_write_kv
from .dispatch import resolve
from .fp8_format import (
    FP8_BF16_BIAS,
    FP8_DTYPE,
    TOKEN_SCALE_DTYPE,
    amax_scale,
    fp8_to_float_scaled_down,
    quantize_fp8,
    raw_bytes,
    token_scales,
)
from .int8_format import INT8_DTYPE, int8_token_scales, quantize_int8

KV_DTYPES = (torch.float32, torch.bfloat16, FP8_DTYPE, INT8_DTYPE)
SCALED_DTYPES = (FP8_DTYPE, INT8_DTYPE)  # 1-byte elements that dequantize with scales
# Measured on SmolLM2-135M K/V (calibrate on one text, serve another): headroom 1.0 clips ~0.1% of
# values and raises the error to 2.8-3.4%; 1.5 clips none at 2.6% (see docs/kernels.md).
RECOMMENDED_KV_HEADROOM = 1.5


def is_page_scale(scale: Tensor | None) -> bool:
    """True for per-token page scales ``[num_pages, page_size, heads]`` (False: static or none)."""
    return scale is not None and scale.dim() == 3


def _check_cache(cache: Tensor, scale: Tensor | None, name: str) -> None:
    if cache.dim() != 4:
        raise ValueError(
            f"{name} must be [num_pages, page_size, kv_heads, head_dim], got {tuple(cache.shape)}"
        )
    if cache.dtype not in KV_DTYPES:
        raise ValueError(f"{name} dtype {cache.dtype} not in {KV_DTYPES}")
    if cache.dtype not in SCALED_DTYPES:
        return
    if scale is None:
        raise ValueError(f"{name} is {cache.dtype} and needs a scale")
    if cache.dtype == INT8_DTYPE and not is_page_scale(scale):
        raise ValueError(f"{name} is int8 and needs per-token page scales {tuple(cache.shape[:3])}")
    if is_page_scale(scale):
        if scale.shape != cache.shape[:3] or scale.dtype != TOKEN_SCALE_DTYPE:
            raise ValueError(
                f"{name} page scales must be {TOKEN_SCALE_DTYPE} {tuple(cache.shape[:3])}, "
                f"got {scale.dtype} {tuple(scale.shape)}"
            )
    elif tuple(scale.shape) != (cache.shape[2],):
        raise ValueError(f"{name} static scales must be [{cache.shape[2]}], got {tuple(scale.shape)}")


def _encode(x: Tensor, dtype: torch.dtype, scale: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """Values [..., H, D] -> (cache dtype values, their per-token scales [..., H] or None).

    fp8 with a static ``scale`` [H] quantizes with it; fp8 or int8 with page scales
    (``is_page_scale``) computes each token's own scales, which the caller stores beside the values."""
    if dtype == INT8_DTYPE:
        s = int8_token_scales(x)
        return quantize_int8(x, s[..., None]), s
    if dtype != FP8_DTYPE:
        return x.to(dtype), None
    if is_page_scale(scale):
        s = token_scales(x)
        return quantize_fp8(x, s.float()[..., None]), s
    return quantize_fp8(x, scale.float()[:, None]), None


def _decode(x: Tensor, scale: Tensor | None) -> Tensor:
    """Cache values [..., H, D] -> float32; ``scale`` is static [H] or the values' own rows [..., H]."""
    if x.dtype in SCALED_DTYPES:
        return x.float() * scale.float()[..., None]
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
    if be == "cpu" and native_write_kv(k_cache, v_cache, k, v, slot_mapping, k_scale, v_scale):
        return
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
        vals, s = _encode(x[t], cache.dtype, scale)
        raw[slot // page_size, slot % page_size] = raw_bytes(vals)
        if s is not None:
            scale[slot // page_size, slot % page_size] = s


def _write_vectorized(cache: Tensor, x: Tensor, slots: Tensor, scale: Tensor | None) -> None:
    slots = slots.long()
    keep = slots >= 0
    if not bool(keep.all()):
        slots, x = slots[keep], x[keep]
    flat = raw_bytes(cache).view(-1, cache.shape[2], cache.shape[3])
    vals, s = _encode(x, cache.dtype, scale)
    flat[slots] = raw_bytes(vals)
    if s is not None:
        scale.view(-1, cache.shape[2])[slots] = s


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
    window: int | None = None,
) -> Tensor:
    """One query token per sequence: ``q [B, Hq, D]`` -> ``[B, Hq, D]`` in ``q.dtype``.

    Query head h reads KV head ``h // (Hq // Hkv)``; softmax in float32. With a ``window`` the
    query (the sequence's last token) sees only its last ``window`` keys.
    """
    _check_cache(k_cache, k_scale, "k_cache")
    _check_cache(v_cache, v_scale, "v_cache")
    hq, hkv = q.shape[1], k_cache.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads {hq} not a multiple of KV heads {hkv}")
    window = check_window(window)
    be = resolve("paged_decode_attention", q.device, backend)
    args = (q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale)
    if be == "triton":
        from .triton_attention import paged_decode_attention_triton

        return paged_decode_attention_triton(*args, window=window)
    if be == "cpu":
        out = native_paged_decode(*args, window)
        if out is not None:
            return out
        return _decode_vectorized(*args, window)
    return _decode_reference(*args, window)


def _gather_seq(cache: Tensor, pages: Tensor, length: int, scale: Tensor | None) -> Tensor:
    """One sequence's first ``length`` tokens -> float32 [length, H, D]."""
    pages = pages.long()
    x = cache[pages].reshape(-1, cache.shape[2], cache.shape[3])[:length]
    if is_page_scale(scale):
        scale = scale[pages].reshape(-1, cache.shape[2])[:length]
    return _decode(x, scale)


def _attend_reference(
    q: Tensor, k: Tensor, v: Tensor, scale: float, causal_offset: int | None, window: int | None = None
) -> Tensor:
    """q [Tq, Hq, D] float32 over k/v [L, Hkv, D]; row i sees keys j <= causal_offset + i (and,
    with a ``window``, j > causal_offset + i - window)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if causal_offset is not None:
        pos = torch.arange(q.shape[0])[:, None] + causal_offset
        keys = torch.arange(k.shape[0])[None, :]
        hidden = keys > pos if window is None else (keys > pos) | (keys <= pos - window)
        scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)


def _decode_reference(
    q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale, window=None
) -> Tensor:
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    page_size = k_cache.shape[1]
    for b in range(q.shape[0]):
        length = int(context_lens[b])
        if length == 0:
            continue
        pages = block_tables[b, : math.ceil(length / page_size)]
        start = 0 if window is None else max(0, length - window)  # the query sits at length - 1
        k = _gather_seq(k_cache, pages, length, k_scale)[start:]
        v = _gather_seq(v_cache, pages, length, v_scale)[start:]
        out[b] = _attend_reference(q[b : b + 1].float(), k, v, scale, None)[0]
    return out.to(q.dtype)


# Temporaries per chunk of sequences stay below this many bytes: large fresh allocations are
# dominated by page faults on some VMs (50 MB costs ~40 ms there), smaller ones are reused.
_CHUNK_BYTES = 1 << 20


def _decode_vectorized(
    q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale, window=None
) -> Tensor:
    bsz, hq, d = q.shape
    _, page_size, hkv, _ = k_cache.shape
    block_tables, context_lens, _ = window_tables(block_tables, context_lens, window, page_size)
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
            q[b0:b1], k_cache, v_cache, block_tables[b0:b1, :n_pages], lens[b0:b1], scale, k_scale, v_scale,
            window,
        )  # fmt: skip
    return out


def _decode_chunk(q, k_cache, v_cache, tables, lens, scale, k_scale, v_scale, window) -> Tensor:
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

    def token_rows(s: Tensor) -> Tensor:  # page scales -> float32 [B, Hkv, 1, span]
        return s.index_select(0, flat).view(bsz, span, hkv).transpose(1, 2).float().unsqueeze(2)

    # fp8 static scales (and the 2**120 of the fast decode) fold into q (K) and the output (V);
    # per-token K scales multiply the scores, per-token V scales the probabilities (D/G x fewer
    # values than the pages they scale). int8 pages read their plain values.
    qf = q.float().view(bsz, hkv, group, d) * scale
    k_tok = k_cache.dtype in SCALED_DTYPES and is_page_scale(k_scale)
    v_tok = v_cache.dtype in SCALED_DTYPES and is_page_scale(v_scale)
    if k_cache.dtype == FP8_DTYPE:
        qf = qf * (FP8_BF16_BIAS if k_tok else (k_scale.float() * FP8_BF16_BIAS).view(1, hkv, 1, 1))
    scores = torch.matmul(qf, gather(k_cache).transpose(-1, -2))  # [B, Hkv, G, span]
    if k_tok:
        scores.mul_(token_rows(k_scale))
    keys = torch.arange(span, device=q.device)[None, :]
    valid = keys < lens[:, None]
    if window is not None:  # (the tables start at the window's first page: window_tables)
        valid &= keys >= lens[:, None] - window
    scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
    probs = scores.softmax(dim=-1).nan_to_num_(0.0)  # empty sequences -> zeros
    if v_tok:
        probs.mul_(token_rows(v_scale))
    out = torch.matmul(probs, gather(v_cache))  # [B, Hkv, G, D]
    if v_cache.dtype == FP8_DTYPE:
        out = out * (FP8_BF16_BIAS if v_tok else (v_scale.float() * FP8_BF16_BIAS).view(1, hkv, 1, 1))
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
    window: int | None = None,
) -> Tensor:
    """Ragged causal attention over the paged cache: ``q [T, Hq, D]`` -> ``[T, Hq, D]``.

    Query i of sequence b sits at position ``context_lens[b] - q_len_b + i`` and sees keys at
    positions <= its own (chunked prefill and cached prefixes), and with a ``window`` only the last
    ``window`` of them. Its K/V are already written.
    """
    _check_cache(k_cache, k_scale, "k_cache")
    _check_cache(v_cache, v_scale, "v_cache")
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"query heads {q.shape[1]} not a multiple of KV heads {k_cache.shape[2]}")
    window = check_window(window)
    be = resolve("paged_prefill_attention", q.device, backend)
    if be == "triton":
        from .triton_attention import paged_prefill_attention_triton

        return paged_prefill_attention_triton(
            q, k_cache, v_cache, block_tables, cu_q_lens, context_lens, scale, k_scale, v_scale, window=window
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
        # the reference reads every key; the torch path starts at the first query's window
        first = 0 if window is None or be == "reference" else max(0, length - q_len - window + 1) // page_size
        pages = block_tables[b, first : math.ceil(length / page_size)]
        n_keys = length - first * page_size
        k = _gather_seq(k_cache, pages, n_keys, k_scale)
        v = _gather_seq(v_cache, pages, n_keys, v_scale)
        qb = q[start:end].float()
        if be == "reference":
            out[start:end] = _attend_reference(qb, k, v, scale, length - q_len, window)
        else:
            out[start:end] = _attend_sdpa(qb, k, v, scale, n_keys - q_len, window)
    return out.to(q.dtype)


def _attend_sdpa(q: Tensor, k: Tensor, v: Tensor, scale: float, offset: int, window: int | None) -> Tensor:
    """torch SDPA with GQA; causal flag when there is no prefix nor window, an explicit mask
    otherwise (row i sees keys offset + i - window < j <= offset + i)."""
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [H, L, D]
    if offset == 0 and window is None:
        mask, causal = None, True
    else:
        rows = torch.arange(q.shape[0], device=q.device)[:, None] + offset
        keys = torch.arange(k.shape[0], device=q.device)[None, :]
        mask, causal = keys <= rows, False
        if window is not None:
            mask &= keys > rows - window
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
    """Copy whole K and V pages between pools (bf16 -> fp8 quantizes with the destination scales;
    destination page scales, fp8 or int8, are filled from each token's amax)."""
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
    (bf16 -> fp8 quantizes with the destination's static scales, or per token into its page
    scales). Page scales travel with their pages: source rows ``src_pages`` go to ``dst_pages``."""
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
            _store(dst, dst_scale, dp, *_convert(src[sp], dst.dtype, _rows(src_scale, sp), dst_scale))
    else:
        sp, dp = src_pages.long(), dst_pages.long()
        _store(dst, dst_scale, dp, *_convert(src[sp], dst.dtype, _rows(src_scale, sp), dst_scale))


def _rows(scale: Tensor | None, pages: Tensor | int) -> Tensor | None:
    """The scales that go with source pages ``pages``: their page-scale rows, or the static scales."""
    return scale[pages] if is_page_scale(scale) else scale


def _store(
    dst: Tensor, dst_scale: Tensor | None, pages: Tensor | int, vals: Tensor, s: Tensor | None
) -> None:
    raw_bytes(dst)[pages] = raw_bytes(vals)
    if s is not None:
        dst_scale[pages] = s


def _convert(
    x: Tensor, dtype: torch.dtype, s_rows: Tensor | None, d_scale: Tensor | None
) -> tuple[Tensor, Tensor | None]:
    """Pages ``x`` with their scales -> (pages in ``dtype``, their page scales or None). fp8 pages
    keep their bytes when both sides use page scales (the rows move along) or equal static scales;
    so do int8 pages (always page-scaled)."""
    if x.dtype == dtype not in SCALED_DTYPES:
        return x, None
    if x.dtype == dtype in SCALED_DTYPES:
        if is_page_scale(d_scale) and s_rows.dim() == x.dim() - 1:
            return x, s_rows
        if not is_page_scale(d_scale) and s_rows.dim() == 1 and torch.equal(s_rows, d_scale):
            return x, None
    return _encode(_decode(x, s_rows), dtype, d_scale)


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


def calibrate_tensor_scales(x: Tensor, headroom: float = 1.0) -> Tensor:
    """One FP8 scale for all heads of a cache component (per-tensor granularity), repeated per head
    so it runs on the per-head paths: calibration values [T, heads, dim] -> [heads]."""
    if headroom <= 0:
        raise ValueError(f"headroom must be positive, got {headroom}")
    return amax_scale(x.abs().amax(), headroom).expand(x.shape[1]).contiguous()


def empty_page_scales(num_pages: int, page_size: int, heads: int, device: torch.device | str) -> Tensor:
    """Zeroed per-token scales for a pool of ``num_pages`` fp8 or int8 pages (filled as pages are
    written)."""
    return torch.zeros(num_pages, page_size, heads, dtype=TOKEN_SCALE_DTYPE, device=device)
