"""One level-based reconciliation pass of a ModelDeployment: children, rollout order, status.

The pass reads the ModelDeployment and its children, converges the children, and returns the
status merge patch. Running it again with nothing changed makes no API writes.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagoda.agent_lease import renew_times
from pagoda.agent_report import format_time, parse_time
from pagoda.vocabulary import SOURCE_DEFAULT

from . import children, credentials, formats, lws_support, mismatch_decay, ownership, quality_gate, rollout
from .apply import ensure, removals
from .conditions import DEGRADED, KV_INTEGRITY_DEGRADED, PROGRESSING, READY, Condition, merge, transitions
from .config import Config
from .kube import ApiError, Kube
from .spec import POOLS, Spec, parse
from .status import (
    agent_entries,
    alive_at,
    incomplete_groups,
    pool_figures,
    quality_of,
    reports_of,
    resolved_weights,
    split,
    window,
)

Obj = dict[str, Any]
Emit = Callable[[str, str, str], None]  # (type, reason, message)

log = logging.getLogger("pagoda.operator")

# Status keys the operator writes (the whole status: agents report on their pods).
OWNED = (
    "observedGeneration",
    "conditions",
    "prefill",
    "decode",
    "router",
    "mismatchRate",
    "integrityWindow",
    "rollout",
    "agents",
    "agentsTotal",
    "quality",
)
MAX_NAMES = 10  # pod names listed in a condition message


def _names(pods: list[str]) -> str:
    shown = ", ".join(pods[:MAX_NAMES])
    return shown + (f" and {len(pods) - MAX_NAMES} more" if len(pods) > MAX_NAMES else "")


@dataclass
class Outcome:
    """What a pass did: child actions, the rollout stage and the status patch (None: no change)."""

    actions: dict[str, str] = field(default_factory=dict)
    stage: str | None = None
    status_patch: Obj | None = None
    problems: list[formats.Problem] = field(default_factory=list)
    # Problems with the credentials the pods need: the children are still applied.
    credential_problems: list[formats.Problem] = field(default_factory=list)
    # Children the API server refused to create, patch or delete: "Kind/name: its message".
    apply_errors: list[str] = field(default_factory=list)
    # Objects with a child's name that are not this ModelDeployment's: left untouched.
    refused: list[ownership.AlreadyOwned] = field(default_factory=list)
    plan: rollout.Plan | None = None
    # status.quality.gate as this pass leaves it (None: no gate record).
    gate: Obj | None = None


def _replicas(dep: Obj | None, key: str) -> int:
    return int(((dep or {}).get("status") or {}).get(key, 0) or 0)


async def _credentials(kube: Kube, meta: Obj, spec: Spec, out: Outcome) -> str | None:
    """Create the internal Secret when missing, check both Secrets; returns the internal one's uid."""
    internal, action = await credentials.ensure_internal(kube, meta)
    if action != "unchanged":
        out.actions[f"Secret/{credentials.internal_name(meta['name'])}"] = action
    for problem in (
        await credentials.api_keys_problem(kube, meta["namespace"], spec.auth.api_keys_secret),
        credentials.internal_problem(internal),
    ):
        if problem is not None:
            out.credential_problems.append(problem)
    return (internal.get("metadata") or {}).get("uid")


async def _remove_unwanted(kube: Kube, meta: Obj, desired: dict[str, Obj], cfg: Config, out: Outcome) -> None:
    """Delete the optional children (policies, budgets, autoscalers) the spec no longer asks for,
    only those whose ownerReference is this ModelDeployment."""
    for kind, name in children.optional_children(meta, cfg):
        key = f"{kind}/{name}"
        if key in desired:
            continue
        try:
            live = await kube.get(kind, meta["namespace"], name)
            owners = ((live or {}).get("metadata") or {}).get("ownerReferences") or []
            if live is None or not any(o.get("uid") == meta["uid"] for o in owners):
                continue  # absent, or not ours: leave it alone
            if await kube.delete(kind, meta["namespace"], name, live["metadata"].get("uid")):
                out.actions[key] = "deleted"
        except ApiError as err:
            if err.status == 404:  # the kind is not served (no KEDA): nothing of it to remove
                continue
            out.apply_errors.append(f"{key}: {err.message}")


