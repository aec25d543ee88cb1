"""Fault injection for integrity tests and operators' drills (off by default).

Each fault reproduces a bookkeeping bug the integrity layer must catch: a live sequence mapping a
page that was freed and reallocated (use-after-free), a corrupted expected tag, and a sealed page
whose bytes changed. The pool-level functions work on any pool and block table; ``FaultInjector``
applies them to a running engine by request id, at once or armed for a request's next decode step
(or the next N requests to decode: ``FaultArming``). An engine exposes one as ``engine.faults`` only
when ``EngineConfig.fault_injection`` is set (``--enable-fault-injection``); the public API never
reaches it (the drill's endpoint is internal and authenticated: serving/worker/fault_drill.py).
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass

import torch

from pagoda.node_agent.engine.sequence import Sequence
from pagoda.node_agent.kv.pool import KVPagePool, PageRef


class FaultInjectionError(RuntimeError):
    """Fault injection is disabled, or the requested fault cannot be applied."""


@dataclass(frozen=True)
class Fault:
    """What was injected: kind, request (if any), block slot, page, and the tags involved."""

    kind: str
    request_id: str | None
    slot: int
    page: int
    expected_tag: int
    current_tag: int


def _reallocate(pool: KVPagePool, page: int) -> None:
    """Take an unreferenced page through one allocation and release (its tag moves on)."""
    if pool.refcount[page]:
        raise FaultInjectionError(f"page {page} is still referenced")
    if page in pool.evictable:
        pool.uncache(page)  # unindexed; joins the free list
    pool.free.remove(page)
    pool.free.appendleft(page)
    ref = pool.allocate()
    assert ref.page == page
    pool.release(page)


def _slot(seq: Sequence, slot: int | None, rng: random.Random) -> int:
    if not seq.block_table:
        raise FaultInjectionError(f"request {seq.request_id} maps no KV page yet")
    if slot is None:
        return rng.randrange(len(seq.block_table))
    if not 0 <= slot < len(seq.block_table):
        raise FaultInjectionError(f"request {seq.request_id} has no block {slot}")
    return slot


def make_stale(
    pool: KVPagePool, seq: Sequence, slot: int | None = None, rng: random.Random | None = None
) -> Fault:
    """Use-after-free: drop the sequence's reference to a mapped page while it stays mapped, and
    let the page be reallocated. A shared page cannot be reallocated while others hold it, so the
    slot is then remapped to another unreferenced page, as of before that page's reallocation."""
    rng = rng or random.Random()
    i = _slot(seq, slot, rng)
    ref = seq.block_table[i]
    if pool.refcount[ref.page] == 1:
        target = ref.page
    else:
        spare = [p for p in pool.free] + list(pool.evictable)
        if not spare:
            raise FaultInjectionError("no unreferenced page to reallocate")
        target = rng.choice(spare)
    stale = PageRef(target, pool.current_tag(target) if target != ref.page else ref.tag)
    pool.release(ref.page)  # the bug: the reference goes while the block table still maps it
    _reallocate(pool, target)
    seq.block_table[i] = stale
    return Fault("stale_mapping", seq.request_id, i, target, stale.tag, pool.current_tag(target))


def flip_expected_tag(seq: Sequence, slot: int | None = None, rng: random.Random | None = None) -> Fault:
    """Corrupt one expected tag in the block table (one bit flipped); the page itself is untouched."""
    rng = rng or random.Random()
    i = _slot(seq, slot, rng)
    ref = seq.block_table[i]
    flipped = ref.tag ^ (1 << rng.randrange(31))
    seq.block_table[i] = PageRef(ref.page, flipped)
    return Fault("flip_tag", seq.request_id, i, ref.page, flipped, ref.tag)


def corrupt_page(pool: KVPagePool, page: int, rng: random.Random | None = None) -> Fault:
    """Flip one bit of one byte of a page (random layer and component); its tag is unchanged."""
    rng = rng or random.Random()
    layer = pool.layers[rng.randrange(pool.num_layers)]
    t = layer[rng.choice(sorted(layer))][page]
    raw = t.view(torch.uint8).view(-1)
    j = rng.randrange(raw.numel())
    raw[j] ^= 1 << rng.randrange(8)
    tag = pool.current_tag(page)
    return Fault("corrupt_page", None, -1, page, tag, tag)


