"""Token masks of a step's constrained rows, applied to the batch's logits in one call.

One bitmask [batch, ceil(vocab / 32)] (int32, on the CPU) is filled for the constrained rows by
xgrammar's batch matcher, moved to the logits' device and applied with one
``apply_token_bitmask_inplace(..., indices=rows)``: a forbidden token's logit becomes -inf, so every
selection rule after it (greedy, temperature, top-k, top-p) picks among allowed tokens only.
Unconstrained rows are untouched; a batch without constraints costs one scan of its sequences.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass
class MaskStats:
    """Time spent filling and applying masks (read by ``pagoda bench guided``)."""

    calls: int = 0
    rows: int = 0
    seconds: float = 0.0


stats = MaskStats()
_batch_matcher = None


def apply_grammar_masks(logits: torch.Tensor, seqs: list) -> None:
    """Mask in place the logits [B, V] of every sequence of ``seqs`` (row i) that has a grammar."""
    rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
    if not rows:
        return
    import xgrammar as xgr

    global _batch_matcher
    t0 = time.perf_counter()
    if _batch_matcher is None:
        _batch_matcher = xgr.BatchGrammarMatcher()
    vocab = seqs[rows[0]].grammar.vocab_size  # one vocabulary per engine
    bitmask = xgr.allocate_token_bitmask(len(seqs), vocab)
    _batch_matcher.batch_fill_next_token_bitmask([seqs[i].grammar.matcher for i in rows], bitmask, rows)
    xgr.apply_token_bitmask_inplace(
        logits, bitmask.to(logits.device, non_blocking=True), vocab_size=vocab, indices=rows
    )
    if logits.shape[-1] > vocab:  # padded logits past the vocabulary: never a constrained pick
        logits[rows, vocab:] = float("-inf")
    stats.calls += 1
    stats.rows += len(rows)
    stats.seconds += time.perf_counter() - t0
