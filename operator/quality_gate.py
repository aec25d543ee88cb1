"""The quality gate of a format change: score the probe set through both pairs, then decide.

Once the new pool pair is ready (rollout stage QualityGate), each new pool and the serving pool it
replaces answer ``POST /internal/score`` (pagoda/quality_probe.py): the reference (the serving pool)
scores the probe set first, the candidate (the new pool) then scores the reference's tokens and
top-k targets, and ``compare`` gives mean KL, top-1 and greedy agreement per pool. The gate passes
when every pool is within ``spec.rollout.qualityGate``.

State lives in the object: ``status.quality.gate`` is the gate of one generation (``generation``,
``phase`` Running/Passed/Failed/TimedOut, ``startedAt``, the figures). A reconcile pass starts the
record and a background task (``GateRunner``, one per ModelDeployment and generation); the task
writes its decision into that record under the ModelDeployment's lock and asks for a pass; the
pass reads the decision. A restarted operator finds a Running record and starts the task again
(the timeout still counts from ``startedAt``). The task retries a pool that does not answer (or
answers something malformed) until the timeout; the pass turns an overdue Running record into
TimedOut, which stalls the change without shifting.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime as dt
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from pagoda.agent_report import format_time, parse_time
from pagoda.internal_proof import derive, request_header
from pagoda.quality_probe import (
    REFERENCE_CONFIGMAP_KEY,
    SCORE_PATH,
    Comparison,
    ProbeError,
    ProbeSet,
    ScoreResponse,
    compare,
)

from . import children, ownership
from .config import Config
from .kube import ApiError, Kube
from .spec import POOLS, QualityGate

Obj = dict[str, Any]
Emit = Callable[[str, str, str], None]

log = logging.getLogger("pagoda.operator")

RUNNING, PASSED, FAILED, TIMED_OUT = "Running", "Passed", "Failed", "TimedOut"
FAILED_REASON = "QualityGateFailed"
TIMEOUT_REASON = "QualityGateTimeout"
PROBES_KEY = "probes.json"  # the key of a spec.rollout.qualityGate.probeSet ConfigMap
REFERENCE_COMPONENT = children.QUALITY_REFERENCE
MAX_MESSAGE = 512


def reference_configmap(md_name: str) -> str:
    """The ConfigMap holding the reference answer accepted at the last gated change."""
    return children.child_name(md_name, REFERENCE_COMPONENT)


# ---------------------------------------------------------------- pure: records and decisions


def thresholds(gate: QualityGate) -> Obj:
    return {"maxKL": gate.max_kl, "minTop1": gate.min_top1, "minGreedyAgreement": gate.min_greedy_agreement}


def verdict(gate: QualityGate, figures: dict[str, Comparison]) -> list[str]:
    """What is out of bounds, per pool ("decode: KL 0.31 > 0.02"); empty: the gate passes."""
    out = []
    for pool, c in figures.items():
        if not c.mean_kl <= gate.max_kl:  # (a NaN fails)
            out.append(f"{pool}: mean KL {c.mean_kl:.4g} > maxKL {gate.max_kl:g}")
        if not c.top1 >= gate.min_top1:
            out.append(f"{pool}: top-1 agreement {c.top1:.4g} < minTop1 {gate.min_top1:g}")
        if not c.greedy_prefix >= gate.min_greedy_agreement:
            out.append(
                f"{pool}: greedy agreement {c.greedy_prefix:.4g} < minGreedyAgreement "
                f"{gate.min_greedy_agreement:g}"
            )
    return out


def current(status: Obj, generation: str) -> Obj | None:
    """``status.quality.gate`` when it is this generation's."""
    rec = (status.get("quality") or {}).get("gate")
    return dict(rec) if isinstance(rec, dict) and rec.get("generation") == generation else None


def started(generation: str, reference: str, gate: QualityGate, now: dt.datetime) -> Obj:
    """A new Running record of the gate of ``generation`` against the serving ``reference``."""
    return {
        "generation": generation,
        "reference": reference,
        "phase": RUNNING,
        "startedAt": format_time(now),
        "timeoutSeconds": gate.timeout_s,
        "thresholds": thresholds(gate),
        "message": "scoring the probe set through the new pair and the serving one",
    }


