"""KV page integrity: before a step reads the pool, check every mapped page's generation tag.

A separate batched step (not fused into attention): the batch's block tables and expected tags go
to ``pagoda.kernels.integrity.check_page_tags`` with the pool's tag table, which returns a
per-sequence mismatch mask. Mismatching sequences are failed closed by the engine; the rest run.
``off`` installs a no-op tracker that does no work at all. ``audit`` adds a checksum of every
sealed page (page_checksum.py), recorded at seal time and verified on prefix reuse and handoff.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import torch

from pagoda.kernels.integrity import check_page_tags, find_mismatches
from pagoda.node_agent.engine.block_tables import block_table_tensor
from pagoda.node_agent.engine.page_checksum import payload_checksums, pool_page_checksums
from pagoda.node_agent.engine.sequence import Sequence
from pagoda.node_agent.kv.pool import KVPagePool, PageRef

log = logging.getLogger("pagoda.integrity")


def expected_tables(
    seqs: list[Sequence], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """[B, max_pages] pages and expected tags (0-padded) and per-sequence page counts."""
    pages, tags = block_table_tensor(seqs, device)
    return pages, tags, [len(s.block_table) for s in seqs]


class IntegrityError(RuntimeError):
    """A sequence's KV pages cannot be trusted (a changed generation tag or, in audit, checksum)."""


@dataclass
class IntegrityCounters:
    checks: int = 0  # batched tag checks run
    pages_checked: int = 0  # block-table entries compared
    mismatches: int = 0  # sequences with a tag mismatch
    requests_aborted: int = 0  # requests failed closed (tag or checksum)
    pages_audited: int = 0  # audit: sealed pages checksummed or verified
    checksum_mismatches: int = 0  # audit: pages whose bytes changed after sealing


class NoopTracker:
    """integrity.mode=off: nothing is checked and nothing is counted."""

    mode = "off"

    def __init__(self) -> None:
        self.counters = IntegrityCounters()

    def check(
        self, seqs: list[Sequence], pool: KVPagePool, tables: tuple | None = None
    ) -> dict[Sequence, IntegrityError]:
        return {}

    def sealed(self, seq: Sequence, pool: KVPagePool) -> None:
        """Called after a step sealed full pages of ``seq``; audit records their checksums."""

    def payload_meta(self, layers: list[dict[str, torch.Tensor]]) -> dict:
        """Metadata a handoff payload carries (audit: per-page checksums)."""
        return {}

    def verify_payload(self, request_id: str, layers: list[dict[str, torch.Tensor]], meta: dict) -> None:
        """Raise IntegrityError when a received payload's pages do not match their checksums."""