class FaultInjector:
    """``engine.faults`` when fault injection is enabled: inject faults into live requests."""

    enabled = True

    def __init__(self, engine, seed: int = 0) -> None:
        self.engine = engine
        self.rng = random.Random(seed)
        self.injected: list[Fault] = []
        self.arming = FaultArming(self)

    def _seq(self, request_id: str) -> Sequence:
        seq = self.engine.sequence(request_id)
        if seq is None:
            raise FaultInjectionError(f"no live request {request_id!r}")
        return seq

    def _record(self, fault: Fault) -> Fault:
        self.injected.append(fault)
        return fault

    def stale_mapping(self, request_id: str, slot: int | None = None) -> Fault:
        """Make the request map a page that was freed and reallocated (use-after-free)."""
        seq = self._seq(request_id)
        return self._record(make_stale(self.engine.scheduler.pool_of(seq), seq, slot, self.rng))

    def flip_tag(self, request_id: str, slot: int | None = None) -> Fault:
        """Flip one bit of the request's expected tag for block ``slot``."""
        return self._record(flip_expected_tag(self._seq(request_id), slot, self.rng))

    def drift_rank_tag(self, request_id: str, rank: int, slot: int | None = None) -> Fault:
        """Tensor parallelism: move one page's tag on tensor-parallel rank ``rank`` alone (as if that
        rank had missed or doubled an allocation); the request must fail on every rank."""
        seq = self._seq(request_id)
        replica = self.engine.replica
        if not 0 < rank < replica.world:
            raise FaultInjectionError(f"no tensor-parallel rank {rank} other than 0 in this replica")
        s = _slot(seq, slot, self.rng)
        ref = seq.block_table[s]
        replica.drift_tag(rank, self.engine.scheduler.pool_of(seq), ref.page)
        return self._record(Fault("drift_rank_tag", request_id, s, ref.page, ref.tag, ref.tag))

    def corrupt_sealed_page(self, page: int | None = None) -> Fault:
        """Change the bytes of a page in the prefix cache (any cached page when ``page`` is None)."""
        pool = self.engine.scheduler.prefill_pool
        if page is None:
            if not pool.page_hash:
                raise FaultInjectionError("the prefix cache holds no sealed page")
            page = self.rng.choice(sorted(pool.page_hash))
        elif page not in pool.page_hash:
            raise FaultInjectionError(f"page {page} is not a sealed prefix-cache page")
        return self._record(corrupt_page(pool, page, self.rng))


ARMABLE = ("stale_mapping", "flip_tag")  # faults aimed at a request's own block table
MAX_ARMED = 1000  # faults waiting for their victims at once


@dataclass
class Armed:
    """Faults waiting for victims: ``request_id``'s next decode step, or the next ``count``
    requests to reach a decode step (``request_id`` None)."""

    kind: str
    request_id: str | None
    count: int = 1


class FaultArming:
    """The faults armed from outside the engine thread (the drill endpoint), applied on it before
    each step by ``apply``: a victim is a decoding sequence with a page mapped, each hit once."""

    def __init__(self, injector: FaultInjector) -> None:
        self.injector = injector
        self.pending: list[Armed] = []
        self.hit: set[str] = set()  # request ids already given a fault by arming
        self._lock = threading.Lock()

    def arm(self, kind: str, request_id: str | None = None, count: int = 1) -> Armed:
        if kind not in ARMABLE:
            raise FaultInjectionError(f"fault kind {kind!r} cannot be armed; one of {ARMABLE}")
        if not 1 <= count <= MAX_ARMED:
            raise FaultInjectionError(f"count must be in [1, {MAX_ARMED}]")
        with self._lock:
            if sum(a.count for a in self.pending) + count > MAX_ARMED:
                raise FaultInjectionError(f"at most {MAX_ARMED} faults may wait at once")
            armed = Armed(kind, request_id, 1 if request_id else count)
            self.pending.append(armed)
        return armed

    def waiting(self) -> list[Armed]:
        with self._lock:
            return [Armed(a.kind, a.request_id, a.count) for a in self.pending]

    def apply(self) -> list[Fault]:
        """Inject the armed faults whose victims are decoding now (engine thread)."""
        with self._lock:
            if not self.pending:
                return []
            victims = [
                s
                for s in self.injector.engine.scheduler.running
                if s.block_table and s.output_token_ids and s.request_id not in self.hit
            ]
            done = []
            for armed in self.pending:
                for seq in [s for s in victims if armed.request_id in (None, s.request_id)][: armed.count]:
                    try:
                        done.append(getattr(self.injector, armed.kind)(seq.request_id))
                    except FaultInjectionError:
                        continue  # not applicable to this one (e.g. no page to reallocate): the next
                    self.hit.add(seq.request_id)
                    victims.remove(seq)
                    armed.count -= 1
            self.pending = [a for a in self.pending if a.count > 0]
        return done


class DisabledFaults:
    """``engine.faults`` by default: every use raises."""

    enabled = False

    def __getattr__(self, name: str):
        raise FaultInjectionError(
            "fault injection is disabled; enable it only for tests and drills with "
            "EngineConfig(fault_injection=True) or --enable-fault-injection"
        )


def make_faults(engine, enabled: bool) -> FaultInjector | DisabledFaults:
    return FaultInjector(engine, seed=engine.config.seed) if enabled else DisabledFaults()
