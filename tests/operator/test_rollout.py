"""The blue/green plan of a format change, step by step on hand-made live objects."""

from __future__ import annotations

import datetime as dt

import pytest

from pagoda.operator import rollout
from pagoda.operator.children import BLUE, FORMATS_LABEL, GREEN, generation_of

NOW = dt.datetime(2026, 11, 29, 12, 0, 0, tzinfo=dt.UTC)
OLD = ("fp8", "bf16", "int4", "bf16")
NEW = ("fp8", "fp8_e4m3", "int4", "fp8_e4m3")
G_OLD, G_NEW = generation_of(OLD), generation_of(NEW)
NAMES = {
    (p, s): f"m-{p}" if s == BLUE else f"m-{p}-green" for p in ("prefill", "decode") for s in (BLUE, GREEN)
}


def dep(formats: tuple, ready: int = 1, want: int = 1, labelled: bool = True, **status: object) -> dict:
    args = ["serve", "--prefill-weights", formats[0], "--prefill-kv", formats[1]]
    args += ["--decode-weights", formats[2], "--decode-kv", formats[3]]
    labels = {FORMATS_LABEL: generation_of(formats)} if labelled else {}
    return {
        "metadata": {"generation": 1},
        "spec": {
            "replicas": want,
            "template": {"metadata": {"labels": labels}, "spec": {"containers": [{"args": args}]}},
        },
        "status": {
            "observedGeneration": 1,
            "replicas": ready,
            "updatedReplicas": ready,
            "readyReplicas": ready,
            **status,
        },
    }


def svc(gen: str | None) -> dict:
    selector = {"pagoda.dev/pool": "x", **({FORMATS_LABEL: gen} if gen else {})}
    return {"spec": {"selector": selector}}


def run(
    deps: dict,
    services: dict,
    shifted_at: dt.datetime | None = None,
    new: tuple = NEW,
    gate_open: bool = True,
) -> rollout.Plan:
    full = {key: deps.get(key) for key in NAMES}
    return rollout.plan(
        generation_of(new), full, services, NAMES, (new[1], new[3]), shifted_at, NOW, 15, gate_open
    )


BLUE_OLD = {("prefill", BLUE): dep(OLD), ("decode", BLUE): dep(OLD)}
ON_OLD = {"prefill": svc(G_OLD), "decode": svc(G_OLD)}


def test_steady_state_applies_in_place() -> None:
    plan = run(
        {("prefill", BLUE): dep(NEW), ("decode", BLUE): dep(NEW)},
        {"prefill": svc(G_NEW), "decode": svc(G_NEW)},
    )
    assert plan.stage is None and plan.slots == {"prefill": BLUE, "decode": BLUE} and not plan.delete
    assert plan.serving == {"prefill": G_NEW, "decode": G_NEW}
    fresh = run({}, {})
    assert fresh.slots == {"prefill": BLUE, "decode": BLUE} and fresh.serving == {
        "prefill": G_NEW,
        "decode": G_NEW,
    }


def test_a_format_change_starts_the_new_pair_beside_the_serving_one() -> None:
    plan = run(BLUE_OLD, ON_OLD)
    assert plan.stage == "StartNewPair"
    assert plan.slots == {"prefill": GREEN, "decode": GREEN}  # the new pair goes to the free slot
    assert sorted(plan.hold) == ["m-decode", "m-prefill"] and not plan.delete  # the serving pair is untouched
    assert plan.serving == {"prefill": G_OLD, "decode": G_OLD} and plan.scale_slots["decode"] == BLUE
    starting = {**BLUE_OLD, ("prefill", GREEN): dep(NEW, ready=0), ("decode", GREEN): dep(NEW)}
    assert run(starting, ON_OLD).stage == "StartNewPair"


def test_traffic_shifts_one_pool_at_a_time_in_a_handoff_safe_order() -> None:
    both = {**BLUE_OLD, ("prefill", GREEN): dep(NEW), ("decode", GREEN): dep(NEW)}
    plan = run(both, ON_OLD)
    # old prefill bf16 -> new decode fp8_e4m3 is allowed: decode moves first.
    assert plan.stage == "ShiftTraffic" and plan.shifted
    assert plan.serving == {"prefill": G_OLD, "decode": G_NEW}
    assert plan.scale_slots == {"prefill": BLUE, "decode": GREEN}
    half = {"prefill": svc(G_OLD), "decode": svc(G_NEW)}
    waiting = run(both, half, shifted_at=NOW - dt.timedelta(seconds=5))
    assert not waiting.shifted and waiting.serving == {"prefill": G_OLD, "decode": G_NEW}
    later = run(both, half, shifted_at=NOW - dt.timedelta(seconds=20))
    assert later.shifted and later.serving == {"prefill": G_NEW, "decode": G_NEW}


def test_fp8_to_bf16_moves_prefill_first() -> None:
    old, new = ("fp8", "fp8_e4m3", "int4", "fp8_e4m3"), ("fp8", "bf16", "int4", "bf16")
    deps = {
        ("prefill", BLUE): dep(old),
        ("decode", BLUE): dep(old),
        ("prefill", GREEN): dep(new),
        ("decode", GREEN): dep(new),
    }
    services = {"prefill": svc(generation_of(old)), "decode": svc(generation_of(old))}
    plan = run(deps, services, new=new)
    # old prefill fp8 -> new decode bf16 is refused; new prefill bf16 -> old decode fp8 is fine.
    assert plan.serving == {"prefill": generation_of(new), "decode": generation_of(old)}


