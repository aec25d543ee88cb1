"""Triton grouped GEMMs for the fused MoE (dense bf16/float32 and INT4 experts).

Layout: the T*k (token, expert) assignments are sorted by expert and each expert's run of rows is
padded to a multiple of BLOCK_M, so every BLOCK_M block of sorted rows belongs to one expert
(``block_expert``). Padding rows carry index -1 and are masked. Two kernels, program ids
(row block, N tile):

  1. gate_up + SwiGLU: gathers the block's token rows of ``x``, accumulates the gate and up tiles
     of that expert's ``gate_up`` (rows n and I + n) and stores ``silu(gate) * up`` [rows, I];
  2. down: multiplies those rows by the expert's ``down``, scales each row by its routing weight
     and stores it at its assignment's slot (t*k + j) of a [T*k, H] buffer (activations' dtype).

The wrapper then sums the k slots of each token (a deterministic scatter-add, no atomics). INT4
weights are dequantized in the kernel as in kernels/triton_int4.py (even and odd k as two
half-width dots, one tile never straddling a group).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .dispatch import triton_interpreting
from .triton_common import dot_in_input_dtype


@triton.jit
def _tile_dot(
    acc,
    x_rows,  # [BLOCK_M, 1] pointers to the block's rows of the activations
    m_mask,
    w_ptr,  # this expert's weight (dense [N, K] or packed [N, K//2])
    s_ptr,
    z_ptr,
    offs_n,
    n_mask,
    k0,
    K,
    stride_wn,
    stride_sn,
    FMT: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    GROUP: tl.constexpr,
    DOT_IN_INPUT: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """acc += x[rows, k0:k0+BLOCK_K] @ W[offs_n, k0:k0+BLOCK_K].T in float32.

    FMT 0: dense weights; 1: INT4 (dequantized here); 2: FP8 bytes (decoded here, the
    per-channel scale is left to the caller's epilogue).
    """
    if FMT == 1:
        offs_j = tl.arange(0, BLOCK_K // 2)
        group = k0 // GROUP
        scale = tl.load(s_ptr + offs_n * stride_sn + group, mask=n_mask, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            zero = tl.load(z_ptr + offs_n * stride_sn + group, mask=n_mask, other=0).to(tl.float32)
        else:
            zero = tl.zeros_like(scale) + 8.0
        packed = tl.load(
            w_ptr + offs_n[:, None] * stride_wn + (k0 // 2 + offs_j)[None, :], mask=n_mask[:, None], other=0
        )
        w_even = ((packed & 0xF).to(tl.float32) - zero[:, None]) * scale[:, None]
        w_odd = ((packed >> 4).to(tl.float32) - zero[:, None]) * scale[:, None]
        k_even = k0 + 2 * offs_j
        x_even = tl.load(x_rows + k_even[None, :], mask=m_mask[:, None], other=0.0)
        x_odd = tl.load(x_rows + k_even[None, :] + 1, mask=m_mask[:, None], other=0.0)
        if DOT_IN_INPUT:
            acc += tl.dot(x_even, tl.trans(w_even.to(x_even.dtype)))
            acc += tl.dot(x_odd, tl.trans(w_odd.to(x_odd.dtype)))
        else:
            acc += tl.dot(x_even.to(tl.float32), tl.trans(w_even), input_precision="ieee")
            acc += tl.dot(x_odd.to(tl.float32), tl.trans(w_odd), input_precision="ieee")
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        xt = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        wt = tl.load(
            w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
            mask=n_mask[:, None] & k_mask[None, :],
            other=0,
        )
        if FMT == 2:
            wt = wt.to(tl.float8e4nv, bitcast=True)
        if DOT_IN_INPUT:
            acc += tl.dot(xt, tl.trans(wt.to(xt.dtype)))
        else:
            acc += tl.dot(xt.to(tl.float32), tl.trans(wt.to(tl.float32)), input_precision="ieee")
    return acc


@triton.jit
def _gate_up_kernel(
    x_ptr,
    row_token_ptr,  # [Mpad] int64: token of each sorted row, -1 for padding
    block_expert_ptr,  # [Mpad // BLOCK_M] int64
    w_ptr,
    s_ptr,
    z_ptr,
    act_ptr,  # [Mpad, I] out
    H,
    inter,
    stride_xm,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_am,
    FMT: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    GROUP: tl.constexpr,
    DOT_IN_INPUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    token = tl.load(row_token_ptr + offs_m)
    m_mask = token >= 0
    x_rows = x_ptr + tl.where(m_mask, token, 0)[:, None] * stride_xm
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < inter
    w_e = w_ptr + expert * stride_we
    s_e = s_ptr + expert * stride_se
    z_e = z_ptr + expert * stride_se
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        gate = _tile_dot(
            gate, x_rows, m_mask, w_e, s_e, z_e, offs_n, n_mask, k0, H, stride_wn, stride_sn,
            FMT, HAS_ZEROS, GROUP, DOT_IN_INPUT, BLOCK_K,
        )  # fmt: skip
        up = _tile_dot(
            up, x_rows, m_mask, w_e, s_e, z_e, inter + offs_n, n_mask, k0, H, stride_wn, stride_sn,
            FMT, HAS_ZEROS, GROUP, DOT_IN_INPUT, BLOCK_K,
        )  # fmt: skip
    if FMT == 2:
        gate *= tl.load(s_e + offs_n, mask=n_mask, other=0.0)[None, :]
        up *= tl.load(s_e + inter + offs_n, mask=n_mask, other=0.0)[None, :]
    act = gate / (1.0 + tl.exp(-gate)) * up
    out = act_ptr + offs_m[:, None] * stride_am + offs_n[None, :]
    tl.store(out, act.to(act_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _down_kernel(
    act_ptr,
    row_slot_ptr,  # [Mpad] int64: assignment slot t*k + j of each sorted row, -1 for padding
    block_expert_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    route_w_ptr,  # [T*k] float32 routing weights
    y_ptr,  # [T*k, H] out (the activations' dtype)
    H,
    inter,
    stride_am,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_ym,
    FMT: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    GROUP: tl.constexpr,
    DOT_IN_INPUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(row_slot_ptr + offs_m)
    m_mask = slot >= 0
    a_rows = act_ptr + offs_m[:, None] * stride_am
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    w_e = w_ptr + expert * stride_we
    s_e = s_ptr + expert * stride_se
    z_e = z_ptr + expert * stride_se
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        acc = _tile_dot(
            acc, a_rows, m_mask, w_e, s_e, z_e, offs_n, n_mask, k0, inter, stride_wn, stride_sn,
            FMT, HAS_ZEROS, GROUP, DOT_IN_INPUT, BLOCK_K,
        )  # fmt: skip
    if FMT == 2:
        acc *= tl.load(s_e + offs_n, mask=n_mask, other=0.0)[None, :]
    safe_slot = tl.where(m_mask, slot, 0)
    rw = tl.load(route_w_ptr + safe_slot, mask=m_mask, other=0.0)
    out = y_ptr + safe_slot[:, None] * stride_ym + offs_n[None, :]
    tl.store(out, (acc * rw[:, None]).to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _block_m(rows_per_expert: float) -> int:
    """Rows per block: small blocks when each expert gets few rows (decode), larger for prefill."""
    return 16 if rows_per_expert <= 16 else 32 if rows_per_expert <= 32 else 64


def _block_k(k: int, group: int, is_int4: bool) -> int:
    if is_int4:
        return min(group, 64)
    return 64 if k >= 64 else max(16, triton.next_power_of_2(k))


def padded_routing(topk_ids: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor, Tensor]:
    """(row_slot [Mpad], row_token [Mpad], block_expert [Mpad // block_m]) for the sorted layout.

    Only experts that received rows get blocks. One host sync (the per-expert counts).
    """
    k = topk_ids.shape[1]
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    sorted_ids = flat[order]
    counts = torch.bincount(flat, minlength=num_experts)
    blocks = (counts + block_m - 1) // block_m
    blocks_host = blocks.tolist()
    total_blocks = sum(blocks_host)
    pad_start = (torch.cumsum(blocks, 0) - blocks) * block_m
    start = torch.cumsum(counts, 0) - counts
    pos = pad_start[sorted_ids] + torch.arange(flat.numel(), device=device) - start[sorted_ids]
    row_slot = torch.full((total_blocks * block_m,), -1, dtype=torch.int64, device=device)
    row_slot[pos] = order
    row_token = torch.where(row_slot >= 0, row_slot // k, -1)
    block_expert = torch.repeat_interleave(
        torch.arange(num_experts, device=device), blocks, output_size=total_blocks
    )
    return row_slot, row_token, block_expert


_FMT_CODES = {"dense": 0, "int4": 1, "fp8": 2}


def _weight_args(experts, proj: str) -> tuple[Tensor, Tensor, Tensor, int, int]:
    """(weight, scales, zeros, scale stride per expert, scale stride per row) for one projection.

    Unused pointers are filled with the weight itself (never read: the format is a constexpr).
    """
    w = experts.gate_up if proj == "gate_up" else experts.down
    s = experts.gate_up_scales if proj == "gate_up" else experts.down_scales
    z = experts.gate_up_zeros if proj == "gate_up" else experts.down_zeros
    if experts.fmt == "dense":
        return w, w, w, 0, 0
    if experts.fmt == "fp8":
        s = s.float().contiguous()
        return w.view(torch.uint8), s, s, s.stride(0), 1
    return w, s, s if z is None else z, s.stride(0), s.stride(1)


def triton_supports(experts, device: torch.device) -> bool:
    """Whether the Triton kernels take these experts on ``device``.

    Not: INT4 groups outside 32..256, FP8 on a GPU below sm89, stacks whose canonical tensors were
    dropped by ``prepare``.
    """
    if not experts.canonical:
        return False
    if experts.fmt == "int4":
        return experts.group_size % 32 == 0 and experts.group_size <= 256
    if experts.fmt == "fp8" and device.type == "cuda" and not triton_interpreting():
        return torch.cuda.get_device_capability(device) >= (8, 9)
    return experts.fmt in _FMT_CODES


def triton_fused_moe(x: Tensor, topk_weights: Tensor, topk_ids: Tensor, experts) -> Tensor:
    """The fused MoE on Triton for a :class:`~pagoda.kernels.moe.ExpertStack` (see the module doc).

    FP8 experts are weight-only here: activations stay in their dtype, the e4m3 weight bytes are
    decoded in the kernel and the per-channel scale applied in the epilogue.
    """
    if not triton_supports(experts, x.device):
        raise ValueError(f"the Triton MoE kernel does not take these {experts.fmt} experts")
    t, k = topk_ids.shape
    h, i = experts.hidden, experts.intermediate
    fmt = _FMT_CODES[experts.fmt]
    group = experts.group_size if fmt == 1 else 0
    x = x.contiguous()
    block_m = _block_m(t * k / experts.num_experts)
    row_slot, row_token, block_expert = padded_routing(topk_ids, experts.num_experts, block_m)
    mpad = row_slot.numel()
    act_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32
    act = torch.empty(mpad, i, dtype=act_dtype, device=x.device)
    # Every slot's row is written once (all N tiles), so no zero fill; stored in the activations'
    # dtype (half the bytes of float32 for bf16), summed over k in float32.
    y = torch.empty(t * k, h, dtype=act_dtype, device=x.device)
    route_w = topk_weights.reshape(-1).float().contiguous()
    dot_in = dot_in_input_dtype(x)
    has_zeros = fmt == 1 and experts.gate_up_zeros is not None
    gu, gu_s, gu_z, gu_se, gu_sn = _weight_args(experts, "gate_up")
    dw, dw_s, dw_z, dw_se, dw_sn = _weight_args(experts, "down")
    n_blocks = mpad // block_m
    bn1 = min(64, max(16, triton.next_power_of_2(i)))
    _gate_up_kernel[(n_blocks, triton.cdiv(i, bn1))](
        x, row_token, block_expert, gu, gu_s, gu_z, act,
        h, i, x.stride(0), gu.stride(0), gu.stride(1), gu_se, gu_sn, act.stride(0),
        FMT=fmt, HAS_ZEROS=has_zeros, GROUP=group, DOT_IN_INPUT=dot_in,
        BLOCK_M=block_m, BLOCK_N=bn1, BLOCK_K=_block_k(h, group, fmt == 1),
    )  # fmt: skip
    bn2 = min(64, max(16, triton.next_power_of_2(h)))
    _down_kernel[(n_blocks, triton.cdiv(h, bn2))](
        act, row_slot, block_expert, dw, dw_s, dw_z, route_w, y,
        h, i, act.stride(0), dw.stride(0), dw.stride(1), dw_se, dw_sn, y.stride(0),
        FMT=fmt, HAS_ZEROS=has_zeros, GROUP=group, DOT_IN_INPUT=dot_in,
        BLOCK_M=block_m, BLOCK_N=bn2, BLOCK_K=_block_k(i, group, fmt == 1),
    )  # fmt: skip
    return y.view(t, k, h).sum(dim=1, dtype=torch.float32).to(x.dtype)