async def _ensure(kube: Kube, key: str, obj: Obj, current: Obj | None, out: Outcome, owner: Obj) -> None:
    try:
        result = await ensure(kube, obj, current, owner)
    except ownership.AlreadyOwned as refused:
        out.refused.append(refused)
        return
    if result != "unchanged":
        out.actions[key] = result


def _own_only(found: dict[str, Obj], name: str, meta: Obj, out: Outcome) -> dict[str, Obj]:
    """The workloads named ``name`` that are this ModelDeployment's; the others are refused."""
    mine: dict[str, Obj] = {}
    for kind, live in found.items():
        why = ownership.foreign(live, meta)
        if why is None:
            mine[kind] = live
        else:
            out.refused.append(ownership.AlreadyOwned(f"{kind}/{name}", why))
    return mine


def _live_replicas(dep: Obj | None) -> int:
    return int(((dep or {}).get("spec") or {}).get("replicas", 0) or 0)


WORKLOAD_KINDS = ("Deployment", children.LWS_KIND)
LWS_MISSING = "LeaderWorkerSetMissing"


async def _lws_served(kube: Kube) -> bool:
    """Whether the cluster serves LeaderWorkerSets (its CRD may not be installed)."""
    try:
        return await kube.served(children.LWS_KIND)
    except ApiError as err:
        log.warning("cannot discover the LeaderWorkerSet API: %s", err.message)
        return False


async def _found(kube: Kube, ns: str, name: str, lws: bool) -> dict[str, Obj]:
    """The pool workloads named ``name``, by kind (LeaderWorkerSets only when served)."""
    out: dict[str, Obj] = {}
    for kind in WORKLOAD_KINDS if lws else ("Deployment",):
        live = await kube.get(kind, ns, name)
        if live is not None:
            out[kind] = live
    return out


def _pick(found: dict[str, Obj], kind: str) -> Obj | None:
    """The workload of the wanted kind, else the one of the other kind (before a switch)."""
    return found.get(kind) or next(iter(found.values()), None)


