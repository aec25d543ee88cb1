"""KV page integrity: before a step reads the pool, check every mapped page's generation tag.

A separate batched step (not fused into attention): the batch's block tables and expected tags go
to ``pagoda.kernels.integrity.check_page_tags`` with the pool's tag table, which returns a
per-sequence mismatch mask. Mismatching sequences are failed closed by the engine; the rest run.
``off`` installs a no-op tracker that does no work at all.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pagoda.kernels.integrity import check_page_tags, find_mismatches

from .kv_pool import KVPagePool
from .sequence import Sequence
from .step_batch import block_table_tensor

log = logging.getLogger("pagoda.integrity")


class IntegrityError(RuntimeError):
    """A sequence's block table maps a page whose generation tag changed since it was mapped."""


@dataclass
class IntegrityCounters:
    checks: int = 0
    pages_checked: int = 0
    mismatches: int = 0
    requests_aborted: int = 0


class NoopTracker:
    """integrity.mode=off: nothing is checked and nothing is counted."""

    mode = "off"

    def __init__(self) -> None:
        self.counters = IntegrityCounters()

    def check(self, seqs: list[Sequence], pool: KVPagePool) -> dict[Sequence, IntegrityError]:
        return {}


class TagTracker:
    """integrity.mode=enforce: compare expected tags with the tag table for the whole batch."""

    mode = "enforce"

    def __init__(self, backend: str | None = None) -> None:
        self.counters = IntegrityCounters()
        self.backend = backend

    def check(self, seqs: list[Sequence], pool: KVPagePool) -> dict[Sequence, IntegrityError]:
        """Return the sequences whose mapped pages changed, each with a descriptive error."""
        mapped = [s for s in seqs if s.block_table]
        if not mapped:
            return {}
        dev = pool.tag_table.device
        pages, tags = block_table_tensor(mapped, dev)
        counts = torch.tensor([len(s.block_table) for s in mapped], dtype=torch.int32, device=dev)
        mask = check_page_tags(pages, tags, counts, pool.tag_table, backend=self.backend)
        c = self.counters
        c.checks += 1
        c.pages_checked += int(counts.sum())
        if not bool(mask.any()):
            return {}
        bad: dict[Sequence, IntegrityError] = {}
        details = find_mismatches(pages.cpu(), tags.cpu(), counts.cpu(), pool.tag_table.cpu())
        for seq_idx, slot, page, expected, found in details:
            seq = mapped[seq_idx]
            if seq in bad:
                continue
            msg = (
                f"KV integrity check failed for request {seq.request_id}: block {slot} maps page {page} "
                f"with expected generation tag {expected}, found {found}; the request was aborted "
                f"before reading another request's state"
            )
            log.error(msg)
            bad[seq] = IntegrityError(msg)
        for i in torch.nonzero(mask.cpu()).flatten().tolist():  # flagged without detail (e.g. out of range)
            seq = mapped[i]
            bad.setdefault(seq, IntegrityError(f"KV integrity check failed for request {seq.request_id}"))
        c.mismatches += len(bad)
        c.requests_aborted += len(bad)
        return bad


def make_tracker(mode: str, backend: str | None = None) -> NoopTracker | TagTracker:
    if mode == "off":
        return NoopTracker()
    if mode in ("enforce", "audit"):
        return TagTracker(backend)
    raise ValueError(f"unknown integrity mode {mode!r}; accepted: enforce, audit, off")