def overdue(record: Obj, gate: QualityGate, now: dt.datetime) -> bool:
    """A Running record older than the timeout (a record without a time counts from now)."""
    at = parse_time(record.get("startedAt"))
    return record.get("phase") == RUNNING and at is not None and (now - at).total_seconds() > gate.timeout_s


def timed_out(record: Obj, now: dt.datetime) -> Obj:
    why = record.get("lastError")
    msg = f"the quality gate did not finish within {record.get('timeoutSeconds')}s" + (
        f" (last error: {why})" if why else ""
    )
    return {**record, "phase": TIMED_OUT, "finishedAt": format_time(now), "message": msg[:MAX_MESSAGE]}


def decided(record: Obj, gate: QualityGate, figures: dict[str, Comparison], now: dt.datetime) -> Obj:
    """The record with its decision: Passed, or Failed with what was out of bounds."""
    bad = verdict(gate, figures)
    out = {
        **record,
        "phase": FAILED if bad else PASSED,
        "finishedAt": format_time(now),
        "pools": {p: c.to_status() for p, c in figures.items()},
        "meanKL": round(max(c.mean_kl for c in figures.values()), 6),
        "top1": round(min(c.top1 for c in figures.values()), 4),
        "greedyPrefix": round(min(c.greedy_prefix for c in figures.values()), 4),
    }
    out.pop("lastError", None)
    out["message"] = ("; ".join(bad) if bad else "every pool within the gate's thresholds")[:MAX_MESSAGE]
    return out


def figures_text(record: Obj) -> str:
    pools = record.get("pools") or {}
    return ", ".join(
        f"{p} KL {f.get('meanKL')}, top-1 {f.get('top1')}, greedy {f.get('greedyPrefix')}"
        for p, f in sorted(pools.items())
    )


# ---------------------------------------------------------------- the score endpoints


@dataclass(frozen=True)
class Target:
    """One pool of one pair whose ``/internal/score`` the gate calls."""

    namespace: str
    md: str
    pool: str
    slot: str
    generation: str
    role: str  # "reference" (the serving pool) or "candidate" (the new pool)


async def pod_url(kube: Kube, cfg: Config, target: Target) -> str | None:
    """The base URL of a ready pod of the target's workload: ``cfg.quality_score_url`` formatted
    with the target's fields when set (e.g. a per-slot Service), else the first ready pod's IP."""
    if cfg.quality_score_url:
        return cfg.quality_score_url.format(**target.__dict__, port=children.PORT)
    labels = {
        children.MD_LABEL: target.md,
        children.POOL_LABEL: target.pool,
        children.FORMATS_LABEL: target.generation,
    }
    for pod in await kube.list("Pod", target.namespace, labels):
        status = pod.get("status") or {}
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
        )
        if ready and status.get("podIP") and not (pod.get("metadata") or {}).get("deletionTimestamp"):
            return f"http://{status['podIP']}:{children.PORT}"
    return None


# The injection point: where a target's score endpoint is. Tests (and anything pointing the gate at
# other servers) replace it with their own coroutine function of the same signature.
Resolver = Callable[[Kube, Config, Target], Awaitable[str | None]]
resolve_url: Resolver = pod_url