async def _converge(
    kube: Kube,
    meta: Obj,
    spec: Spec,
    cfg: Config,
    status: Obj,
    now: dt.datetime,
    out: Outcome,
    lws: bool,
    hooks: quality_gate.Hooks | None = None,
    emit: Emit | None = None,
) -> dict[str, Obj | None]:
    """Apply the children; the pool pair goes by ``rollout.plan`` (blue/green on a format change).
    A pool's workload is a Deployment, or a LeaderWorkerSet when multi-node; a switch of kind
    replaces the old kind in the same slot once the new one exists. Returns the workloads that
    serve: per pool the one its Services select, and the router's Deployment."""
    ns, name = meta["namespace"], meta["name"]
    internal_uid = await _credentials(kube, meta, spec, out)
    slots = (children.BLUE, children.GREEN)
    names = {(p, s): children.pool_deployment_name(name, p, s) for p in POOLS for s in slots}
    kinds = {p: children.workload_kind(spec, p) for p in POOLS}
    found = {key: _own_only(await _found(kube, ns, n, lws), n, meta, out) for key, n in names.items()}
    blocked = {r.key for r in out.refused}  # workloads of a child's name that are not ours
    deps = {key: _pick(found[key], kinds[key[0]]) for key in names}
    services: dict[str, Obj | None] = {}
    for p in POOLS:
        svc = await kube.get("Service", ns, children.child_name(name, p))
        services[p] = svc if svc is None or ownership.foreign(svc, meta) is None else None
    shifted_at = parse_time((status.get("rollout") or {}).get("shiftedAt"))
    kv = (spec.prefill.kv_cache_format, spec.decode.kv_cache_format)
    generation = children.formats_generation(spec)
    gate = spec.rollout.gate
    record = quality_gate.current(status, generation) if gate is not None else None
    gate_open = gate is None or (record is not None and record.get("phase") == quality_gate.PASSED)
    plan = rollout.plan(generation, deps, services, names, kv, shifted_at, now, cfg.shift_settle_s, gate_open)
    out.plan = plan
    _gate(meta, spec, cfg, status, now, out, kube, hooks, emit or (lambda *_: None))
    out.stage = plan.stage
    placed = {p: s or children.BLUE for p, s in plan.slots.items()}
    desired = children.build(
        meta,
        spec,
        cfg,
        internal_uid,
        placed,
        plan.serving,
        plan.scale_slots,
        _serving_kinds(plan, generation, deps, kinds),
    )
    await _remove_unwanted(kube, meta, desired, cfg, out)
    applied: set[str] = set()
    for key, obj in desired.items():
        role = obj["metadata"]["labels"][children.POOL_LABEL]
        try:
            if obj["kind"] in WORKLOAD_KINDS and role in POOLS:
                if plan.slots.get(role) is None or key in blocked:
                    continue  # PinServingPair: the serving pods are relabelled first; or not ours
                current = found[(role, placed[role])].get(obj["kind"])
                auto = spec.pool(role).autoscaling
                if current is None and auto is not None:
                    # Created at the autoscaler's minimum, or as large as the pair it replaces.
                    before = max((_live_replicas(deps[(role, s)]) for s in slots), default=0)
                    obj = {**obj, "spec": {"replicas": max(auto.min_replicas, before), **obj["spec"]}}
            else:
                current = await kube.get(obj["kind"], ns, obj["metadata"]["name"])
            before = len(out.refused)
            await _ensure(kube, key, obj, current, out, meta)
            if len(out.refused) == before:
                applied.add(key)
        except ApiError as err:
            out.apply_errors.append(f"{key}: {err.message}")
            log.warning("cannot apply %s: %s", key, err.message, extra={"modeldeployment": f"{ns}/{name}"})
    live_kind = {names[key]: dep["kind"] for key, dep in deps.items() if dep is not None}
    for dep_name, gen in plan.label.items():
        kind = live_kind.get(dep_name, "Deployment")
        try:
            await kube.patch(
                kind, ns, dep_name, children.template_label_patch(kind, {children.FORMATS_LABEL: gen})
            )
            out.actions[f"{kind}/{dep_name}"] = "relabelled"
        except ApiError as err:
            out.apply_errors.append(f"{kind}/{dep_name}: {err.message}")
    # The old pair's workloads (whatever their kind), and in the slot the pool runs in, a workload
    # of the kind it no longer wants (nodesPerReplica crossed 1): the pool's Services already
    # select what the new kind runs.
    doomed = [(k, n) for n in plan.delete for k in WORKLOAD_KINDS if k in found[_key(names, n)]]
    for pool, slot in plan.slots.items():
        if slot is not None and f"{kinds[pool]}/{names[(pool, slot)]}" in applied:
            doomed += [(k, names[(pool, slot)]) for k in found[(pool, slot)] if k != kinds[pool]]
    for kind, dep_name in doomed:
        try:
            live = await kube.get(kind, ns, dep_name)
            if live is not None and await kube.delete(kind, ns, dep_name, live["metadata"].get("uid")):
                out.actions[f"{kind}/{dep_name}"] = "deleted"
        except ApiError as err:
            out.apply_errors.append(f"{kind}/{dep_name}: {err.message}")
    serving = {}
    for p in POOLS:
        now_found = await _found(kube, ns, names[(p, plan.scale_slots.get(p, children.BLUE))], lws)
        serving[p] = _pick(
            {k: d for k, d in now_found.items() if ownership.foreign(d, meta) is None}, kinds[p]
        )
    router = await kube.get("Deployment", ns, children.child_name(name, "router"))
    return {
        **serving,
        "router": router if router is None or ownership.foreign(router, meta) is None else None,
    }


