"""Two gloo ranks moving KV pages as a tensor-parallel replica does for a handoff, without a model:
rank 0 splits a whole-head payload by head (SCATTER), each rank converts its heads into its own FP8
pool, then rank 0 gathers every rank's heads back (GATHER). Each rank's result is compared with one
whole pool that took the same payload (started by test_tp_disagg.py)."""

from __future__ import annotations

import datetime
import traceback
from types import SimpleNamespace

import torch
import torch.distributed as dist

from pagoda.node_agent.engine.handoff import convert_into, extract_pages
from pagoda.node_agent.engine.kv_pool import KVPagePool, PageRef
from pagoda.node_agent.engine.parallel_steps import (
    _concat_heads,
    _recv_pages,
    _send_pages,
    _slice_heads,
)

LAYERS, PAGES, PAGE, DIM = 2, 6, 4, 8
HEADS = 3  # as the built-in model: rank 0 holds 2 KV heads, rank 1 holds 1
SPLIT = [(0, 2), (2, 3)]
FP8 = torch.float8_e4m3fn
REFS = [PageRef(p, 0) for p in (4, 1, 2)]  # arriving pages land out of order


def fp8_pool(heads: int) -> KVPagePool:
    """An FP8 pool with per-token K scales and static per-head V scales (the decode default)."""
    comps = {"k": (heads, DIM), "v": (heads, DIM)}
    pool = KVPagePool(LAYERS, PAGES, PAGE, comps, FP8, kv_format="fp8_e4m3", name="d", token_scaled=("k",))
    pool.replica_components = {"k": (HEADS, DIM), "v": (HEADS, DIM)}
    return pool


def payloads() -> dict[str, tuple[list, list | None]]:
    """Whole-head payloads as a TP=1 prefill worker sends them: float32 (bf16 KV of a float32
    engine), and FP8 with per-token K scales and static V scales."""
    g = torch.Generator().manual_seed(0)
    n = len(REFS)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    dense = [{c: rand(n, PAGE, HEADS, DIM) for c in ("k", "v")} for _ in range(LAYERS)]
    fp8 = [
        {
            "k": rand(n, PAGE, HEADS, DIM).to(FP8),
            "k.scale": rand(n, PAGE, HEADS).abs().to(torch.bfloat16),
            "v": rand(n, PAGE, HEADS, DIM).to(FP8),
        }
        for _ in range(LAYERS)
    ]
    fp8_scales = [{"v": rand(HEADS).abs() + 0.1} for _ in range(LAYERS)]
    return {"float32": (dense, None), "fp8": (fp8, fp8_scales)}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[c].contiguous().view(torch.uint8), b[c].contiguous().view(torch.uint8)) for c in a
    )


def run(rank: int, port: int, results) -> None:
    """One rank: every payload scattered, converted and gathered back; puts (rank, errors)."""
    errors: list[str] = []
    try:
        store = dist.TCPStore(
            "127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=60)
        )
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
        group = SimpleNamespace(rank=rank, world=2, data=dist.group.WORLD, cpu=dist.group.WORLD)
        h0, h1 = SPLIT[rank]
        for name, (layers, scales) in payloads().items():
            whole = fp8_pool(HEADS)  # one rank holding every head: what each rank must match
            pool = fp8_pool(h1 - h0)
            for w, p in zip(whole.static_scales, pool.static_scales, strict=True):  # calibrated V
                w["v"].copy_(torch.tensor([0.5, 1.0, 2.0]))
                p["v"].copy_(w["v"][h0:h1])
            convert_into(whole, REFS, layers, scales)
            if rank == 0:  # SCATTER
                _send_pages(pool, _slice_heads(layers, scales, SPLIT[1]), 1, group)
                mine = _slice_heads(layers, scales, SPLIT[0])
            else:
                mine = _recv_pages(pool, len(REFS), h1 - h0, 0, group)
            convert_into(pool, REFS, *mine)
            for li in range(LAYERS):
                want = {c: t[:, :, h0:h1] for c, t in whole.layers[li].items()}
                if not same(pool.layers[li], want):
                    errors.append(f"{name}: rank {rank}'s pages of layer {li} differ from the whole pool's")
            if rank == 1:  # GATHER
                _send_pages(pool, extract_pages(pool, REFS), 0, group)
                continue
            theirs = _recv_pages(pool, len(REFS), SPLIT[1][1] - SPLIT[1][0], 1, group)
            got_layers, got_scales = _concat_heads([extract_pages(pool, REFS), theirs])
            want_layers, want_scales = extract_pages(whole, REFS)
            if not all(same(a, b) for a, b in zip(got_layers, want_layers, strict=True)):
                errors.append(f"{name}: gathered pages differ from the whole pool's")
            if not all(same(a, b) for a, b in zip(got_scales, want_scales, strict=True)):
                errors.append(f"{name}: gathered static scales differ from the whole pool's")
        dist.destroy_process_group()
    except Exception:
        errors.append(traceback.format_exc())
    results.put((rank, errors))
