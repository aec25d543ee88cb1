"""What rank 0 of a tensor-parallel replica tells the other ranks, and how they follow.

Rank 0 owns the scheduler, the allocators and every request. Each instruction it broadcasts (on the
control group) is a fixed int64 header and an int64 body; no object is ever unpickled:

- every instruction first carries the pages rank 0 allocated since the last one, per pool, so each
  rank moves its own generation tags on in the same order (a rank's tag table is its own);
- CHECK: the step's block tables and expected tags; every rank compares them with its tag table
  and the ranks vote (max of rank + 1 over the cpu group), so a mismatch found on any rank fails
  the request on all of them;
- STEP: the batch tensors (tokens, positions, slots, block tables, lengths, logit rows); every rank
  runs its slice of the model, rank 0 samples from the gathered logits;
- MIGRATE / GATHER / SCATTER: copy pages between a rank's pools, collect every rank's heads of some
  pages on rank 0 (a handoff payload holds all heads), or send each rank its heads of arriving pages;
- NOOP: a keepalive vote, so an idle replica still notices a rank that died; FAULT: a test-only tag
  drift on one rank; STOP: the workers exit.

A worker records each instruction it finished (parallel.group.ParallelGroup.ack). Any collective
error or timeout on rank 0 becomes a ReplicaFailure naming the rank; the replica cannot continue.
"""

from __future__ import annotations

import logging
import time
from enum import IntEnum

import torch
import torch.distributed as dist

from pagoda.kernels.integrity import check_page_tags
from pagoda.node_agent.engine.handoff import convert_into, extract_pages
from pagoda.node_agent.engine.parallel.group import ParallelGroup, ReplicaFailure
from pagoda.node_agent.kv.layout import PageLayout, transfer_dtypes
from pagoda.node_agent.kv.pool import KVPagePool, PageRef, is_page_scale_key, page_scale_key
from pagoda.node_agent.models.batch import StepBatch
from pagoda.node_agent.models.parallel import reduce_cpu

log = logging.getLogger("pagoda.parallel")

MAGIC = 0x5041474F  # "PAGO"
HEADER = 12  # [magic, op, seq, n_alloc_0, n_alloc_1, n_body, arg0..arg5]
MAX_BODY = 1 << 26  # int64 values in one instruction's body


class Op(IntEnum):
    NOOP = 1
    CHECK = 2
    STEP = 3
    MIGRATE = 4
    GATHER = 5
    SCATTER = 6
    FAULT = 7
    STOP = 8


PHASE_CODES = {"prefill": 0, "decode": 1}
PHASE_NAMES = {v: k for k, v in PHASE_CODES.items()}


