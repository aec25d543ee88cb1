"""In-process handoff: finished prefills move from the prefill pool to the decode pool (converting
the KV format, on every tensor-parallel rank), tag-checked before a page is copied."""

from __future__ import annotations

from pagoda.node_agent.engine.isolation import FailureIsolation, log_failure
from pagoda.node_agent.engine.output import RequestOutput
from pagoda.node_agent.engine.parallel.group import ReplicaFailure
from pagoda.node_agent.engine.scheduler import Scheduler
from pagoda.node_agent.engine.state import EngineStats
from pagoda.node_agent.kv.pool import OutOfPages


def migrate_prefilled(
    scheduler: Scheduler, replica, integrity, isolation: FailureIsolation, stats: EngineStats, backend
) -> list[RequestOutput]:
    """Move every prefilled sequence that awaits it; returns the outputs of requests that failed (an
    integrity mismatch fails closed, a failed copy ends its request). A full decode pool stops the
    moves until the next step."""
    src, dst = scheduler.prefill_pool, scheduler.decode_pool
    failed: list[RequestOutput] = []
    for seq in scheduler.awaiting_migration():
        err = replica.check_tags(integrity, [seq], src).get(seq)
        if err is not None:
            failed.append(isolation.fail_integrity(seq, err))
            continue
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
        seq.block_table = refs
        seq.pool_name = dst.name
        stats.migrations += 1
    return failed
