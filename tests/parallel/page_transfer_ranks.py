"""Two gloo ranks moving KV pages as a tensor-parallel decode or prefill replica does, without a
model: rank 0's ParallelDriver splits a whole-head payload by head (SCATTER), each rank converts
its heads into its own FP8 pool, then rank 0 gathers every rank's heads back (GATHER) while rank 1
runs the Follower loop. Each rank's pages are compared with one whole pool that took the same
payload (started by test_tp_disagg.py)."""

from __future__ import annotations

import datetime
import traceback
from types import SimpleNamespace

import torch
import torch.distributed as dist

from pagoda.node_agent.engine.handoff import convert_into, extract_pages
from pagoda.node_agent.engine.parallel.steps import Follower, ParallelDriver
from pagoda.node_agent.kv.pool import KVPagePool, PageRef

LAYERS, PAGES, PAGE, DIM = 2, 6, 4, 8
FP8 = torch.float8_e4m3fn
# (KV heads, each rank's heads): the built-in model's 3 heads as 2 + 1, and one KV head that both
# ranks hold (fewer KV heads than ranks: replicated, its query heads split)
LAYOUTS = [(3, [(0, 2), (2, 3)]), (1, [(0, 1), (0, 1)])]
REFS = [PageRef(p, 0) for p in (4, 1, 2)]  # arriving pages land out of order


def fp8_pool(heads: int, whole: int) -> KVPagePool:
    """An FP8 pool of ``heads`` KV heads (of ``whole``) with per-token K scales and static V scales."""
    comps = {"k": (heads, DIM), "v": (heads, DIM)}
    pool = KVPagePool(LAYERS, PAGES, PAGE, comps, FP8, kv_format="fp8_e4m3", name="d", token_scaled=("k",))
    pool.replica_components = {"k": (whole, DIM), "v": (whole, DIM)}
    return pool


def payloads(heads: int) -> dict[str, tuple[list, list | None]]:
    """Whole-head payloads as a TP=1 prefill worker sends them: float32 (bf16 KV of a float32
    engine), and FP8 with per-token K scales and static V scales."""
    g = torch.Generator().manual_seed(heads)
    n = len(REFS)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    dense = [{c: rand(n, PAGE, heads, DIM) for c in ("k", "v")} for _ in range(LAYERS)]
    fp8 = [
        {
            "k": rand(n, PAGE, heads, DIM).to(FP8),
            "k.scale": rand(n, PAGE, heads).abs().to(torch.bfloat16),
            "v": rand(n, PAGE, heads, DIM).to(FP8),
        }
        for _ in range(LAYERS)
    ]
    fp8_scales = [{"v": rand(heads).abs() + 0.1} for _ in range(LAYERS)]
    return {"float32": (dense, None), "fp8": (fp8, fp8_scales)}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[c].contiguous().view(torch.uint8), b[c].contiguous().view(torch.uint8)) for c in a
    )


def run(rank: int, port: int, results) -> None:
    """One rank: every payload of every layout scattered, converted and gathered; puts (rank, errors)."""
    errors: list[str] = []
    try:
        timeout = datetime.timedelta(seconds=60)
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
        world = dist.group.WORLD
        group = SimpleNamespace(
            rank=rank,
            world=2,
            control=None,
            data=world,
            cpu=world,
            timeout_s=60.0,
            ack=lambda seq: None,
            describe_failure=lambda exc, seq: f"instruction #{seq}: {exc}",
        )
        model = SimpleNamespace(device=torch.device("cpu"))
        for heads, split in LAYOUTS:
            h0, h1 = split[rank]
            for name, (layers, scales) in payloads(heads).items():
                case = f"{heads} heads, {name}"
                whole = fp8_pool(heads, heads)  # one rank holding every head: what each must match
                pool = fp8_pool(h1 - h0, heads)
                for w, p in zip(whole.static_scales, pool.static_scales, strict=True):  # calibrated V
                    w["v"].copy_(torch.linspace(0.5, 2.0, heads))
                    p["v"].copy_(w["v"][h0:h1])
                convert_into(whole, REFS, layers, scales)
                gathered = None
                if rank == 0:
                    driver = ParallelDriver(group, model, pool, pool, split, None)
                    driver.scatter_pages(pool, REFS, layers, scales)
                    gathered = driver.gather_pages(pool, REFS)
                    driver.stop()
                elif (code := Follower(group, model, pool, pool, None).run()) != 0:
                    errors.append(f"{case}: rank 1's follower ended with {code}")
                for li in range(LAYERS):
                    want = {c: t[:, :, h0:h1] for c, t in whole.layers[li].items()}
                    if not same(pool.layers[li], want):
                        errors.append(
                            f"{case}: rank {rank}'s pages of layer {li} differ from the whole pool's"
                        )
                if gathered is not None:
                    want_layers, want_scales = extract_pages(whole, REFS)
                    if not all(same(a, b) for a, b in zip(gathered[0], want_layers, strict=True)):
                        errors.append(f"{case}: gathered pages differ from the whole pool's")
                    if not all(same(a, b) for a, b in zip(gathered[1], want_scales, strict=True)):
                        errors.append(f"{case}: gathered static scales differ from the whole pool's")
        dist.destroy_process_group()
    except Exception:
        errors.append(traceback.format_exc())
    results.put((rank, errors))