def _raw(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 CPU tensor (gloo moves no float8)."""
    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)


def _from_raw(raw: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return raw.view(dtype).reshape(shape)


class _Pools:
    """The replica's pools by index: 0 = the prefill pool, 1 = the decode pool (one pool: index 0)."""

    def __init__(self, prefill: KVPagePool, decode: KVPagePool) -> None:
        self.list = [prefill] if prefill is decode else [prefill, decode]

    def index(self, pool: KVPagePool) -> int:
        for i, p in enumerate(self.list):
            if p is pool:
                return i
        raise ValueError(f"pool {pool.name} is not one of the replica's pools")

    def get(self, i: int) -> KVPagePool:
        if not 0 <= i < len(self.list):
            raise ValueError(f"instruction names pool {i}; this replica has {len(self.list)}")
        return self.list[i]


class ParallelDriver:
    """Rank 0's side: every method is one instruction, and raises ReplicaFailure if the group fails."""

    def __init__(
        self, group: ParallelGroup, model, prefill_pool: KVPagePool, pool: KVPagePool, head_split, backend
    ) -> None:
        self.group = group
        self.backend = backend
        self.model = model
        self.pools = _Pools(prefill_pool, pool)
        for p in self.pools.list:
            p.alloc_log = []  # what the other ranks must mirror
        self.head_split = head_split  # per rank: the KV heads of its pool ((start, end) in the whole model)
        self.seq = 0
        self.failed: str | None = None
        self.device = model.device
        self.last_sent = time.monotonic()
        self.keepalive_s = min(2.0, group.timeout_s / 4)

    # ------------------------------------------------------------------ sending

    def _send(self, op: Op, body: list[int] | torch.Tensor = (), args: tuple[int, ...] = ()) -> int:
        if self.failed:
            raise ReplicaFailure(self.failed)
        self.seq += 1
        self.last_sent = time.monotonic()
        allocs = [p.alloc_log for p in self.pools.list]
        counts = [len(a) for a in allocs] + [0] * (2 - len(allocs))
        body_t = body if isinstance(body, torch.Tensor) else torch.tensor(list(body), dtype=torch.long)
        flat = torch.cat(
            [torch.tensor([x for a in allocs for x in a], dtype=torch.long), body_t.long().cpu()]
        )
        header = torch.tensor(
            [MAGIC, int(op), self.seq, counts[0], counts[1], flat.numel(), *args, *[0] * (6 - len(args))],
            dtype=torch.long,
        )
        for a in allocs:
            a.clear()
        dist.broadcast(header, src=0, group=self.group.control)
        if flat.numel():
            dist.broadcast(flat, src=0, group=self.group.control)
        return self.seq

    def _guard(self, fn, *args):
        """Run one instruction; any failure of the group becomes a ReplicaFailure naming the rank."""
        if self.failed:
            raise ReplicaFailure(self.failed)
        try:
            return fn(*args)
        except ReplicaFailure:
            raise
        except Exception as exc:
            self.failed = self.group.describe_failure(exc, self.seq)
            log.error("the replica failed: %s", self.failed)
            raise ReplicaFailure(self.failed) from exc

    # ------------------------------------------------------------------ instructions

    def keepalive_if_due(self) -> None:
        if time.monotonic() - self.last_sent >= self.keepalive_s:
            self.keepalive()

    def keepalive(self) -> None:
        """An empty vote: fails (naming the rank) when a rank died or hangs, even while idle."""
        self._guard(self._vote_args, Op.NOOP, torch.zeros(1, dtype=torch.long), (), ())

    def check(
        self, pool: KVPagePool, pages: torch.Tensor, tags: torch.Tensor, counts: list[int]
    ) -> list[int]:
        """Every other rank's tag check of the batch: per sequence, 0 or the (highest) rank + 1 that
        found a mismatch. Rank 0 checks its own table in the integrity tracker as before."""
        b, w = pages.shape
        body = torch.cat(
            [pages.reshape(-1).long().cpu(), tags.reshape(-1).long().cpu(), torch.tensor(counts)]
        )
        args = (self.pools.index(pool), b, w)
        return self._guard(self._vote_args, Op.CHECK, torch.zeros(b, dtype=torch.long), body, args).tolist()

    def _vote_args(self, op: Op, local: torch.Tensor, body, args) -> torch.Tensor:
        """Send an instruction, then take the ranks' vote on it (``local``: this rank's, in place)."""
        self._send(op, body, args)
        _vote(local, self.group)
        return local

    def run_model(self, batch: StepBatch, pool: KVPagePool, weights_phase: str | None, logits: bool):
        """Send the batch, then run rank 0's slice; returns the logits (or None)."""
        return self._guard(self._run_model, batch, pool, weights_phase, logits)

    def _run_model(self, batch: StepBatch, pool: KVPagePool, weights_phase: str | None, logits: bool):
        parts = [
            batch.input_ids,
            batch.positions,
            batch.slot_mapping,
            batch.block_tables.reshape(-1),
            batch.context_lens,
            batch.cu_q_lens,
            batch.logits_indices,
        ]
        sizes = [p.numel() for p in parts]
        body = torch.cat([p.reshape(-1).long().cpu() for p in parts])
        wp = PHASE_CODES[weights_phase] if weights_phase else -1
        args = (self.pools.index(pool), PHASE_CODES[batch.phase], wp, int(logits), *sizes[:2])
        self._send(Op.STEP, torch.cat([torch.tensor(sizes), body]), args)
        if not logits:
            self.model.forward_no_logits(batch)
            return None
        return self.model.forward(batch, weights_phase=weights_phase)

    def migrate(
        self, src: KVPagePool, dst: KVPagePool, src_refs: list[PageRef], dst_refs: list[PageRef]
    ) -> None:
        """The other ranks copy the same pages between their pools (rank 0 copies its own)."""
        body = [r.page for r in src_refs] + [r.page for r in dst_refs]
        args = (self.pools.index(src), self.pools.index(dst), len(src_refs))
        self._guard(self._vote_args, Op.MIGRATE, torch.zeros(1, dtype=torch.long), body, args)

    def gather_pages(self, pool: KVPagePool, refs: list[PageRef]):
        """(layers, static scales) of ``refs`` with every rank's heads, as one rank would hold them."""
        return self._guard(self._gather, pool, refs)

    def _gather(self, pool: KVPagePool, refs: list[PageRef]):
        self._send(Op.GATHER, [r.page for r in refs], (self.pools.index(pool), len(refs)))
        layers, scales = extract_pages(pool, refs)
        if not _split_by_head(pool):
            _barrier(self.group)
            return layers, scales
        per_rank = [(layers, scales)]
        seen = {self.head_split[0]}
        for r in range(1, self.group.world):
            h0, h1 = self.head_split[r]
            got = _recv_pages(pool, len(refs), h1 - h0, r, self.group)
            if (h0, h1) not in seen:  # a KV head replicated on several ranks (fewer than ranks) goes once
                seen.add((h0, h1))
                per_rank.append(got)
        _barrier(self.group)
        return _concat_heads(per_rank)

    def scatter_pages(
        self,
        pool: KVPagePool,
        refs: list[PageRef],
        layers: list[dict[str, torch.Tensor]],
        scales: list[dict[str, torch.Tensor]] | None,
    ) -> None:
        """Write arriving whole-head pages into ``refs``: each rank converts its heads. Each rank's
        share and its layout are made before anything is sent, so a payload that cannot be sent
        fails only its request (ValueError), never the replica."""
        split = _split_by_head(pool)
        parts = [
            _slice_heads(layers, scales, self.head_split[r] if split else None)
            for r in range(self.group.world)
        ]
        for part in parts[1:]:
            _layout(pool, *part)  # raises ValueError for keys or element types the ranks cannot move
        self._guard(self._scatter, pool, refs, parts)

    def _scatter(self, pool, refs, parts) -> None:
        self._send(Op.SCATTER, [r.page for r in refs], (self.pools.index(pool), len(refs)))
        for r in range(1, self.group.world):
            _send_pages(pool, parts[r], r, self.group)
        convert_into(pool, refs, parts[0][0], parts[0][1], backend=self.backend)
        _barrier(self.group)

    def drift_tag(self, rank: int, pool: KVPagePool, page: int) -> None:
        """Test only: rank ``rank`` moves its own tag of ``page`` on, as a missed reallocation would."""
        args = (self.pools.index(pool), rank)
        self._guard(self._vote_args, Op.FAULT, torch.zeros(1, dtype=torch.long), [page], args)

    def stop(self) -> None:
        if self.failed:
            return
        try:
            self._send(Op.STOP)
        except Exception as exc:
            log.warning("could not tell the other ranks to stop: %s", exc)


# ---------------------------------------------------------------------------------- page transfer


def _split_by_head(pool: KVPagePool) -> bool:
    """GQA pools hold each rank's KV heads; MLA's latent pool is whole on every rank."""
    return "latent" not in pool.components


def _vote(local: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    """The elementwise maximum of ``local`` over the ranks (in place)."""
    return reduce_cpu(local, group.rank, group.world, group.cpu, torch.maximum)


def _barrier(group: ParallelGroup) -> None:
    _vote(torch.zeros(1, dtype=torch.long), group)


def _slice_heads(layers, scales, heads):
    """Per-layer pages (and static per-head scales) restricted to KV heads [h0, h1) (None: all)."""
    if heads is None:
        return layers, scales
    h0, h1 = heads
    out = [{c: t[:, :, h0:h1].contiguous() for c, t in layer.items()} for layer in layers]
    sc = [{c: s[h0:h1].contiguous() for c, s in layer.items()} for layer in scales] if scales else None
    return out, sc


def _concat_heads(per_rank):
    """Every rank's pages (in rank order) joined along the head dimension."""
    layers = [
        {c: torch.cat([pr[0][li][c] for pr in per_rank], dim=2) for c in per_rank[0][0][li]}
        for li in range(len(per_rank[0][0]))
    ]
    scales = None
    if per_rank[0][1] is not None:
        scales = [
            {c: torch.cat([pr[1][li][c] for pr in per_rank]) for c in per_rank[0][1][li]}
            for li in range(len(per_rank[0][1]))
        ]
    return layers, scales


LAYOUT_LEN = 20  # int64s: [keys, scale keys, (name, dtype) per key, (name, dtype) per scale key]


def _key_names(pool: KVPagePool) -> list[str]:
    """Every name a transfer's per-layer dict may hold: the components and their per-token scales."""
    comps = sorted(pool.replica_components)
    return comps + [page_scale_key(c) for c in comps]


def _layout(pool: KVPagePool, layers, scales) -> torch.Tensor:
    """What the pages are (their PageLayout's keys and element types; the receiver knows the
    shapes), as int64s. The pages of a transfer come from one source, so every layer holds the same keys."""
    names, codes = _key_names(pool), transfer_dtypes()
    layout = PageLayout.of_pages(layers, scales)
    keys, skeys = layout.page_keys, layout.static_scaled
    if any(set(layer) != set(keys) for layer in layers) or any(set(s) != set(skeys) for s in scales or []):
        raise ValueError("the pages to transfer hold different components in different layers")
    out = [len(keys), len(skeys)]
    for k, t in [(k, layers[0][k]) for k in keys] + [(k, scales[0][k]) for k in skeys]:
        if k not in names or t.dtype not in codes:
            raise ValueError(f"cannot transfer KV component {k!r} of {t.dtype}")
        out += [names.index(k), codes.index(t.dtype)]
    if len(out) > LAYOUT_LEN:
        raise ValueError(f"a page transfer of {len(keys)} + {len(skeys)} keys is too large to describe")
    return torch.tensor(out + [0] * (LAYOUT_LEN - len(out)), dtype=torch.long)


def _read_layout(pool: KVPagePool, layout: torch.Tensor) -> tuple[list[tuple], list[tuple]]:
    """([(key, dtype)] of each layer's pages, [(key, dtype)] of each layer's static scales), in the
    order the sender's PageLayout sends them."""
    names, codes = _key_names(pool), transfer_dtypes()
    nk, ns = int(layout[0]), int(layout[1])
    if not (
        0 < nk <= len(names) and 0 <= ns <= len(pool.replica_components) and 2 + 2 * (nk + ns) <= LAYOUT_LEN
    ):
        raise ValueError(f"page transfer layout out of range: {layout.tolist()}")
    pairs = layout[2 : 2 + 2 * (nk + ns)].view(-1, 2).tolist()
    if any(not (0 <= i < len(names) and 0 <= d < len(codes)) for i, d in pairs):
        raise ValueError(f"page transfer layout names an unknown key or type: {layout.tolist()}")
    got = [(names[i], codes[d]) for i, d in pairs]
    if any(is_page_scale_key(k) for k, _ in got[nk:]):
        raise ValueError("page transfer layout: a static scale of a per-token scale")
    return got[:nk], got[nk:]


def _send_pages(pool: KVPagePool, pages, dst: int, group: ParallelGroup) -> None:
    """Send ``pages`` (layers, static scales) to rank ``dst``: their layout first, then each tensor."""
    dist.send(_layout(pool, *pages), dst=dst, group=group.cpu)
    for t in PageLayout.of_pages(*pages).tensors(*pages):
        dist.send(_raw(t), dst=dst, group=group.cpu)


def _recv_pages(pool: KVPagePool, n: int, h: int, src: int, group: ParallelGroup):
    """``n`` pages of ``h`` KV heads sent by rank ``src`` (the layout its _send_pages describes:
    a handoff payload may hold another format than ``pool``), in its PageLayout's order."""
    layout = torch.zeros(LAYOUT_LEN, dtype=torch.long)
    dist.recv(layout, src=src, group=group.cpu)
    keys, skeys = _read_layout(pool, layout)
    rc = pool.replica_components

    def shape(key: str) -> tuple[int, ...]:
        if is_page_scale_key(key):
            return (n, pool.page_size, h)
        return (n, pool.page_size, h, *rc[key][1:])

    layers = [{k: _recv(dt, shape(k), src, group) for k, dt in keys} for _ in range(pool.num_layers)]
    scales = None
    if skeys:
        scales = [{k: _recv(dt, (h,), src, group) for k, dt in skeys} for _ in range(pool.num_layers)]
    return layers, scales


def _recv(dtype: torch.dtype, shape: tuple[int, ...], src: int, group: ParallelGroup) -> torch.Tensor:
    size = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(size, dtype=torch.uint8)
    dist.recv(raw, src=src, group=group.cpu)
    return _from_raw(raw, dtype, shape)


# ---------------------------------------------------------------------------------- the workers


class Follower:
    """A worker rank's loop: receive an instruction, mirror rank 0's allocations, carry it out."""

    def __init__(self, group: ParallelGroup, model, prefill_pool: KVPagePool, pool: KVPagePool, backend):
        self.group = group
        self.model = model
        self.pools = _Pools(prefill_pool, pool)
        self.backend = backend
        self.device = model.device

    def run(self) -> int:
        """Follow until STOP (returns 0) or until the group is lost (returns 3)."""
        rank = self.group.rank
        while True:
            try:
                header = torch.zeros(HEADER, dtype=torch.long)
                dist.broadcast(header, src=0, group=self.group.control)
                op, seq = self._validate(header)
                flat = torch.zeros(int(header[5]), dtype=torch.long)
                if flat.numel():
                    dist.broadcast(flat, src=0, group=self.group.control)
            except Exception as exc:
                log.error("tensor-parallel rank %d lost rank 0: %s", rank, exc)
                return 3
            if op == Op.STOP:
                return 0
            try:
                body = self._mirror(header, flat)
                self._carry_out(op, header[6:].tolist(), body)
                self.group.ack(seq)
            except Exception:
                log.exception("tensor-parallel rank %d failed instruction #%d (%s)", rank, seq, op.name)
                return 3

    def _validate(self, header: torch.Tensor) -> tuple[Op, int]:
        if int(header[0]) != MAGIC:
            raise ValueError("instruction header has the wrong magic")
        n = int(header[5])
        if (
            not 0 <= n <= MAX_BODY
            or int(header[3]) < 0
            or int(header[4]) < 0
            or int(header[3]) + int(header[4]) > n
        ):
            raise ValueError(f"instruction sizes out of range: {header.tolist()}")
        return Op(int(header[1])), int(header[2])

    def _mirror(self, header: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        """Move this rank's tags on for the pages rank 0 allocated; returns the instruction's body."""
        at = 0
        for i, n in enumerate((int(header[3]), int(header[4]))):
            if n:
                self.pools.get(i).bump_tags(flat[at : at + n].tolist())
            at += n
        return flat[at:]

    def _carry_out(self, op: Op, args: list[int], body: torch.Tensor) -> None:
        if op == Op.NOOP:
            _vote(torch.zeros(1, dtype=torch.long), self.group)
        elif op == Op.CHECK:
            pool, b, w = self.pools.get(args[0]), args[1], args[2]
            self._check_sizes(body, 2 * b * w + b)
            pages = body[: b * w].view(b, w).to(torch.int32)
            tags = body[b * w : 2 * b * w].view(b, w).to(torch.int32)
            counts = body[2 * b * w :].to(torch.int32)
            self._check_pages(pool, pages)
            if bool((counts < 0).any()) or bool((counts > w).any()):
                raise ValueError("a tag check names more pages than its table holds")
            dev = pool.tag_table.device
            mask = check_page_tags(
                pages.to(dev), tags.to(dev), counts.to(dev), pool.tag_table, backend=self.backend
            )
            vote = mask.cpu().long() * (self.group.rank + 1)
            _vote(vote, self.group)
        elif op == Op.STEP:
            self._step(args, body)
        elif op == Op.MIGRATE:
            src, dst, n = self.pools.get(args[0]), self.pools.get(args[1]), args[2]
            self._check_sizes(body, 2 * n)
            src_idx = body[:n].to(src.device)
            dst_refs = [PageRef(int(p), 0) for p in body[n:]]
            self._check_pages(src, body[:n])
            self._check_pages(dst, body[n:])
            convert_into(dst, dst_refs, src.layers, src.static_scales, src_idx, self.backend)
            _vote(torch.zeros(1, dtype=torch.long), self.group)
        elif op == Op.GATHER:
            pool, n = self.pools.get(args[0]), args[1]
            self._check_sizes(body, n)
            self._check_pages(pool, body)
            refs = [PageRef(int(p), 0) for p in body]
            if _split_by_head(pool):
                _send_pages(pool, extract_pages(pool, refs), 0, self.group)
            _barrier(self.group)
        elif op == Op.SCATTER:
            pool, n = self.pools.get(args[0]), args[1]
            self._check_sizes(body, n)
            self._check_pages(pool, body)
            refs = [PageRef(int(p), 0) for p in body]
            heads = pool.components[next(iter(pool.components))][0]  # this rank's (or MLA's whole)
            layers, scales = _recv_pages(pool, n, heads, 0, self.group)
            convert_into(pool, refs, layers, scales, backend=self.backend)
            _barrier(self.group)
        elif op == Op.FAULT:
            pool, rank = self.pools.get(args[0]), args[1]
            self._check_sizes(body, 1)
            if rank == self.group.rank:
                self._check_pages(pool, body)
                pool.bump_tags([int(body[0])])
            _vote(torch.zeros(1, dtype=torch.long), self.group)
        else:
            raise ValueError(f"unknown instruction {op}")

    def _step(self, args: list[int], body: torch.Tensor) -> None:
        pool = self.pools.get(args[0])
        phase = PHASE_NAMES[args[1]]
        weights_phase = PHASE_NAMES.get(args[2])
        logits = bool(args[3])
        sizes = body[:7].tolist()
        data = body[7:]
        self._check_sizes(data, sum(sizes))
        parts = list(torch.split(data, sizes))
        ids, pos, slots, tables, ctx, cu, rows = parts
        b = ctx.numel()
        w = tables.numel() // max(1, b)
        if ids.numel() != pos.numel() or slots.numel() != ids.numel() or cu.numel() != b + 1:
            raise ValueError("a step's tensors disagree in size")
        self._check_pages(pool, tables)
        if bool((slots < 0).any()) or bool((slots >= pool.num_pages * pool.page_size).any()):
            raise ValueError("a step writes outside the pool")
        dev = self.device
        batch = StepBatch(
            phase=phase,
            kv=pool,
            input_ids=ids.to(dev),
            positions=pos.to(dev),
            slot_mapping=slots.to(dev),
            block_tables=tables.view(b, w).to(torch.int32).to(pool.tag_table.device),
            context_lens=ctx.to(device=dev, dtype=torch.int32),
            cu_q_lens=cu.to(device=dev, dtype=torch.int32),
            logits_indices=rows.to(dev),
            kernel_backend=self.backend,
        )
        if logits:
            self.model.forward(batch, weights_phase=weights_phase)
        else:
            self.model.forward_no_logits(batch)

    @staticmethod
    def _check_sizes(body: torch.Tensor, n: int) -> None:
        if body.numel() != n:
            raise ValueError(f"instruction body has {body.numel()} values, expected {n}")

    @staticmethod
    def _check_pages(pool: KVPagePool, pages: torch.Tensor) -> None:
        if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= pool.num_pages):
            raise ValueError(f"instruction names a page outside {pool.name} ({pool.num_pages} pages)")