def test_the_old_pair_goes_after_the_shift_has_settled() -> None:
    both = {**BLUE_OLD, ("prefill", GREEN): dep(NEW), ("decode", GREEN): dep(NEW)}
    moved = {"prefill": svc(G_NEW), "decode": svc(G_NEW)}
    soon = run(both, moved, shifted_at=NOW - dt.timedelta(seconds=3))
    assert (
        soon.stage == "RemoveOldPair" and not soon.delete and sorted(soon.hold) == ["m-decode", "m-prefill"]
    )
    late = run(both, moved, shifted_at=NOW - dt.timedelta(seconds=30))
    assert sorted(late.delete) == ["m-decode", "m-prefill"] and late.slots == {
        "prefill": GREEN,
        "decode": GREEN,
    }
    assert late.scale_slots == {"prefill": GREEN, "decode": GREEN}  # the autoscalers follow the traffic
    # Then green is the serving slot in steady state; the next change goes back to blue.
    after = run({("prefill", GREEN): dep(NEW), ("decode", GREEN): dep(NEW)}, moved)
    assert after.stage is None and after.slots == {"prefill": GREEN, "decode": GREEN}
    again = run({("prefill", GREEN): dep(NEW), ("decode", GREEN): dep(NEW)}, moved, new=OLD)
    assert again.stage == "StartNewPair" and again.slots == {"prefill": BLUE, "decode": BLUE}


def test_a_paused_pair_changes_formats_without_waiting_for_pods() -> None:
    paused = {("prefill", BLUE): dep(OLD, 0, 0), ("decode", BLUE): dep(OLD, 0, 0)}
    new = {**paused, ("prefill", GREEN): dep(NEW, 0, 0), ("decode", GREEN): dep(NEW, 0, 0)}
    assert run(new, ON_OLD).stage == "ShiftTraffic"  # nothing to wait for


def test_a_stalled_new_pair_is_reported_and_the_old_one_kept() -> None:
    stuck = {
        "conditions": [
            {
                "type": "Progressing",
                "status": "False",
                "reason": "ProgressDeadlineExceeded",
                "message": 'ReplicaSet "x" has timed out progressing.',
            }
        ]
    }
    deps = {**BLUE_OLD, ("prefill", GREEN): dep(NEW), ("decode", GREEN): dep(NEW, ready=0, **stuck)}
    plan = run(deps, ON_OLD)
    assert (
        plan.stage == "StartNewPair"
        and plan.stalled == 'm-decode-green: ReplicaSet "x" has timed out progressing.'
    )
    assert sorted(plan.hold) == ["m-decode", "m-prefill"] and plan.serving == {
        "prefill": G_OLD,
        "decode": G_OLD,
    }


@pytest.mark.parametrize("change", [False, True])
def test_services_from_before_generations_are_pinned_first(change: bool) -> None:
    legacy = {("prefill", BLUE): dep(OLD, labelled=False), ("decode", BLUE): dep(OLD, labelled=False)}
    unpinned = {"prefill": svc(None), "decode": svc(None)}
    plan = run(legacy, unpinned, new=NEW if change else OLD)
    if not change:  # an operator upgrade alone: apply in place (adds the label), pin once rolled
        assert plan.stage is None and plan.serving == {"prefill": None, "decode": None}
        rolled = run({("prefill", BLUE): dep(OLD), ("decode", BLUE): dep(OLD)}, unpinned, new=OLD)
        assert rolled.serving == {"prefill": G_OLD, "decode": G_OLD}
        return
    assert plan.stage == "PinServingPair" and plan.label == {"m-prefill": G_OLD, "m-decode": G_OLD}
    assert plan.slots == {"prefill": None, "decode": None}  # nothing new until the Services are pinned
    relabelled = run({("prefill", BLUE): dep(OLD), ("decode", BLUE): dep(OLD)}, unpinned)
    assert relabelled.serving == {"prefill": G_OLD, "decode": G_OLD} and not relabelled.label
    assert run({("prefill", BLUE): dep(OLD), ("decode", BLUE): dep(OLD)}, ON_OLD).stage == "StartNewPair"


def test_a_closed_quality_gate_holds_a_ready_pair_before_the_first_shift_only() -> None:
    both = {**BLUE_OLD, ("prefill", GREEN): dep(NEW), ("decode", GREEN): dep(NEW)}
    held = run(both, ON_OLD, gate_open=False)
    assert held.stage == "QualityGate" and not held.shifted
    assert held.serving == {"prefill": G_OLD, "decode": G_OLD} and held.scale_slots["decode"] == BLUE
    assert held.slots == {"prefill": GREEN, "decode": GREEN} and not held.delete  # both pairs kept
    starting = {**BLUE_OLD, ("prefill", GREEN): dep(NEW, ready=0), ("decode", GREEN): dep(NEW)}
    assert run(starting, ON_OLD, gate_open=False).stage == "StartNewPair"  # not ready: nothing to gate
    half = {"prefill": svc(G_OLD), "decode": svc(G_NEW)}  # one pool moved (the gate came later)
    assert run(both, half, shifted_at=NOW - dt.timedelta(seconds=30), gate_open=False).stage == "ShiftTraffic"