def _gate(
    meta: Obj,
    spec: Spec,
    cfg: Config,
    status: Obj,
    now: dt.datetime,
    out: Outcome,
    kube: Kube,
    hooks: quality_gate.Hooks | None,
    emit: Emit,
) -> None:
    """The quality gate's step of this pass: start, time out or read the decision of the gate of
    the current generation (``out.gate``); outside stage QualityGate the last record is kept, but
    a gate still Running there was abandoned (the spec moved on) and is dropped."""
    plan, gate = out.plan, spec.rollout.gate
    generation = children.formats_generation(spec)
    previous = (status.get("quality") or {}).get("gate")
    previous = dict(previous) if isinstance(previous, dict) else None
    if plan is None or gate is None or plan.stage != rollout.QUALITY_GATE:
        if hooks is not None:
            hooks.runner.stop(meta["namespace"], meta["name"])
        keep = previous is not None and previous.get("phase") != quality_gate.RUNNING
        out.gate = previous if keep else None
        return
    record = quality_gate.current(status, generation)
    if record is None:
        reference = plan.serving.get("decode") or plan.serving.get("prefill") or ""
        record = quality_gate.started(generation, reference, gate, now)
    if quality_gate.overdue(record, gate, now):
        record = quality_gate.timed_out(record, now)
        emit("Warning", quality_gate.TIMEOUT_REASON, f"generation {generation}: {record['message']}")
        if hooks is not None:
            hooks.runner.stop(meta["namespace"], meta["name"])
    if record.get("phase") == quality_gate.RUNNING and hooks is not None:
        slots = {p: (plan.scale_slots[p], plan.slots[p] or children.GREEN) for p in POOLS}
        job = quality_gate.Job(kube, cfg, meta, gate, slots, record, hooks.lock, emit, hooks.repass)
        hooks.runner.ensure(job)
    out.gate = record


def _serving_kinds(
    plan: rollout.Plan, generation: str, deps: dict[tuple[str, str], Obj | None], kinds: dict[str, str]
) -> dict[str, str]:
    """Per pool, the kind of the workload its Services and autoscaler point at: the spec's once they
    select the current generation (in place, the new kind replaces the old in this pass), else the
    kind of the old pair's workload that still serves (blue/green)."""
    out: dict[str, str] = {}
    for p in POOLS:
        live = deps.get((p, plan.scale_slots.get(p, children.BLUE)))
        out[p] = live["kind"] if plan.serving.get(p) != generation and live is not None else kinds[p]
    return out


def _key(names: dict[tuple[str, str], str], name: str) -> tuple[str, str]:
    return next(key for key, n in names.items() if n == name)


def desired_replicas(spec: Spec, role: str, dep: Obj | None) -> int:
    """Replicas a role should have: the spec's, or the autoscaler's (the live Deployment's)."""
    if role == "router":
        return spec.router.replicas
    auto = spec.pool(role).autoscaling
    if auto is None:
        return spec.pool(role).replicas
    live = ((dep or {}).get("spec") or {}).get("replicas")
    return int(live) if isinstance(live, int) else auto.min_replicas