async def score(
    session: aiohttp.ClientSession, base: str, key: bytes, body: Obj, timeout_s: float
) -> ScoreResponse:
    """POST one score request with the internal proof; the parsed answer or ProbeError."""
    url = base.rstrip("/") + SCORE_PATH
    headers = request_header(key, "POST", urlsplit(url).path)
    try:
        async with session.post(
            url, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            if resp.status != 200:
                text = (await resp.text())[:200]
                raise ProbeError(f"{url} answered {resp.status}: {text}")
            raw = await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as err:
        raise ProbeError(f"{url}: {type(err).__name__}: {err}") from None
    return ScoreResponse.from_json(raw)


async def probe_set(kube: Kube, namespace: str, name: str | None) -> ProbeSet:
    """The built-in probe set, or the one in ConfigMap ``name`` (key probes.json)."""
    if name is None:
        return ProbeSet()
    cm = await kube.get("ConfigMap", namespace, name)
    if cm is None or PROBES_KEY not in (cm.get("data") or {}):
        raise ProbeError(
            f"ConfigMap {namespace}/{name} (spec.rollout.qualityGate.probeSet) has no {PROBES_KEY}"
        )
    try:
        raw = json.loads(cm["data"][PROBES_KEY])
    except json.JSONDecodeError as err:
        raise ProbeError(f"ConfigMap {namespace}/{name} {PROBES_KEY}: {err}") from None
    if not isinstance(raw, dict):
        raise ProbeError(f"ConfigMap {namespace}/{name} {PROBES_KEY}: a JSON object")
    return ProbeSet.from_mapping(raw)


async def internal_key(kube: Kube, namespace: str, md: str) -> bytes:
    """The request key derived from ``<md>-internal``'s token (read from the API, never cached)."""
    raw = getattr(kube, "kube", kube)  # CachedKube blanks Secret values: read past it
    secret = await raw.get("Secret", namespace, children.child_name(md, children.INTERNAL))
    value = ((secret or {}).get("data") or {}).get(children.INTERNAL_TOKEN_KEY)
    if not value:
        raise ProbeError(f"Secret {md}-internal has no {children.INTERNAL_TOKEN_KEY}")
    return derive(base64.b64decode(value).decode().strip(), "request")


async def measure(
    kube: Kube, cfg: Config, meta: Obj, gate: QualityGate, slots: dict[str, tuple[str, str]], record: Obj
) -> tuple[dict[str, Comparison], ScoreResponse]:
    """Score every pool once: per pool its comparison, and the reference decode pool's answer.
    ``slots``: pool -> (reference slot, candidate slot)."""
    ns, md = meta["namespace"], meta["name"]
    key = await internal_key(kube, ns, md)
    probes = await probe_set(kube, ns, gate.probe_set)
    figures: dict[str, Comparison] = {}
    kept: ScoreResponse | None = None
    async with aiohttp.ClientSession() as session:
        for pool in POOLS:
            ref_slot, cand_slot = slots[pool]
            urls = []
            for role, slot, gen in (
                ("reference", ref_slot, record["reference"]),
                ("candidate", cand_slot, record["generation"]),
            ):
                url = await resolve_url(kube, cfg, Target(ns, md, pool, slot, gen, role))
                if url is None:
                    raise ProbeError(f"no ready {role} {pool} pod (generation {gen}) to score")
                urls.append(url)
            reference = await score(session, urls[0], key, probes.request(), cfg.quality_request_s)
            candidate = await score(session, urls[1], key, probes.request(reference), cfg.quality_request_s)
            figures[pool] = compare(reference, candidate)
            if pool == "decode" or kept is None:
                kept = reference
    assert kept is not None
    return figures, kept


async def store_reference(kube: Kube, meta: Obj, reference: ScoreResponse) -> None:
    """Create or replace ``<md>-quality-reference`` (owned by the ModelDeployment)."""
    ns, name = meta["namespace"], reference_configmap(meta["name"])
    data = {REFERENCE_CONFIGMAP_KEY: json.dumps(reference.to_json(), separators=(",", ":"))}
    live = await kube.get("ConfigMap", ns, name)
    if live is None:
        await kube.create(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {
                    "name": name,
                    "namespace": ns,
                    "labels": children.labels(meta["name"], REFERENCE_COMPONENT),
                    "ownerReferences": [children.owner_reference(meta)],
                },
                "data": data,
            }
        )
    else:
        why = ownership.foreign(live, meta)
        if why is not None:  # never overwrite what is not ours: the gate cannot pass (it times out)
            raise ProbeError(f"ConfigMap {ns}/{name} {why}; the reference answer cannot be kept")
        await kube.patch("ConfigMap", ns, name, {"data": data})


# ---------------------------------------------------------------- the background task


@dataclass
class Job:
    """What one gate task needs; ``lock`` is the ModelDeployment's pass lock, ``repass`` asks
    for a pass once the decision is written."""

    kube: Kube
    cfg: Config
    meta: Obj
    gate: QualityGate
    slots: dict[str, tuple[str, str]]
    record: Obj
    lock: asyncio.Lock
    emit: Emit
    repass: Callable[[], Awaitable[None]] | None = None


