"""The bf16 -> fp8 conversion at the prefill -> decode migration, checked on engine pages."""

from __future__ import annotations

import torch

from pagoda.kernels.paged_attention import write_kv
from pagoda.node_agent.engine.handoff import extract_pages, migrate
from pagoda.node_agent.engine.scheduler import ScheduledStep
from pagoda.node_agent.engine.sequence import Sequence
from pagoda.node_agent.params import SamplingParams

TEXT = "Pages of a key-value cache move from the prefill pool to the decode pool, converted on the way."


def _prefill_into(engine, pool, ids):
    """Prefill ``ids`` into fresh pages of ``pool`` with the prefill weights; returns the refs."""
    seq = Sequence("conv", ids, SamplingParams(max_tokens=1))
    seq.block_table = pool.allocate_pages(-(-len(ids) // pool.page_size))
    batch, _ = engine.runner.build_batch(ScheduledStep("prefill", [seq], [len(ids)]), pool)
    engine.model.forward_no_logits(batch)
    return seq.block_table


def _bytes(layers, n):
    """Per layer and component: the first n token slots as raw bytes."""
    return [{c: t.flatten(0, 1)[:n].view(torch.uint8) for c, t in layer.items()} for layer in layers]


def test_migrated_pages_equal_fp8_written_directly(fp8_kv_engine) -> None:
    eng = fp8_kv_engine
    src, dst = eng.prefill_pool, eng.decode_pool
    assert src.kv_format == "bf16" and dst.kv_format == "fp8_e4m3" and src is not dst
    ids = eng.tokenize(TEXT)
    n = len(ids)
    refs = _prefill_into(eng, src, ids)
    dense, _ = extract_pages(src, refs)
    moved = migrate(src, dst, refs)
    migrated = _bytes(extract_pages(dst, moved)[0], n)
    # the same K/V written straight into fresh fp8 pages (the path decode steps take)
    direct_refs = dst.allocate_pages(len(moved))
    slots = torch.tensor(
        [direct_refs[i // dst.page_size].page * dst.page_size + i % dst.page_size for i in range(n)]
    )
    for li, layer in enumerate(dense):
        k, v = layer["k"].flatten(0, 1)[:n], layer["v"].flatten(0, 1)[:n]
        sc = dst.scales[li]
        write_kv(dst.layers[li]["k"], dst.layers[li]["v"], k, v, slots, sc["k"], sc["v"])
    direct = _bytes(extract_pages(dst, direct_refs)[0], n)
    for li in range(len(migrated)):
        for c in ("k", "v"):
            assert torch.equal(migrated[li][c], direct[li][c]), (li, c)
    # prefilling straight into the fp8 pool: layer 0 (whose K/V no attention has touched yet) is
    # byte-identical; later layers read quantized KV in attention, so they drift slightly
    straight_refs = _prefill_into(eng, dst, ids)
    straight = _bytes(extract_pages(dst, straight_refs)[0], n)
    for c in ("k", "v"):
        assert torch.equal(straight[0][c], migrated[0][c])
    same = sum(int((straight[li][c] == migrated[li][c]).sum()) for li in range(len(straight)) for c in "kv")
    total = sum(straight[li][c].numel() for li in range(len(straight)) for c in "kv")
    assert same / total > 0.5
    for pool, r in ((dst, moved), (dst, direct_refs), (dst, straight_refs)):
        pool.release_all(r)
    dst.check_idle()
    src.check_idle()