def _conditions(
    spec: Spec,
    out: Outcome,
    deps: dict[str, Obj | None],
    pools: dict[str, Obj],
    rates: dict[str, float | None],
    stale: list[str],
    cfg: Config,
    groups: dict[str, list[tuple[str, int]]] | None = None,
    md_name: str = "",
) -> list[Condition]:
    if out.problems:
        why = "; ".join(p.message for p in out.problems)
        reason = out.problems[0].reason
        return [
            Condition(READY, False, reason, f"spec cannot be served: {why}"),
            Condition(PROGRESSING, False, "InvalidSpec", "nothing is rolled out until the spec is fixed")
            if reason not in (LWS_MISSING, lws_support.TOO_OLD)
            else Condition(
                PROGRESSING,
                False,
                "Blocked",
                "nothing is rolled out until LeaderWorkerSet is "
                + ("installed" if reason == LWS_MISSING else f"{lws_support.MIN_VERSION} or newer"),
            ),
            Condition(DEGRADED, True, reason, why),
            _integrity(spec, rates),
        ]
    desired = {role: desired_replicas(spec, role, deps[role]) for role in ("prefill", "decode", "router")}
    groups = groups or {}
    short = [
        f"{role} {_replicas(deps[role], 'readyReplicas')}/{want}" + _group_note(spec, role, groups.get(role))
        for role, want in desired.items()
        if _replicas(deps[role], "readyReplicas") < want
    ]
    incomplete = any(groups.get(p) and _replicas(deps[p], "readyReplicas") < desired[p] for p in POOLS)
    rolling = [
        role
        for role in desired
        if deps[role] is None
        or not rollout.only_current_pods(deps[role])
        or _replicas(deps[role], "updatedReplicas") < desired[role]
    ]
    held = _held(out)
    if held is not None:
        progressing = Condition(PROGRESSING, False, held.reason, held.message)
    elif out.stage and out.plan is not None:
        progressing = Condition(PROGRESSING, True, out.stage, out.plan.message)
    elif rolling:
        progressing = Condition(PROGRESSING, True, "RollingOut", "rolling out: " + ", ".join(rolling))
    else:
        progressing = Condition(PROGRESSING, False, "RolloutComplete", "all pools run the current spec")
    creds = out.credential_problems
    refused = ownership.message(out.refused, md_name) if out.refused else ""
    if refused:
        ready = Condition(READY, False, ownership.ALREADY_OWNED, refused)
    elif out.apply_errors:
        why = "; ".join(out.apply_errors)
        ready = Condition(READY, False, "ApplyFailed", f"the API server refused a child: {why}")
    elif creds:
        ready = Condition(READY, False, creds[0].reason, "; ".join(p.message for p in creds))
    elif desired["prefill"] == 0 and desired["decode"] == 0:
        ready = Condition(READY, False, "Paused", "both pools are scaled to zero")
    elif short:
        reason = "GroupsIncomplete" if incomplete else "PoolsNotReady"
        ready = Condition(READY, False, reason, "waiting for replicas: " + ", ".join(short))
    else:
        ready = Condition(READY, True, "AllPoolsReady", "prefill, decode and router replicas are ready")
    stalled = out.plan.stalled if out.plan is not None else None
    if refused:
        degraded = Condition(DEGRADED, True, ownership.ALREADY_OWNED, refused)
    elif out.apply_errors:
        degraded = Condition(DEGRADED, True, "ApplyFailed", "; ".join(out.apply_errors))
    elif held is not None:
        degraded = held
    elif stalled:
        degraded = Condition(
            DEGRADED,
            True,
            "NewPairStalled",
            f"the new pool pair made no progress within spec.rollout.progressDeadlineSeconds "
            f"({spec.rollout.progress_deadline_s}s); the serving pair keeps serving: {stalled}",
        )
    elif creds:
        degraded = Condition(DEGRADED, True, creds[0].reason, "; ".join(p.message for p in creds))
    elif stale:
        degraded = Condition(
            DEGRADED,
            True,
            "StaleAgents",
            f"{len(stale)} agent(s) have not reported for more than {cfg.stale_after_s:g}s: {_names(stale)}",
        )
    elif short and not progressing.status:
        degraded = Condition(
            DEGRADED, True, "ReplicasUnavailable", "replicas unavailable: " + ", ".join(short)
        )
    else:
        degraded = Condition(DEGRADED, False, "AsExpected", "no stale agents, no unavailable replicas")
    return [ready, progressing, degraded, _integrity(spec, rates)]


def _held(out: Outcome) -> Condition | None:
    """Degraded for a format change its quality gate holds (failed, or timed out), else None."""
    rec = out.gate if out.stage == rollout.QUALITY_GATE else None
    if rec is None or rec.get("phase") not in (quality_gate.FAILED, quality_gate.TIMED_OUT):
        return None
    who = f"the new pair (generation {rec.get('generation')})"
    if rec["phase"] == quality_gate.FAILED:
        figures = quality_gate.figures_text(rec)
        return Condition(
            DEGRADED,
            True,
            quality_gate.FAILED_REASON,
            f"{who} failed its quality gate against generation {rec.get('reference')} ({figures}): "
            f"{rec.get('message')}; the serving pair keeps serving",
        )
    return Condition(
        DEGRADED,
        True,
        quality_gate.TIMEOUT_REASON,
        f"{who}: {rec.get('message')}; the change is stalled and the serving pair keeps serving",
    )


def _warn_refused(status: Obj, conds: list[Condition], emit: Emit) -> None:
    """An ``AlreadyOwned`` Warning Event when objects are newly refused (not on every pass)."""
    degraded = next(c for c in conds if c.type == DEGRADED)
    if degraded.reason != ownership.ALREADY_OWNED:
        return
    before = next((c for c in status.get("conditions") or [] if c.get("type") == DEGRADED), {})
    if (before.get("reason"), before.get("message")) != (degraded.reason, degraded.message):
        emit("Warning", ownership.ALREADY_OWNED, degraded.message)