async def _write(job: Job, update: Callable[[Obj], Obj]) -> bool:
    """Under the lock: if the live record is still this Running gate, write ``update(record)``."""
    ns, name = job.meta["namespace"], job.meta["name"]
    async with job.lock:
        live = await job.kube.get("ModelDeployment", ns, name)
        rec = current((live or {}).get("status") or {}, job.record["generation"])
        if rec is None or rec.get("phase") != RUNNING:
            return False
        new = update(rec)
        await job.kube.patch(
            "ModelDeployment", ns, name, {"status": {"quality": {"gate": new}}}, subresource="status"
        )
        job.record = new
        return True


async def run(job: Job, clock: Callable[[], float] = time.monotonic) -> None:
    """Score until a decision or the timeout; write the decision (Events for pass and fail), then
    ask for a pass (which acts on the decision, or records the timeout)."""
    try:
        await _decide(job, clock)
    finally:
        if job.repass is not None:
            with contextlib.suppress(Exception):
                await job.repass()


async def _decide(job: Job, clock: Callable[[], float]) -> None:
    at = parse_time(job.record.get("startedAt")) or dt.datetime.now(dt.UTC)
    deadline = clock() + max(job.gate.timeout_s - (dt.datetime.now(dt.UTC) - at).total_seconds(), 0.0)
    while True:
        try:
            figures, reference = await measure(job.kube, job.cfg, job.meta, job.gate, job.slots, job.record)
            if not verdict(job.gate, figures):  # passes: keep the reference before the decision shows
                await store_reference(job.kube, job.meta, reference)
            break
        except Exception as err:  # ProbeError, ApiError, or a bug: retried until the timeout, reported
            why = str(err) if isinstance(err, ProbeError | ApiError) else f"{type(err).__name__}: {err}"
            why = why[:MAX_MESSAGE]
            log.info("quality gate of %s: %s", job.meta["name"], why)
            if job.record.get("lastError") != why:
                await _write(job, lambda r, why=why: {**r, "lastError": why})
        if clock() + job.cfg.quality_retry_s >= deadline:
            await asyncio.sleep(max(deadline - clock(), 0.0) + 0.05)  # then the pass sees it overdue
            return
        await asyncio.sleep(job.cfg.quality_retry_s)
    now = dt.datetime.now(dt.UTC)
    result = decided(job.record, job.gate, figures, now)
    if await _write(job, lambda r: decided(r, job.gate, figures, now)):
        if result["phase"] == PASSED:
            job.emit(
                "Normal", "QualityGatePassed", f"generation {result['generation']}: {figures_text(result)}"
            )
        else:
            job.emit("Warning", FAILED_REASON, f"generation {result['generation']}: {result['message']}")


class GateRunner:
    """The running gate tasks, one per (namespace, name, generation) (the operator's memory; the
    decisions are in the objects)."""

    def __init__(self) -> None:
        self.tasks: dict[tuple[str, str, str], asyncio.Task] = {}

    def ensure(self, job: Job) -> bool:
        """Start the gate task of this generation unless it runs; True when started."""
        key = (job.meta["namespace"], job.meta["name"], job.record["generation"])
        for other in [k for k in self.tasks if k[:2] == key[:2] and k != key]:
            task = self.tasks.pop(other)  # a newer generation replaces an older gate
            if task is not asyncio.current_task():
                task.cancel()
        task = self.tasks.get(key)
        if task is not None and not task.done():
            return False
        self.tasks[key] = asyncio.create_task(run(job), name=f"pagoda-quality-gate-{key[1]}")
        return True

    def stop(self, namespace: str, name: str) -> None:
        """Cancel the gate tasks of one ModelDeployment; never the calling task (a gate task's own
        ``repass`` runs a pass that may stop it: it is finishing anyway)."""
        for key in [k for k in self.tasks if k[:2] == (namespace, name)]:
            task = self.tasks.pop(key)
            if task is not asyncio.current_task():
                task.cancel()

    async def close(self) -> None:
        for task in self.tasks.values():
            task.cancel()
        for task in self.tasks.values():
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self.tasks.clear()


@dataclass
class Hooks:
    """What a reconcile pass needs to run gates: the runner, the ModelDeployment's pass lock (the
    task writes under it) and a coroutine asking for a pass once the decision is written."""

    runner: GateRunner
    lock: asyncio.Lock
    repass: Callable[[], Awaitable[None]] | None = None
