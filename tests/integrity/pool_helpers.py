"""A small KV pool and block tables built directly, for integrity tests that need no model."""

from __future__ import annotations

import random

import torch

from pagoda.node_agent.engine.sequence import Sequence
from pagoda.node_agent.kv.pool import KVPagePool, PageRef
from pagoda.node_agent.params import SamplingParams

PAGE = 4


def small_pool(num_pages: int = 48, num_layers: int = 2) -> KVPagePool:
    return KVPagePool(num_layers, num_pages, PAGE, {"k": (1, 4), "v": (1, 4)}, torch.float32)


def fill(pool: KVPagePool, ref: PageRef, rng: random.Random) -> None:
    """Write recognizable content into a page (every layer and component)."""
    for layer in pool.layers:
        for t in layer.values():
            t[ref.page].fill_(rng.random())


def random_sequences(pool: KVPagePool, rng: random.Random, n: int) -> list[Sequence]:
    """n sequences with random block tables; some share a leading page (a cached prefix)."""
    seqs: list[Sequence] = []
    for i in range(n):
        seq = Sequence(f"r{i}", [1, 2, 3], SamplingParams())
        if seqs and seqs[-1].block_table and rng.random() < 0.3:
            shared = seqs[-1].block_table[0]
            pool.incref(shared.page)
            seq.block_table.append(shared)
        for _ in range(rng.randint(0 if seq.block_table else 1, 4)):
            if pool.num_free == 0:
                break
            ref = pool.allocate()
            fill(pool, ref, rng)
            seq.block_table.append(ref)
        seqs.append(seq)
    return seqs