def _group_note(spec: Spec, role: str, groups: list[tuple[str, int]] | None) -> str:
    """For a multi-node pool short of ready replicas: the groups whose pods are not all ready."""
    if role not in POOLS or not spec.pool(role).multi_node:
        return ""
    size = spec.pool(role).nodes_per_replica
    shown = [f"{g} {n}/{size}" for g, n in (groups or [])[:MAX_NAMES]]
    more = len(groups or []) - len(shown)
    detail = f"; pods ready in incomplete groups: {', '.join(shown)}" if shown else ""
    return f" (groups of {size} pods{detail}{f' and {more} more' if more > 0 else ''})"


def _rollout_status(spec: Spec, out: Outcome, status: Obj, now: dt.datetime) -> Obj:
    """``status.rollout``: the handoff, the format generation, and during a format change its
    stage and the time of the last Service shift (which paces the next step)."""
    rollout_status: Obj = {"handoff": spec.handoff, "generation": children.formats_generation(spec)}
    if out.stage:
        rollout_status["stage"] = out.stage
        previous = (status.get("rollout") or {}).get("shiftedAt")
        if out.plan is not None and out.plan.shifted:
            rollout_status["shiftedAt"] = format_time(now)
        elif previous and out.stage in ("ShiftTraffic", "RemoveOldPair"):
            rollout_status["shiftedAt"] = previous
    return rollout_status


def _worst_rate(rates: dict[str, float | None]) -> Obj:
    """``status.mismatchRate``: the worst pool's; left out while a pool's is unknown and no known
    one is above 0 (a 0 would claim what no check showed)."""
    known = [r for r in rates.values() if r is not None]
    if known and (max(known) > 0 or len(known) == len(rates)):
        return {"mismatchRate": max(known)}
    return {}


def _integrity(spec: Spec, rates: dict[str, float | None]) -> Condition:
    if spec.integrity.mode == "off":
        return Condition(KV_INTEGRITY_DEGRADED, False, "IntegrityOff", "integrity checks are off")
    threshold = spec.integrity.mismatch_rate_threshold
    above = [f"{pool} {rate:.6g}" for pool, rate in rates.items() if rate is not None and rate > threshold]
    unknown = [pool for pool, rate in rates.items() if rate is None]
    if unknown and not above:
        return Condition(
            KV_INTEGRITY_DEGRADED,
            None,
            "NoRecentChecks",
            f"no KV integrity checks in {' and '.join(unknown)} over the last "
            f"{spec.integrity.window_seconds}s window (no traffic, or no agent reporting): the mismatch "
            "rate is unknown until checks resume",
        )
    if above:
        return Condition(
            KV_INTEGRITY_DEGRADED,
            True,
            "MismatchRateAboveThreshold",
            f"KV page mismatch rate above {threshold:g} over the {spec.integrity.window_seconds}s window: "
            + ", ".join(above),
        )
    return Condition(
        KV_INTEGRITY_DEGRADED,
        False,
        "WithinThreshold",
        f"KV page mismatch rate at most {threshold:g} over the {spec.integrity.window_seconds}s window",
    )


def _groups(spec: Spec, deps: dict[str, Obj | None], pods: list[Obj]) -> dict[str, list[tuple[str, int]]]:
    """Per multi-node pool served by a LeaderWorkerSet: its groups with pods not all ready."""
    out: dict[str, list[tuple[str, int]]] = {}
    for p in POOLS:
        dep, pool = deps.get(p), spec.pool(p)
        if pool.multi_node and dep is not None and dep.get("kind") == children.LWS_KIND:
            out[p] = incomplete_groups(pods, dep["metadata"]["name"], pool.nodes_per_replica)
    return out


