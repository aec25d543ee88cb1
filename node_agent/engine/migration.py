"""In-process handoff: finished prefills move from the prefill pool to the decode pool (converting
the KV format, on every tensor-parallel rank), tag-checked before a page is copied.

The sequences awaiting the move are checked in one batched tag check and, when several are ready,
moved in one conversion per layer and component (a prefill step that ends many prompts would
otherwise pay that per-call cost once per prompt, in the step every running stream waits on). When
the joint move does not go through (the decode pool is short of pages, or the copy fails), they
move one by one, oldest first, as far as pages allow, so that a failed copy ends only its own
request."""

from __future__ import annotations

from pagoda.node_agent.engine.isolation import FailureIsolation, log_failure
from pagoda.node_agent.engine.output import RequestOutput
from pagoda.node_agent.engine.parallel.group import ReplicaFailure
from pagoda.node_agent.engine.scheduler import Scheduler
from pagoda.node_agent.engine.sequence import Sequence
from pagoda.node_agent.engine.state import EngineStats
from pagoda.node_agent.kv.pool import KVPagePool, OutOfPages, PageRef


def migrate_prefilled(
    scheduler: Scheduler, replica, integrity, isolation: FailureIsolation, stats: EngineStats, backend
) -> list[RequestOutput]:
    """Move every prefilled sequence that awaits it; returns the outputs of requests that failed (an
    integrity mismatch fails closed, a failed copy ends its request). A full decode pool stops the
    moves until the next step."""
    src, dst = scheduler.prefill_pool, scheduler.decode_pool
    waiting = scheduler.awaiting_migration()
    if not waiting:
        return []
    bad = replica.check_tags(integrity, waiting, src)
    failed = [isolation.fail_integrity(seq, err) for seq, err in bad.items()]
    ready = [seq for seq in waiting if seq not in bad]
    if len(ready) > 1 and _move_together(replica, src, dst, ready, backend, stats):
        return failed
    return failed + _move_one_by_one(replica, src, dst, ready, isolation, stats, backend)


def _moved(seq: Sequence, refs: list[PageRef], dst: KVPagePool, stats: EngineStats) -> None:
    seq.block_table = refs
    seq.pool_name = dst.name
    stats.migrations += 1


def _move_together(
    replica, src: KVPagePool, dst: KVPagePool, seqs: list[Sequence], backend, stats: EngineStats
) -> bool:
    """Move every one of ``seqs`` in one conversion; False (nothing moved) when that fails."""
    try:
        refs = replica.migrate(src, dst, [r for seq in seqs for r in seq.block_table], backend)
    except ReplicaFailure:
        raise
    except Exception:  # migrate released what it took in the decode pool: move them one by one
        return False
    at = 0
    for seq in seqs:
        n = len(seq.block_table)
        _moved(seq, refs[at : at + n], dst, stats)
        at += n
    return True


def _move_one_by_one(
    replica,
    src: KVPagePool,
    dst: KVPagePool,
    seqs: list[Sequence],
    isolation: FailureIsolation,
    stats: EngineStats,
    backend,
) -> list[RequestOutput]:
    failed: list[RequestOutput] = []
    for seq in seqs:
        try:
            refs = replica.migrate(src, dst, seq.block_table, backend)
        except OutOfPages:
            break  # decode frees pages as sequences finish; try again next step
        except ReplicaFailure:
            raise
        except Exception as exc:  # migrate released what it took in the decode pool
            out = isolation.fail_request(seq, log_failure([seq], "KV migration", exc))
            failed += [out] if out is not None else []
            continue
        _moved(seq, refs, dst, stats)
    return failed