class TagTracker(NoopTracker):
    """integrity.mode=enforce: compare expected tags with the tag table for the whole batch."""

    mode = "enforce"

    def __init__(self, backend: str | None = None) -> None:
        super().__init__()
        self.backend = backend

    def check(
        self, seqs: list[Sequence], pool: KVPagePool, tables: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> dict[Sequence, IntegrityError]:
        """Return the sequences whose mapped pages changed, each with a descriptive error.

        ``tables``: the (pages, tags) block tables of ``seqs`` when the caller built them already."""
        mapped = [s for s in seqs if s.block_table]
        if not mapped:
            return {}
        dev = pool.tag_table.device
        if tables is not None and len(mapped) == len(seqs):
            pages, tags = tables
            counts = [len(s.block_table) for s in seqs]
        else:
            pages, tags, counts = expected_tables(mapped, dev)
        counts_t = torch.tensor(counts, dtype=torch.int32, device=dev)
        mask = check_page_tags(pages, tags, counts_t, pool.tag_table, backend=self.backend)
        c = self.counters
        c.checks += 1
        c.pages_checked += sum(counts)
        if not bool(mask.any()):
            return {}
        bad: dict[Sequence, IntegrityError] = {}
        details = find_mismatches(pages.cpu(), tags.cpu(), counts_t.cpu(), pool.tag_table.cpu())
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


class AuditTracker(TagTracker):
    """integrity.mode=audit: enforce, plus checksums of sealed pages verified on reuse and handoff."""

    mode = "audit"

    def __init__(self, backend: str | None = None) -> None:
        super().__init__(backend)
        # (pool name, page) -> (tag, checksum) of the page's content when it was sealed
        self.records: dict[tuple[str, int], tuple[int, int]] = {}
        # per sequence: (the block-table list seen, how many leading sealed slots are audited)
        self._done: weakref.WeakKeyDictionary[Sequence, tuple[list[PageRef], int]] = (
            weakref.WeakKeyDictionary()
        )

    def _pending(self, seq: Sequence) -> tuple[int, int]:
        """Slots [start, end) of sealed pages of ``seq`` not yet checksummed or verified."""
        table, n = self._done.get(seq, (None, 0))
        start = n if table is seq.block_table else 0
        return start, min(len(seq.page_hashes), len(seq.block_table))

    def check(
        self, seqs: list[Sequence], pool: KVPagePool, tables: tuple | None = None
    ) -> dict[Sequence, IntegrityError]:
        bad = super().check(seqs, pool, tables)
        todo: list[tuple[Sequence, PageRef, int]] = []
        for seq in seqs:
            if seq in bad:
                continue
            start, end = self._pending(seq)
            for ref in seq.block_table[start:end]:
                rec = self.records.get((pool.name, ref.page))
                if rec is not None and rec[0] == ref.tag:
                    todo.append((seq, ref, rec[1]))
            self._done[seq] = (seq.block_table, max(start, end))
        if not todo:
            return bad
        sums = pool_page_checksums(pool, [ref.page for _, ref, _ in todo])
        self.counters.pages_audited += len(todo)
        for (seq, ref, want), got in zip(todo, sums, strict=True):
            if got == want:
                continue
            self.counters.checksum_mismatches += 1
            pool.uncache(ref.page)  # never hand this page to another request
            self.records.pop((pool.name, ref.page), None)
            if seq in bad:
                continue
            msg = (
                f"KV integrity audit failed for request {seq.request_id}: cached page {ref.page} "
                f"(tag {ref.tag}) changed since it was sealed (checksum {want:#x}, found {got:#x}); "
                f"the request was aborted before reading it"
            )
            log.error(msg)
            bad[seq] = IntegrityError(msg)
            self.counters.requests_aborted += 1
        return bad

    def sealed(self, seq: Sequence, pool: KVPagePool) -> None:
        start, end = self._pending(seq)
        if end <= start:
            return
        refs = seq.block_table[start:end]
        for ref, s in zip(refs, pool_page_checksums(pool, [r.page for r in refs]), strict=True):
            self.records[(pool.name, ref.page)] = (ref.tag, s)
        self.counters.pages_audited += len(refs)
        self._done[seq] = (seq.block_table, end)

    def payload_meta(self, layers: list[dict[str, torch.Tensor]]) -> dict:
        return {"page_checksums": payload_checksums(layers)}

    def verify_payload(self, request_id: str, layers: list[dict[str, torch.Tensor]], meta: dict) -> None:
        want = meta.get("page_checksums")
        if want is None:
            return  # the sender did not audit; tags still guard the fresh pages
        got = payload_checksums(layers)
        self.counters.pages_audited += len(got)
        bad = [i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b]
        if len(want) != len(got) or bad:
            self.counters.checksum_mismatches += max(1, len(bad))
            self.counters.requests_aborted += 1
            msg = (
                f"KV integrity audit failed for request {request_id}: handoff pages {bad[:8]} do not "
                f"match the sender's checksums; the request was aborted"
            )
            log.error(msg)
            raise IntegrityError(msg)


def release_owned(seq: Sequence, pool: KVPagePool, live: list[Sequence]) -> list[PageRef]:
    """Release the page references a failed sequence provably owns; returns those left alone.

    A reference owns a count of its page only in the page's current generation (a page is
    reallocated only after its last reference went). An entry whose tag no longer matches is
    released only when the page holds more references than every other live block table accounts
    for (the extra one is this sequence's, its expected tag corrupted); otherwise it belongs to the
    page's new owner and must not be touched.
    """
    kept: list[PageRef] = []
    for ref in seq.block_table:
        page = ref.page
        if not 0 <= page < pool.num_pages or pool.refcount[page] == 0:
            kept.append(ref)
            continue
        if ref.tag != pool.current_tag(page):
            tag = pool.current_tag(page)
            accounted = sum(
                1
                for s in live
                if s is not seq and s.pool_name == seq.pool_name
                for r in s.block_table
                if r.page == page and r.tag == tag
            )
            if pool.refcount[page] <= accounted:
                kept.append(ref)
                continue
        pool.release(page)
    seq.block_table = []
    if kept:
        log.warning("integrity: %s: left %d stale page references alone", seq.request_id, len(kept))
    return kept


def make_tracker(mode: str, backend: str | None = None) -> NoopTracker:
    if mode == "off":
        return NoopTracker()
    if mode == "enforce":
        return TagTracker(backend)
    if mode == "audit":
        return AuditTracker(backend)
    raise ValueError(f"unknown integrity mode {mode!r}; accepted: enforce, audit, off")
