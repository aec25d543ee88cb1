"""Triton paged decode attention (split along the context, online softmax).

Grid: (sequence, KV head, context split). Each program loads the query heads that share its KV
head (GQA) as one [BLOCK_G, D] tile, walks its share of the sequence's pages one page at a time
(K/V dequantized in-kernel: fp8 bytes are bitcast to e4m3, int8 values convert to float32 as they
are; static per-head fp8 scales fold into q and the output, per-token page scales - fp8's optional
ones, int8's always - multiply the scores (K) or the probabilities (V)), keeps a running max / sum /
weighted V in float32, and writes unnormalized partials. The wrapper merges the splits
(log-sum-exp) - with one split this is exactly a single online-softmax pass.

K and V pages are of one kind: both float (float32 / bfloat16), both fp8 or both int8 (with page
scales); other combinations raise ValueError.

Sliding windows: a query at position p sees keys p - window < j <= p. Decode drops the pages before
each query's window from its block table first (``window_tables``), so the splits cover only the
window; prefill starts each query block at the page of its first query's first key. Without a
window ``WINDOW`` is a huge number and those masks keep every key.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .attention_window import window_tables
from .fp8_format import FP8_DTYPE, raw_bytes
from .int8_format import INT8_DTYPE
from .triton_common import target_programs

NO_WINDOW = 1 << 30  # the kernels' WINDOW without a sliding window: every earlier key is in it


def _kv_kind(k_cache: Tensor, v_cache: Tensor, k_scale: Tensor | None, v_scale: Tensor | None) -> str:
    """The pages' common kind ("float", "fp8" or "int8"); ValueError for mixed kinds, scaled
    pages without scales, or int8 pages without per-token page scales."""
    kinds = [
        "fp8" if c.dtype == FP8_DTYPE else "int8" if c.dtype == INT8_DTYPE else "float"
        for c in (k_cache, v_cache)
    ]
    if kinds[0] != kinds[1]:
        raise ValueError(
            f"k_cache and v_cache must be of one kind (both float, both fp8 or both int8), "
            f"got {k_cache.dtype} and {v_cache.dtype}"
        )
    kind = kinds[0]
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if kind != "float" and s is None:
            raise ValueError(f"{kind} pages need {name}")
        if kind == "int8" and s.dim() != 3:
            raise ValueError(f"int8 pages need per-token page scales for {name}, got {tuple(s.shape)}")
    return kind


def _scale_args(
    kind: str, k_scale: Tensor | None, v_scale: Tensor | None, hkv: int, device: torch.device
) -> tuple[Tensor, Tensor, bool, bool]:
    """The kernels' scale operands: static float32 [Hkv] (ones for float pages) or contiguous
    per-token page scales [P, page_size, Hkv] (bfloat16, read per key; int8 pages always have
    them), and which is which."""
    ones = torch.ones(hkv, dtype=torch.float32, device=device)
    out: list[Tensor] = []
    tok: list[bool] = []
    for s in (k_scale, v_scale):
        per_token = kind != "float" and s.dim() == 3
        out.append(s.contiguous() if per_token else (s if kind == "fp8" else ones).float().contiguous())
        tok.append(per_token)
    return out[0], out[1], tok[0], tok[1]


@triton.jit
def _paged_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    lens_ptr,
    k_scale_ptr,
    v_scale_ptr,
    acc_ptr,
    ml_ptr,
    scale,
    window,
    pages_per_split,
    stride_sp,
    stride_st,
    stride_qb,
    stride_qh,
    stride_kp,
    stride_kt,
    stride_kh,
    stride_vp,
    stride_vt,
    stride_vh,
    stride_tb,
    stride_ab,
    stride_ah,
    stride_as,
    stride_mb,
    stride_mh,
    stride_ms,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    KV_FP8: tl.constexpr,  # e4m3 bytes (int8 pages: False, with K_TOK and V_TOK set)
    K_TOK: tl.constexpr,  # K page scales per token (else static per head, or none for float)
    V_TOK: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(lens_ptr + b)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_t = tl.arange(0, BLOCK_T)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q_rows = q_ptr + b * stride_qb + (h * GROUP + offs_g)[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_rows, mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32) * scale
    if KV_FP8 and not K_TOK:
        q = q * tl.load(k_scale_ptr + h)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    first = split * pages_per_split
    last = tl.minimum(first + pages_per_split, tl.cdiv(length, PAGE_SIZE))
    for i in range(first, last):
        page = tl.load(tables_ptr + b * stride_tb + i).to(tl.int64)
        tok = i * PAGE_SIZE + offs_t
        t_mask = (offs_t < PAGE_SIZE) & (tok < length) & (tok >= length - window)
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k_off = page * stride_kp + offs_t[:, None] * stride_kt + h * stride_kh + offs_d[None, :]
        v_off = page * stride_vp + offs_t[:, None] * stride_vt + h * stride_vh + offs_d[None, :]
        k = tl.load(k_ptr + k_off, mask=kv_mask, other=0)
        v = tl.load(v_ptr + v_off, mask=kv_mask, other=0)
        if KV_FP8:  # fp8 arrives as bytes; int8 and float pages convert as loaded
            k = k.to(tl.float8e4nv, bitcast=True)
            v = v.to(tl.float8e4nv, bitcast=True)
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee")  # [BLOCK_G, BLOCK_T]
        tok_s = page * stride_sp + offs_t * stride_st + h
        if K_TOK:
            s = s * tl.load(k_scale_ptr + tok_s, mask=t_mask, other=0.0).to(tl.float32)[None, :]
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet stays empty
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        pv = p
        if V_TOK:
            pv = p * tl.load(v_scale_ptr + tok_s, mask=t_mask, other=0.0).to(tl.float32)[None, :]
        acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision="ieee")
        m_i = m_new
    if KV_FP8 and not V_TOK:
        acc = acc * tl.load(v_scale_ptr + h)  # V's per-head scale, applied once per split
    a_rows = acc_ptr + b * stride_ab + h * stride_ah + split * stride_as
    tl.store(a_rows + offs_g[:, None] * BLOCK_D + offs_d[None, :], acc)
    ml_rows = ml_ptr + b * stride_mb + h * stride_mh + split * stride_ms
    tl.store(ml_rows + offs_g * 2, m_i)
    tl.store(ml_rows + offs_g * 2 + 1, l_i)


def paged_decode_attention_triton(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    num_splits: int | None = None,
    window: int | None = None,
) -> Tensor:
    """``q [B, Hq, D]`` over the paged cache -> ``[B, Hq, D]`` in ``q.dtype``; with a ``window``
    each query sees only its last ``window`` keys."""
    bsz, hq, d = q.shape
    _, page_size, hkv, _ = k_cache.shape
    group = hq // hkv
    kind = _kv_kind(k_cache, v_cache, k_scale, v_scale)
    if bsz == 0:
        return torch.empty_like(q)
    block_tables, context_lens, _ = window_tables(block_tables, context_lens, window, page_size)
    max_pages = block_tables.shape[1]
    if num_splits is None:
        num_splits = max(1, min(max_pages, target_programs(q.device) // (bsz * hkv)))
    num_splits = max(1, min(num_splits, max_pages))
    pages_per_split = triton.cdiv(max_pages, num_splits)
    num_splits = triton.cdiv(max_pages, pages_per_split)
    block_g = max(16, triton.next_power_of_2(group))
    block_d = max(16, triton.next_power_of_2(d))
    block_t = max(16, triton.next_power_of_2(page_size))
    acc = torch.empty(bsz, hkv, num_splits, block_g, block_d, dtype=torch.float32, device=q.device)
    ml = torch.empty(bsz, hkv, num_splits, block_g, 2, dtype=torch.float32, device=q.device)
    kc, vc = raw_bytes(k_cache), raw_bytes(v_cache)
    ks, vs, k_tok, v_tok = _scale_args(kind, k_scale, v_scale, hkv, q.device)
    tables = block_tables.to(torch.int32)
    _paged_decode_kernel[(bsz, hkv, num_splits)](
        q,
        kc,
        vc,
        tables,
        context_lens.to(torch.int32).contiguous(),
        ks,
        vs,
        acc,
        ml,
        float(scale),
        window or NO_WINDOW,
        pages_per_split,
        page_size * hkv,
        hkv,
        q.stride(0),
        q.stride(1),
        kc.stride(0),
        kc.stride(1),
        kc.stride(2),
        vc.stride(0),
        vc.stride(1),
        vc.stride(2),
        tables.stride(0),
        acc.stride(0),
        acc.stride(1),
        acc.stride(2),
        ml.stride(0),
        ml.stride(1),
        ml.stride(2),
        GROUP=group,
        HEAD_DIM=d,
        PAGE_SIZE=page_size,
        BLOCK_G=block_g,
        BLOCK_D=block_d,
        BLOCK_T=block_t,
        KV_FP8=kind == "fp8",
        K_TOK=k_tok,
        V_TOK=v_tok,
    )
    # Merge the splits: weight each by exp(m_s - max_s m_s).
    m, l_sum = ml[..., 0], ml[..., 1]  # [B, Hkv, S, G]
    m_max = m.amax(dim=2, keepdim=True)
    w = torch.exp(m - m_max).nan_to_num_(0.0)  # all -inf (empty sequence) -> 0
    num = (acc * w[..., None]).sum(dim=2)  # [B, Hkv, G, D]
    den = (l_sum * w).sum(dim=2)[..., None]
    out = torch.where(den > 0, num / den.clamp(min=1e-30), torch.zeros_like(num))
    return out[:, :, :group, :d].reshape(bsz, hq, d).to(q.dtype)


@triton.jit
def _paged_prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    cu_ptr,
    lens_ptr,
    k_scale_ptr,
    v_scale_ptr,
    out_ptr,
    scale,
    window,
    stride_sp,
    stride_st,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_kt,
    stride_kh,
    stride_vp,
    stride_vt,
    stride_vh,
    stride_tb,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    KV_FP8: tl.constexpr,  # e4m3 bytes (int8 pages: False, with K_TOK and V_TOK set)
    K_TOK: tl.constexpr,  # K page scales per token (else static per head, or none for float)
    V_TOK: tl.constexpr,
):
    b = tl.program_id(0)
    qb = tl.program_id(1)
    h = tl.program_id(2)
    kvh = h // GROUP
    q_start = tl.load(cu_ptr + b)
    q_len = tl.load(cu_ptr + b + 1) - q_start
    length = tl.load(lens_ptr + b)
    prefix = length - q_len
    offs_q = qb * BLOCK_Q + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, BLOCK_D)
    offs_t = tl.arange(0, BLOCK_T)
    q_mask = offs_q < q_len
    d_mask = offs_d < HEAD_DIM
    q_rows = q_ptr + (q_start + offs_q)[:, None] * stride_qt + h * stride_qh + offs_d[None, :]
    q = tl.load(q_rows, mask=q_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32) * scale
    if KV_FP8 and not K_TOK:
        q = q * tl.load(k_scale_ptr + kvh)
    pos = prefix + offs_q  # absolute position of each query
    # Keys this block needs: up to its last query's position (none if the block is empty).
    key_end = tl.minimum(prefix + (qb + 1) * BLOCK_Q, length)
    n_pages = tl.where(qb * BLOCK_Q < q_len, tl.cdiv(key_end, PAGE_SIZE), 0)
    # ... and from the first query's first key: its window's start (0 without a window)
    first_page = tl.maximum(prefix + qb * BLOCK_Q - window + 1, 0) // PAGE_SIZE
    m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)
    for i in range(first_page, n_pages):
        page = tl.load(tables_ptr + b * stride_tb + i).to(tl.int64)
        tok = i * PAGE_SIZE + offs_t
        t_mask = (offs_t < PAGE_SIZE) & (tok < length)
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k_off = page * stride_kp + offs_t[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :]
        v_off = page * stride_vp + offs_t[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :]
        k = tl.load(k_ptr + k_off, mask=kv_mask, other=0)
        v = tl.load(v_ptr + v_off, mask=kv_mask, other=0)
        if KV_FP8:  # fp8 arrives as bytes; int8 and float pages convert as loaded
            k = k.to(tl.float8e4nv, bitcast=True)
            v = v.to(tl.float8e4nv, bitcast=True)
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee")  # [BLOCK_Q, BLOCK_T]
        tok_s = page * stride_sp + offs_t * stride_st + kvh
        if K_TOK:
            s = s * tl.load(k_scale_ptr + tok_s, mask=t_mask, other=0.0).to(tl.float32)[None, :]
        visible = t_mask[None, :] & (tok[None, :] <= pos[:, None]) & (tok[None, :] > pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet stays empty
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        pv = p
        if V_TOK:
            pv = p * tl.load(v_scale_ptr + tok_s, mask=t_mask, other=0.0).to(tl.float32)[None, :]
        acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision="ieee")
        m_i = m_new
    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    if KV_FP8 and not V_TOK:
        out = out * tl.load(v_scale_ptr + kvh)
    o_rows = out_ptr + (q_start + offs_q)[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
    tl.store(o_rows, out, mask=q_mask[:, None] & d_mask[None, :])


def paged_prefill_attention_triton(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    cu_q_lens: Tensor,
    context_lens: Tensor,
    scale: float,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    max_q_len: int | None = None,
    window: int | None = None,
) -> Tensor:
    """Ragged causal attention over the paged cache: ``q [T, Hq, D]`` -> ``[T, Hq, D]``; with a
    ``window`` each query sees only the last ``window`` keys up to its own position.

    ``max_q_len`` (the longest query run) sizes the grid; computed from ``cu_q_lens`` if omitted.
    """
    t, hq, d = q.shape
    _, page_size, hkv, _ = k_cache.shape
    bsz = context_lens.shape[0]
    kind = _kv_kind(k_cache, v_cache, k_scale, v_scale)
    if t == 0 or bsz == 0:
        return torch.zeros_like(q)
    if max_q_len is None:
        max_q_len = int((cu_q_lens[1:] - cu_q_lens[:-1]).max())
    block_q = 16
    out = torch.zeros(t, hq, d, dtype=torch.float32, device=q.device)
    kc, vc = raw_bytes(k_cache), raw_bytes(v_cache)
    ks, vs, k_tok, v_tok = _scale_args(kind, k_scale, v_scale, hkv, q.device)
    tables = block_tables.to(torch.int32)
    grid = (bsz, triton.cdiv(max(max_q_len, 1), block_q), hq)
    _paged_prefill_kernel[grid](
        q,
        kc,
        vc,
        tables,
        cu_q_lens.to(torch.int32).contiguous(),
        context_lens.to(torch.int32).contiguous(),
        ks,
        vs,
        out,
        float(scale),
        window or NO_WINDOW,
        page_size * hkv,
        hkv,
        q.stride(0),
        q.stride(1),
        kc.stride(0),
        kc.stride(1),
        kc.stride(2),
        vc.stride(0),
        vc.stride(1),
        vc.stride(2),
        tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=hq // hkv,
        HEAD_DIM=d,
        PAGE_SIZE=page_size,
        BLOCK_Q=block_q,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_T=max(16, triton.next_power_of_2(page_size)),
        KV_FP8=kind == "fp8",
        K_TOK=k_tok,
        V_TOK=v_tok,
    )
    return out.to(q.dtype)