def _pool_status(
    role: str,
    spec: Spec,
    dep: Obj | None,
    figures: Obj,
    rate: float | None,
    groups: list[tuple[str, int]] | None,
    resolved: str | None = None,
) -> Obj:
    """``status.<pool>``. Replicas are whole replicas: for a multi-node pool, LeaderWorkerSet groups
    (ready when every pod of the group is), with the group size and how many groups have pods
    not all ready. ``formats`` shows ``auto`` weights as the agents report them resolved
    (``resolved``), ``auto`` until one has."""
    pool = spec.pool(role)
    weights = resolved if pool.weight_format == SOURCE_DEFAULT and resolved else pool.weight_format
    ready = _replicas(dep, "readyReplicas")
    want = desired_replicas(spec, role, dep)
    out: Obj = {
        "desiredReplicas": want,
        "currentReplicas": _replicas(dep, "replicas"),
        "readyReplicas": ready,
        "ready": f"{ready}/{want}",
        "formats": f"{weights}/{pool.kv_cache_format}",
        **figures,
    }
    if rate is not None:  # None: no checks for a whole window, the rate is unknown
        out["mismatchRate"] = rate
    if pool.multi_node:
        out["nodesPerReplica"] = pool.nodes_per_replica
        out["incompleteGroups"] = len(groups or [])
    if pool.autoscaling is not None:
        out["autoscaling"] = {
            "minReplicas": pool.autoscaling.min_replicas,
            "maxReplicas": pool.autoscaling.max_replicas,
        }
    return out


