"""Which per-phase format combinations make sense, and why the others do not.

The schema (enums and CEL rules) rejects most bad specs at admission; the operator checks
the same rules again (clusters without CEL, objects stored before a rule existed) plus the
ones that need a reason longer than a schema message.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.vocabulary import INTEGRITY_MODES, KV_CACHE_FORMATS, WEIGHT_FORMAT_CHOICES, handoff_allowed

from .spec import POOLS, Pool, Spec


@dataclass(frozen=True)
class Problem:
    """Why a spec cannot be served: a condition reason and a human message."""

    reason: str
    message: str


def _parallelism(name: str, pool: Pool) -> list[Problem]:
    """Tensor-parallel layouts the agents cannot run (the CRD's CEL rules, checked again)."""
    tp, nodes = pool.tensor_parallel, pool.nodes_per_replica
    if not 1 <= nodes <= tp:
        return [
            Problem(
                "InvalidParallelism",
                f"{name}.nodesPerReplica {nodes} must be between 1 and tensorParallel {tp}: "
                "every pod of a replica runs at least one tensor-parallel rank",
            )
        ]
    if tp % nodes:
        return [
            Problem(
                "InvalidParallelism",
                f"{name}.tensorParallel {tp} is not a multiple of nodesPerReplica {nodes}: "
                "every pod of a replica runs the same number of ranks",
            )
        ]
    if pool.gpus not in (0, tp // nodes):
        return [
            Problem(
                "InvalidParallelism",
                f"{name}.gpus {pool.gpus} does not match the {tp // nodes} rank(s) each pod runs "
                f"(tensorParallel {tp} / nodesPerReplica {nodes}): gpus is per pod, 0 for a CPU pool, "
                "else one per rank; leave it out to have it derived",
            )
        ]
    return []


def check(spec: Spec) -> list[Problem]:
    """Every reason this spec cannot be rolled out; empty when it is fine."""
    problems: list[Problem] = []
    if not spec.source:
        problems.append(Problem("InvalidModel", "spec.model.source is empty"))
    for name in POOLS:
        pool = spec.pool(name)
        if pool.weight_format not in WEIGHT_FORMAT_CHOICES:
            problems.append(
                Problem(
                    "UnknownFormat",
                    f"{name}.weightFormat {pool.weight_format!r} is not one of {WEIGHT_FORMAT_CHOICES}",
                )
            )
        if pool.kv_cache_format not in KV_CACHE_FORMATS:
            problems.append(
                Problem(
                    "UnknownFormat",
                    f"{name}.kvCacheFormat {pool.kv_cache_format!r} is not one of {KV_CACHE_FORMATS}",
                )
            )
        if pool.replicas < 0:
            problems.append(Problem("InvalidReplicas", f"{name}.replicas must be >= 0"))
        problems += _parallelism(name, pool)
    # auto prefill is served: it resolves to fp8, or to stored on a pre-quantized checkpoint, which
    # keeps the checkpoint's own INT4 layers as an explicit ``stored`` prefill does.
    if spec.prefill.weight_format == "int4":
        problems.append(
            Problem(
                "UnsupportedFormat",
                "prefill.weightFormat int4 is not served: prefill is compute-bound and INT4 dequantisation "
                "slows it down (INT4 pays off in decode only); use fp8 or bf16 for prefill",
            )
        )
    handoff = (spec.prefill.kv_cache_format, spec.decode.kv_cache_format)
    if all(f in KV_CACHE_FORMATS for f in handoff) and not handoff_allowed(*handoff):
        problems.append(
            Problem(
                "IncompatibleHandoff",
                f"prefill KV {handoff[0]} cannot hand off to a {handoff[1]} decode cache: 1-byte pages "
                "never widen to bf16 (twice the memory for lossy values) nor change to the other 1-byte "
                "format (a second rounding); use bf16 prefill KV, or the decode format for both",
            )
        )
    for name in POOLS:
        auto = spec.pool(name).autoscaling
        if auto is None:
            continue
        if not 1 <= auto.min_replicas <= auto.max_replicas:
            problems.append(
                Problem(
                    "InvalidAutoscaling",
                    f"{name}.autoscaling needs 1 <= minReplicas ({auto.min_replicas}) <= maxReplicas "
                    f"({auto.max_replicas})",
                )
            )
        if not auto.targets.items():
            problems.append(
                Problem(
                    "InvalidAutoscaling",
                    f"{name}.autoscaling sets no target: give at least one of waitingRequests, "
                    "kvCacheUsage, ttftSeconds, itlSeconds",
                )
            )
    running = {n: spec.pool(n).autoscaling is not None or spec.pool(n).replicas > 0 for n in POOLS}
    if running["prefill"] != running["decode"]:
        problems.append(
            Problem(
                "InvalidReplicas",
                "a disaggregated deployment needs both pools: set prefill and decode replicas >= 1, "
                "or both to 0 to pause",
            )
        )
    if spec.integrity.mode not in INTEGRITY_MODES:
        problems.append(Problem("InvalidIntegrity", f"integrity.mode {spec.integrity.mode!r} is unknown"))
    return problems
