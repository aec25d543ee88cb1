"""Token selection: greedy, temperature, top-k, top-p, with per-request seeded generators.

A seeded request's generator is a CPU ``torch.Generator`` whatever the compute device (sequence.py):
its state (``get_state()``, a uint8 tensor) has one size on every worker, so a handoff carries it
between CPU and GPU workers alike; the probabilities of a seeded draw move to the CPU for it.
"""

from __future__ import annotations

import torch

from pagoda.node_agent.engine.sequence import Sequence

# Below this, float32 logits / temperature overflow (a subnormal temperature even rounds to 0);
# every temperature this small picks the top token anyway, so it is used in their place.
MIN_TEMPERATURE = 1e-30


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """Pick one token per row of ``logits`` [B, V] following each sequence's parameters."""
    logits = logits.float()
    out = logits.argmax(dim=-1).tolist()
    for i, seq in enumerate(seqs):
        p = seq.params
        if p.greedy:
            continue
        row = logits[i] - logits[i].max()  # <= 0 everywhere: no +inf, so no NaN, at any temperature
        row = row / max(p.temperature, MIN_TEMPERATURE)
        if p.top_k and p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_p, idx = torch.sort(probs, descending=True)
            cum = torch.cumsum(sorted_p, dim=-1)
            drop = cum - sorted_p > p.top_p  # keep the smallest set reaching top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
        gen = seq.generator
        if gen is not None and gen.device != probs.device:
            probs = probs.to(gen.device)  # seeded draws use the sequence's CPU generator on every device
        out[i] = int(torch.multinomial(probs, 1, generator=gen).item())
    return out
