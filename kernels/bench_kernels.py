"""Kernel micro-benchmarks (``pagoda bench kernels``): INT4/FP8 vs dense GEMM, FP8/INT8 vs BF16 KV, and
the fused MoE per expert format.

Also home to :func:`kv_scale_granularity_report`, the measurement behind the FP8 KV scale choice.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor

from .cpu_fp8_native import available as fp8_native_available
from .cpu_int4_native import vnni_available
from .dispatch import select_backend
from .fp8 import Fp8Weight
from .fp8_format import FP8_DTYPE, FP8_MAX, amax_scale, quantize_fp8
from .int4 import Int4Weight, pick_group_size, quantize_int4
from .linear import native_available
from .moe import fused_moe, make_expert_stack
from .paged_attention import calibrate_kv_scales, empty_page_scales, paged_decode_attention, write_kv
from .switches import switched_off

# SmolLM2-135M projection shapes (N, K): MLP up/gate and down.
DEFAULT_GEMMS = ((1536, 576), (576, 1536))


def _time(fn: Callable[[], object], device: torch.device, repeat: int, warmup: int = 2) -> float:
    """Median wall time of ``fn`` in microseconds."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def compute_dtype(device: torch.device) -> torch.dtype:
    """bf16 on GPUs, float32 on CPUs (most lack fast bf16 matmuls)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def bench_gemms(
    device: torch.device,
    shapes: tuple[tuple[int, int], ...] = DEFAULT_GEMMS,
    batch_sizes: tuple[int, ...] = (1, 8, 64),
    repeat: int = 20,
) -> list[dict]:
    """Dense vs INT4 vs FP8 linear for each (N, K) and M; times in microseconds."""
    dtype = compute_dtype(device)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n, k in shapes:
        w = torch.randn(n, k, generator=gen).to(device)
        dense = w.to(dtype)
        q4 = quantize_int4(w.cpu(), pick_group_size(k))
        for t in (q4.packed, q4.scales, q4.zeros):
            t.data = t.to(device)
        f8 = Fp8Weight.quantize(w)
        for m in batch_sizes:
            x = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
            q4.apply(x)  # builds/caches backend layouts outside the timed region
            row = {
                "n": n,
                "k": k,
                "m": m,
                "dtype": str(dtype).removeprefix("torch."),
                "dense_us": _time(partial(torch.matmul, x, dense.T), device, repeat),
                "int4_us": _time(partial(q4.apply, x), device, repeat),
                "fp8_us": _time(partial(f8.apply, x), device, repeat),
            }
            if device.type == "cpu" and dtype == torch.float32 and native_available():
                exact = Int4Weight.from_state(q4.state(), q4.meta())
                exact.cpu_compute = "float32"  # the exact float32 kernel (cpu_int4.c); int4_us is bf16
                row["int4_f32_us"] = _time(partial(exact.apply, x), device, repeat)
                if vnni_available():  # the same weight in the VNNI kernel's 16-row layout (cpu_int4_vnni.c)
                    vnni = Int4Weight.from_state(q4.state(), q4.meta())
                    vnni.cpu_compute = "float32"
                    vnni.prepare("cpu")
                    row["int4_vnni_us"] = _time(partial(vnni.apply, x), device, repeat)
            if device.type == "cpu" and fp8_native_available():  # the torch decode the native one replaced
                with switched_off("native_fp8"):
                    row["fp8_torch_decode_us"] = _time(partial(f8.apply, x), device, repeat)
                row["fp8_native_decode_speedup"] = row["fp8_torch_decode_us"] / row["fp8_us"]
            if dtype != torch.bfloat16:  # CPUs: also show bf16 dense, the format INT4 replaces on GPUs
                xb, wb = x.bfloat16(), dense.bfloat16()
                row["dense_bf16_us"] = _time(partial(torch.matmul, xb, wb.T), device, repeat)
            row["int4_speedup"] = row["dense_us"] / row["int4_us"]
            row["fp8_speedup"] = row["dense_us"] / row["fp8_us"]
            rows.append(row)
    return rows


def bench_decode_attention(
    device: torch.device,
    batch_sizes: tuple[int, ...] = (1, 16, 64),
    context: int = 1024,
    q_heads: int = 9,
    kv_heads: int = 3,
    head_dim: int = 64,
    page_size: int = 16,
    repeat: int = 10,
) -> list[dict]:
    """Paged decode attention with a bf16, an fp8 (static scales) and an int8 (page scales) KV
    cache; times in microseconds."""
    gen = torch.Generator().manual_seed(1)
    pages_per_seq = math.ceil(context / page_size)
    rows = []
    for bsz in batch_sizes:
        total = bsz * pages_per_seq
        perm = torch.randperm(total, generator=gen)
        tables = perm.reshape(bsz, pages_per_seq).to(torch.int32).to(device)
        lens = torch.full((bsz,), context, dtype=torch.int32, device=device)
        slots = (tables.long()[:, :, None] * page_size + torch.arange(page_size, device=device)).reshape(-1)
        k = torch.randn(total * page_size, kv_heads, head_dim, generator=gen).to(device)
        v = torch.randn(total * page_size, kv_heads, head_dim, generator=gen).to(device)
        ks, vs = calibrate_kv_scales(k, v)
        q = torch.randn(bsz, q_heads, head_dim, generator=gen).to(device=device, dtype=compute_dtype(device))
        row: dict = {"batch": bsz, "context": context, "q_heads": q_heads, "kv_heads": kv_heads}
        shape = (total, page_size, kv_heads, head_dim)
        tok = tuple(empty_page_scales(total, page_size, kv_heads, device) for _ in range(2))
        kinds = (
            ("bf16", torch.bfloat16, (None, None)),
            ("fp8", FP8_DTYPE, (ks, vs)),
            ("int8", torch.int8, tok),
        )
        for name, dtype, scales in kinds:
            kc = torch.zeros(shape, dtype=dtype, device=device)
            vc = torch.zeros(shape, dtype=dtype, device=device)
            write_kv(kc, vc, k, v, slots, *scales)
            call = partial(paged_decode_attention, q, kc, vc, tables, lens, head_dim**-0.5, *scales)
            row[f"{name}_us"] = _time(call, device, repeat)
            row[f"{name}_kv_bytes"] = kc.nbytes + vc.nbytes  # pages only
        row["fp8_speedup"] = row["bf16_us"] / row["fp8_us"]
        row["int8_speedup"] = row["bf16_us"] / row["int8_us"]
        rows.append(row)
    return rows


# A Qwen3-MoE-like layer scaled down (E experts of H -> I, top-k routing).
DEFAULT_MOE = {"experts": 64, "hidden": 1024, "intermediate": 512, "top_k": 8}


def bench_moe(
    device: torch.device,
    experts: int = DEFAULT_MOE["experts"],
    hidden: int = DEFAULT_MOE["hidden"],
    intermediate: int = DEFAULT_MOE["intermediate"],
    top_k: int = DEFAULT_MOE["top_k"],
    tokens: tuple[int, ...] = (1, 16, 128),
    repeat: int = 10,
) -> list[dict]:
    """``fused_moe`` with dense / INT4 / FP8 experts per token count; times in microseconds."""
    dtype = compute_dtype(device)
    gen = torch.Generator().manual_seed(2)
    e, h, i = experts, hidden, intermediate
    gate, up = (torch.randn(e, i, h, generator=gen) / h**0.5 for _ in range(2))
    down = torch.randn(e, h, i, generator=gen) / i**0.5
    stacks = {}
    for fmt in ("dense", "int4", "fp8"):
        st = make_expert_stack(gate, up, down, fmt, dtype=dtype)
        for name in ("gate_up", "down", "gate_up_scales", "gate_up_zeros", "down_scales", "down_zeros"):
            t = getattr(st, name)
            if t is not None:
                setattr(st, name, t.to(device))
        if select_backend(device) == "cpu":
            st.prepare("cpu", keep_canonical=False)  # as resident in a CPU engine; bytes stay put
        stacks[fmt] = st
    rows = []
    for t in tokens:
        x = torch.randn(t, h, generator=gen).to(device=device, dtype=dtype)
        ids = torch.stack([torch.randperm(e, generator=gen)[:top_k] for _ in range(t)]).to(device)
        w = torch.full((t, top_k), 1.0 / top_k, device=device)
        row: dict = {"tokens": t, **{k: v for k, v in zip(DEFAULT_MOE, (e, h, i, top_k), strict=True)}}
        row["dtype"] = str(dtype).removeprefix("torch.")
        for fmt, st in stacks.items():
            row[f"{fmt}_us"] = _time(partial(fused_moe, x, w, ids, st), device, repeat)
            row[f"{fmt}_bytes"] = st.nbytes()
        rows.append(row)
    return rows


def run_kernel_bench(device: torch.device | str, quick: bool = False, threads: int | None = None) -> dict:
    """All kernel benchmarks on ``device``; ``quick`` shrinks shapes for smoke tests.

    ``threads`` pins torch's CPU threads for the run (1 gives stable numbers on a shared machine:
    with 2 threads and a busy neighbour, every op can stall for a scheduler quantum).
    """
    device = torch.device(device)
    saved = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _run(device, quick)
    finally:
        torch.set_num_threads(saved)


def _run(device: torch.device, quick: bool) -> dict:
    if quick:
        gemms = bench_gemms(device, shapes=((64, 128),), batch_sizes=(1, 8), repeat=2)
        attn = bench_decode_attention(device, batch_sizes=(2,), context=40, repeat=2)
        moe = bench_moe(device, experts=4, hidden=64, intermediate=32, top_k=2, tokens=(3,), repeat=2)
    else:
        gemms = bench_gemms(device)
        attn = bench_decode_attention(device)
        moe = bench_moe(device)
    return {
        "device": str(device),
        "backend": select_backend(device),
        "threads": torch.get_num_threads(),
        "gemm": gemms,
        "decode_attention": attn,
        "moe": moe,
    }


# ------------------------------------------------------------------- KV scale granularity


def _rel_err(x: Tensor, y: Tensor) -> float:
    """Mean over heads of each head's relative error (x, y: [T, H, D])."""
    err = (x - y).norm(dim=(0, 2)) / x.norm(dim=(0, 2)).clamp(min=1e-30)
    return err.mean().item()