async def reconcile(
    kube: Kube,
    body: Obj,
    cfg: Config,
    now: dt.datetime | None = None,
    emit: Emit | None = None,
    windows: dict[tuple[str, str], Obj] | None = None,
    lws_checked: dict[str, Any] | None = None,
    hooks: quality_gate.Hooks | None = None,
) -> Outcome:
    """Converge the children of one ModelDeployment and write its status.

    ``windows`` holds the mismatch-rate window snapshot per ModelDeployment across passes (the
    operator's memory); without it each pass starts a new window. ``lws_checked`` keeps the
    installed LeaderWorkerSet's version check (``lws_support``) for the operator's run. ``hooks``
    runs quality gates (quality_gate.py); without them a gate stays Running until its timeout."""
    now = now or dt.datetime.now(dt.UTC)
    emit = emit or (lambda *_: None)
    meta = body["metadata"]
    ns, name = meta["namespace"], meta["name"]
    status: Obj = dict(body.get("status") or {})
    spec = parse(body.get("spec") or {})
    out = Outcome(problems=formats.check(spec))
    lws = await _lws_served(kube)
    multi = [p for p in POOLS if spec.pool(p).multi_node]
    if multi and not lws and not out.problems:
        out.problems.append(
            formats.Problem(
                LWS_MISSING,
                f"{' and '.join(multi)} run(s) one replica over several pods (nodesPerReplica > 1), which "
                f"needs the LeaderWorkerSet API ({children.LWS_API_VERSION}); this cluster does not serve "
                "it: install LeaderWorkerSet (https://github.com/kubernetes-sigs/lws) or set "
                "nodesPerReplica: 1",
            )
        )
    if multi and lws and not out.problems:
        too_old = await lws_support.check(kube, lws_checked)
        if too_old is not None:
            out.problems.append(formats.Problem(lws_support.TOO_OLD, too_old))

    if out.problems:  # nothing is applied; the status shows the workloads as they are
        deps = {"router": await kube.get("Deployment", ns, children.child_name(name, "router"))}
        for role in POOLS:
            kind = children.workload_kind(spec, role)
            deps[role] = _pick(await _found(kube, ns, children.pool_deployment_name(name, role), lws), kind)
            if deps[role] is None:
                green = children.pool_deployment_name(name, role, children.GREEN)
                deps[role] = _pick(await _found(kube, ns, green, lws), kind)
    else:
        deps = await _converge(kube, meta, spec, cfg, status, now, out, lws, hooks, emit)
    for key, action in out.actions.items():
        emit("Normal", action.capitalize(), f"{key} {action}")
        log.info("child %s %s", key, action, extra={"modeldeployment": f"{ns}/{name}", "child": key})

    try:
        pods = await kube.list("Pod", ns, {children.MD_LABEL: name})
    except ApiError as err:  # no reports this pass; the figures read as zero until the next
        log.warning("cannot list pods of %s/%s: %s", ns, name, err.message)
        pods = []
    try:  # the agents' heartbeats (pagoda/agent_lease.py); none: the pod reports' own times
        renewed = renew_times(await kube.list("Lease", ns, {children.MD_LABEL: name}))
    except ApiError as err:
        log.warning("cannot list the agents' leases of %s/%s: %s", ns, name, err.message)
        renewed = {}
    reports = alive_at(reports_of(pods, now, cfg.stale_after_s), renewed, now)
    agents = split(reports, now, cfg.stale_after_s)

    # A pool status without a rate: unknown (no checks for a window) when the last pass wrote it.
    previous: dict[str, float | None] = {
        p: None
        if isinstance(status.get(p), dict) and "mismatchRate" not in status[p]
        else float((status.get(p) or {}).get("mismatchRate", 0.0) or 0.0)
        for p in POOLS
    }
    previous_rates = {p: r or 0.0 for p, r in previous.items()}
    key = (ns, name)
    snapshot_in = windows.get(key) if windows is not None else None
    if snapshot_in is None:  # operator (re)start: an older operator kept the snapshot in the status
        legacy = status.get("integrityWindow") or {}
        snapshot_in = legacy if isinstance(legacy.get("counters"), dict) else None
    checked, seen = mismatch_decay.checked_pools(snapshot_in, agents.fresh)
    window_rates, snapshot = window(
        snapshot_in,
        agents.fresh,
        now,
        spec.integrity.window_seconds,
        previous_rates,
        known=set(agents.fresh) | set(agents.stale),
    )
    rates, last_checks = mismatch_decay.decay(
        window_rates, checked, snapshot_in, previous, now, spec.integrity.window_seconds
    )
    snapshot.update({mismatch_decay.LAST_CHECKS: last_checks, mismatch_decay.SEEN: seen})
    if windows is not None:
        windows[key] = snapshot
    pools = {p: pool_figures(p, agents.fresh, agents.stale) for p in POOLS}
    groups = _groups(spec, deps, pods)
    conds = _conditions(spec, out, deps, pools, rates, sorted(agents.stale), cfg, groups, name)
    _warn_refused(status, conds, emit)
    rendered = merge(status.get("conditions"), conds, now, meta.get("generation"))

    owned: Obj = {
        "conditions": rendered,
        **{
            p: _pool_status(
                p,
                spec,
                deps[p],
                pools[p],
                rates[p],
                groups.get(p),
                resolved_weights(p, pods, agents.fresh, children.formats_generation(spec)),
            )
            for p in ("prefill", "decode")
        },
        "router": {
            "desiredReplicas": spec.router.replicas,
            "currentReplicas": _replicas(deps["router"], "replicas"),
            "readyReplicas": _replicas(deps["router"], "readyReplicas"),
            "ready": f"{_replicas(deps['router'], 'readyReplicas')}/{spec.router.replicas}",
        },
        **_worst_rate(rates),
        # The per-agent counter baselines stay in the operator's memory (2,048 of them would not
        # fit the object); the status shows when the window began and over how many agents.
        "integrityWindow": {"startTime": snapshot["startTime"], "agents": len(snapshot["counters"])},
        "agents": agent_entries(agents, cfg.status_max_agents),
        "agentsTotal": len(agents.fresh) + len(agents.stale),
        "rollout": _rollout_status(spec, out, status, now),
    }
    quality: Obj = {}
    if out.gate is not None:
        quality["gate"] = out.gate
    elif out.problems and isinstance((status.get("quality") or {}).get("gate"), dict):
        quality["gate"] = status["quality"]["gate"]  # nothing was converged: kept as it was
    if continuous := quality_of(pods, agents.fresh):
        quality["pools"] = continuous
    if quality:
        owned["quality"] = quality
    if meta.get("generation") is not None:
        owned["observedGeneration"] = meta["generation"]
    before = {k: status[k] for k in OWNED if k in status}
    if before != owned:
        patch = removals(before, owned)
        for k in OWNED:
            if k in before and k not in owned:
                patch[k] = None
        out.status_patch = patch
        await kube.patch("ModelDeployment", ns, name, {"status": patch}, subresource="status")
    for cond in transitions(status.get("conditions"), rendered):
        first = not status.get("conditions")
        if first and cond["status"] == "False":
            continue
        bad = (cond["type"] == READY and cond["status"] == "False") or (
            cond["type"] in (DEGRADED, KV_INTEGRITY_DEGRADED) and cond["status"] == "True"
        )
        emit("Warning" if bad else "Normal", f"{cond['type']}{cond['status']}", cond["message"])
    return out
