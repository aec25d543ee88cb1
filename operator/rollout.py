"""Zero-downtime format changes: blue/green by pool generation.

Every pool pod carries its pair's format generation (``pagoda.dev/formats``, a hash of the four
phase formats) and the pool Services (ClusterIP and headless) select one generation. A change of
any format makes a new generation; instead of rolling the serving pods it:

1. StartNewPair: creates the new prefill and decode Deployments in the free slot (``<md>-<pool>``
   or ``<md>-<pool>-green``) beside the serving pair, which keeps serving untouched;
2. ShiftTraffic: once both new pools are ready, moves the pools' Services to the new generation,
   one pool at a time in the order that keeps every mixed pair's KV handoff allowed (decode first
   unless the old prefill cannot hand off to the new decode), ``shift_settle_s`` apart so the
   router's DNS has caught up;
   With ``spec.rollout.qualityGate`` on, a ready new pair first waits in QualityGate until the
   gate (quality_gate.py) has passed its generation; a failed or timed-out gate never shifts;
3. RemoveOldPair: ``shift_settle_s`` after the last shift deletes the old pair (its pods drain).

A new pair that makes no progress within ``progressDeadlineSeconds`` (the Deployments' own
ProgressDeadlineExceeded) turns Degraded with the reason while the old pair keeps serving. Each
pass looks only at the live objects (and the time of the last shift in the status), so an operator
restart resumes at the right step. Services made before generations (no ``pagoda.dev/formats`` in
their selector) are first pinned to the serving pods' generation (PinServingPair): those pods are
relabelled (a rolling restart with the same formats) and the Services then select the label.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from pagoda.vocabulary import handoff_allowed

from .children import BLUE, FORMATS_LABEL, GREEN, LWS_KIND, generation_of, pod_templates

Obj = dict[str, Any]
POOLS = ("prefill", "decode")
QUALITY_GATE = "QualityGate"  # the stage between a ready new pair and the first shift
FLAGS = ("--prefill-weights", "--prefill-kv", "--decode-weights", "--decode-kv")


def _template(dep: Obj) -> Obj:
    """The (leader's) pod template of a live pool Deployment or LeaderWorkerSet."""
    return next(iter(pod_templates(dep)), {})


def _args(dep: Obj) -> list[str]:
    containers = (_template(dep).get("spec") or {}).get("containers") or [{}]
    return list(containers[0].get("args") or [])


def formats_of(dep: Obj) -> tuple[str, str, str, str]:
    """The four formats a live pool Deployment's pods run (from their command line)."""
    args = _args(dep)
    return tuple(args[args.index(f) + 1] if f in args[:-1] else "" for f in FLAGS)  # type: ignore[return-value]


def template_generation(dep: Obj) -> str | None:
    labels = (_template(dep).get("metadata") or {}).get("labels") or {}
    return labels.get(FORMATS_LABEL)


def gen_of(dep: Obj) -> str:
    """A live pool workload's generation: its label, else computed from its formats."""
    return template_generation(dep) or generation_of(formats_of(dep))


def _condition(status: Obj, kind: str) -> str | None:
    return next((str(c.get("status")) for c in status.get("conditions") or [] if c.get("type") == kind), None)


def only_current_pods(dep: Obj | None) -> bool:
    """Whether every pod of a workload runs its current template (no old pods left), read from the
    workload kind's own signals: ``status.observedGeneration`` when the controller sets it (the
    Deployment controller, LeaderWorkerSet from the releases that have it); a LeaderWorkerSet
    without it (older releases) by its conditions: no ``UpdateInProgress``, and ``Available``
    unless ``Progressing``. Then every replica must be an updated one."""
    if dep is None:
        return False
    status = dep.get("status") or {}
    generation = dep.get("metadata", {}).get("generation")
    observed = status.get("observedGeneration")
    if dep.get("kind") == LWS_KIND and observed is None:
        if _condition(status, "UpdateInProgress") == "True":
            return False
        if _condition(status, "Progressing") == "True" and _condition(status, "Available") != "True":
            return False
    elif generation is not None and (observed is None or observed < generation):
        return False
    return int(status.get("replicas", 0) or 0) == int(status.get("updatedReplicas", 0) or 0)


def ready(dep: Obj | None) -> bool:
    """All wanted replicas ready on the current template (a paused pool, 0 wanted, is ready)."""
    if dep is None or not only_current_pods(dep):
        return False
    want = int((dep.get("spec") or {}).get("replicas", 1) or 0)
    return int((dep.get("status") or {}).get("readyReplicas", 0) or 0) >= want


def stalled(dep: Obj | None) -> str | None:
    """The Deployment controller's ProgressDeadlineExceeded message, if it gave up on progress."""
    for cond in ((dep or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
            return str(cond.get("message") or "progress deadline exceeded")
    return None


@dataclass
class Plan:
    """What a pass does with the pool Deployments and Services."""

    slots: dict[str, str | None] = field(
        default_factory=dict
    )  # slot of the desired Deployment; None: not applied
    serving: dict[str, str | None] = field(default_factory=dict)  # generation the pool Services select
    scale_slots: dict[str, str] = field(default_factory=dict)  # the serving slot (autoscaler target)
    hold: list[str] = field(default_factory=list)  # old Deployments left as they are
    label: dict[str, str] = field(default_factory=dict)  # old Deployment -> generation label to add
    delete: list[str] = field(default_factory=list)  # old Deployments to delete
    stage: str | None = None
    message: str = ""
    shifted: bool = False  # a Service moved this pass (its time goes into the status)
    stalled: str | None = None


def _other(slot: str) -> str:
    return GREEN if slot == BLUE else BLUE


def plan(
    generation: str,
    deps: dict[tuple[str, str], Obj | None],
    services: dict[str, Obj | None],
    names: dict[tuple[str, str], str],
    new_kv: tuple[str, str],
    shifted_at: dt.datetime | None,
    now: dt.datetime,
    settle_s: float,
    gate_open: bool = True,
) -> Plan:
    """This pass's actions for the pool pair, from the live Deployments (by (pool, slot)) and the
    live pool Services; ``new_kv`` is the desired (prefill KV, decode KV). ``gate_open`` False (a
    quality gate that has not passed this generation): a ready new pair waits in stage QualityGate
    before the first Service moves."""
    out = Plan()
    selected: dict[str, str | None] = {}
    legacy: dict[str, bool] = {}
    for pool in POOLS:
        sel = ((services.get(pool) or {}).get("spec") or {}).get("selector") or {}
        selected[pool] = sel.get(FORMATS_LABEL)
        legacy[pool] = services.get(pool) is not None and FORMATS_LABEL not in sel
    old: dict[str, tuple[str, Obj]] = {}
    new: dict[str, str] = {}
    for pool in POOLS:
        live = {slot: d for slot in (BLUE, GREEN) if (d := deps.get((pool, slot))) is not None}
        mine = next((s for s, d in live.items() if gen_of(d) == generation), None)
        others = [(s, d) for s, d in live.items() if gen_of(d) != generation]
        if len(others) > 1 or (others and mine is None and len(live) > 1):
            # Two generations neither of which is wanted (a change during a change): keep the one
            # the Service selects, delete the other.
            keep = next((o for o in others if gen_of(o[1]) == selected[pool]), others[0])
            out.delete += [names[(pool, s)] for s, _ in others if s != keep[0]]
            others = [keep]
        if others:
            old[pool] = others[0]
        new[pool] = mine or (_other(others[0][0]) if others else BLUE)

    if not old:  # steady: apply in place; pin the Services once the pods carry the label
        for pool in POOLS:
            out.slots[pool] = new[pool]
            out.scale_slots[pool] = new[pool]
            dep = deps.get((pool, new[pool]))
            labelled = dep is not None and template_generation(dep) == generation and only_current_pods(dep)
            out.serving[pool] = None if legacy[pool] and not labelled else generation
        return out

    for pool in POOLS:  # the serving slot: the one the pool's Services select
        on_new = pool not in old or selected[pool] == generation
        out.scale_slots[pool] = new[pool] if on_new else old[pool][0]

    if any(legacy[pool] for pool in old):  # pin the Services to the serving pods first
        out.stage = "PinServingPair"
        out.message = "labelling the serving pods with their format generation before the new pair starts"
        for pool in POOLS:
            out.slots[pool] = None if pool in old else new[pool]
            if pool not in old:
                out.serving[pool] = selected[pool] if not legacy[pool] else None
                continue
            slot, dep = old[pool]
            name = names[(pool, slot)]
            gen = gen_of(dep)
            if template_generation(dep) != gen:
                out.label[name] = gen
            else:
                out.hold.append(name)
            out.serving[pool] = gen if template_generation(dep) == gen and only_current_pods(dep) else None
        return out

    if all(selected[pool] == generation for pool in POOLS):  # shifted: remove the old pair
        out.slots = dict(new)
        out.serving = {pool: generation for pool in POOLS}
        out.stage = "RemoveOldPair"
        waiting = shifted_at is not None and (now - shifted_at).total_seconds() < settle_s
        for pool, (slot, _) in old.items():
            (out.hold if waiting else out.delete).append(names[(pool, slot)])
        out.message = f"traffic is on format generation {generation}; the old pair is " + (
            "removed once the routers have moved" if waiting else "being removed (its pods drain)"
        )
        return out

    out.slots = dict(new)
    out.serving = dict(selected)
    out.hold = [names[(pool, slot)] for pool, (slot, _) in old.items()]
    if not all(ready(deps.get((pool, new[pool]))) for pool in POOLS):  # (the autoscaler stays on the old)
        out.stage = "StartNewPair"
        out.message = (
            f"format change: the new pair (generation {generation}) is starting beside the serving one, "
            "which keeps serving"
        )
        problems = [f"{names[(p, new[p])]}: {m}" for p in POOLS if (m := stalled(deps.get((p, new[p]))))]
        out.stalled = "; ".join(problems) or None
        return out
    if not gate_open and all(selected[pool] != generation for pool in POOLS):
        out.stage = QUALITY_GATE
        out.message = (
            f"format change: the new pair (generation {generation}) is ready; its quality gate decides "
            "before any traffic moves"
        )
        return out
    out.stage = "ShiftTraffic"
    out.message = f"format change: moving traffic to the new pair (generation {generation})"
    old_prefill_kv = formats_of(old["prefill"][1])[1] if "prefill" in old else new_kv[0]
    first = "decode" if handoff_allowed(old_prefill_kv, new_kv[1]) else "prefill"
    second = "prefill" if first == "decode" else "decode"
    if selected[first] != generation:
        out.serving[first] = generation
        out.shifted = True
    elif shifted_at is None or (now - shifted_at).total_seconds() >= settle_s:
        out.serving[second] = generation
        out.shifted = True
    for pool in POOLS:
        if out.serving[pool] == generation:
            out.scale_slots[pool] = new[pool]
    return out