def _fp8_roundtrip(x: Tensor, scale: Tensor) -> Tensor:
    return quantize_fp8(x, scale).float() * scale


def kv_scale_granularity_report(
    calib: Tensor, evaluate: Tensor, page_size: int = 16, headroom: float = 1.0
) -> dict[str, float]:
    """FP8 round-trip error of ``evaluate`` [T, H, D] (mean per-head relative error) by granularity.

    ``static_head`` calibrates on ``calib`` (another text) - the shipped scheme; ``per_page`` and
    ``per_token`` use the data's own amax per (page, head) / (token, head); ``per_tensor`` is one
    scale for the whole layer. Also reports the fraction of ``evaluate`` values clipped by the
    static scale.
    """
    x = evaluate.float()
    t, h, d = x.shape
    static = amax_scale(calib.float().abs().amax(dim=(0, 2)), headroom)  # [H]
    pad = (-t) % page_size
    paged = torch.cat([x, x.new_zeros(pad, h, d)]).reshape(-1, page_size, h, d)
    page_scale = amax_scale(paged.abs().amax(dim=(1, 3), keepdim=True))
    per_page = _fp8_roundtrip(paged, page_scale).reshape(-1, h, d)[:t]
    return {
        "static_head": _rel_err(x, _fp8_roundtrip(x, static[:, None])),
        "static_head_clipped": (x.abs() > static[:, None] * FP8_MAX).float().mean().item(),
        "per_page": _rel_err(x, per_page),
        "per_token": _rel_err(x, _fp8_roundtrip(x, amax_scale(x.abs().amax(dim=2, keepdim=True)))),
        "per_tensor": _rel_err(x, _fp8_roundtrip(x, amax_scale(x.abs().amax()))),
    }


def kv_bytes_per_token(kv_heads: int, head_dim: int, granularity: str, page_size: int = 16) -> float:
    """K+V bytes per token for an fp8 cache including float32 scales at ``granularity``."""
    data = 2 * kv_heads * head_dim
    extra = {"static_head": 0.0, "per_page": 2 * kv_heads * 4 / page_size, "per_token": 2 * kv_heads * 4}
    return data + extra[granularity]
