"""Prometheus metrics of a worker or router (prometheus-client), every name prefixed ``pagoda_``.

Event metrics (requests, latencies, tokens) are updated as outputs arrive; engine state (KV pages,
running/waiting, integrity counters, weight bytes, formats) is read from the engine loop's latest
snapshot at scrape time. Every series has a ``pool`` label: the worker's pool (prefill, decode,
both or router); KV series add ``kv_pool``, the engine's own page pool they describe.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from pagoda.agent_report import WEIGHT_PARTS

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class KVPoolOccupancy(Protocol):
    """What the metrics read of one KV page pool (the engine's ``KVPoolState``; this module stays
    torch- and engine-free, for the router)."""

    @property
    def name(self) -> str: ...
    @property
    def num_pages(self) -> int: ...
    @property
    def num_used(self) -> int: ...
    @property
    def page_size(self) -> int: ...
    @property
    def capacity_tokens(self) -> int: ...
    @property
    def kv_format(self) -> str: ...


@dataclass
class EngineSnapshot:
    """Engine state copied by the engine thread (safe to read from any thread)."""

    ready: bool = False
    pools: list[KVPoolOccupancy] = field(default_factory=list)
    running: int = 0
    waiting: int = 0
    integrity_mode: str = "off"
    integrity: dict[str, int] = field(default_factory=dict)
    weight_bytes: int = 0
    weight_breakdown: dict[str, Any] = field(default_factory=dict)  # EngineState.weight_breakdown
    formats: dict[str, str] = field(default_factory=dict)
    prefix_hit_tokens: int = 0
    preemptions: dict[str, int] = field(default_factory=dict)  # by KV pool (EngineState.preemptions_by_pool)
    step_budget: dict[str, Any] = field(default_factory=dict)  # EngineState.step_budget ({}: no budget)
    generation_tokens: int = 0
    model: str = ""

    @property
    def kv_capacity_tokens(self) -> int:
        return sum(p.capacity_tokens for p in self.pools)

    @property
    def kv_used_tokens(self) -> int:
        return sum(p.num_used * p.page_size for p in self.pools)


class ServeMetrics:
    """The metrics of one process, on its own registry (so tests can run several in one process)."""

    def __init__(self, pool: str, snapshot: Callable[[], EngineSnapshot] | None = None) -> None:
        self.pool = pool
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.requests = Counter(
            "pagoda_requests",
            "Requests by outcome (stop, length, abort, error, rejected, invalid)",
            ["pool", "outcome"],
            registry=r,
        )
        self.ttft = Histogram(
            "pagoda_time_to_first_token_seconds",
            "Time from arrival to the first generated token",
            ["pool"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "pagoda_inter_token_latency_seconds",
            "Time between consecutive generated tokens",
            ["pool"],
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "pagoda_request_latency_seconds",
            "Time from arrival to the last token",
            ["pool"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "pagoda_queue_time_seconds",
            "Time a request waited in the admission queue, from arrival to its first token",
            ["pool"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_refusals = Counter(
            "pagoda_queue_refusals",
            "Requests refused by the admission queue: queue_full, expected_wait (over the maximum "
            "queue time), tenant_share (the tenant holds its share), timeout (waited past it)",
            ["pool", "reason"],
            registry=r,
        )
        for reason in ("queue_full", "expected_wait", "tenant_share", "timeout"):
            self.queue_refusals.labels(pool, reason)
        self.prompt_tokens = Counter(
            "pagoda_prompt_tokens", "Prompt tokens of finished requests", ["pool"], registry=r
        )
        self.generation_tokens = Counter("pagoda_generation_tokens", "Generated tokens", ["pool"], registry=r)
        self.cached_tokens = Counter(
            "pagoda_prefix_cache_hit_tokens",
            "Prompt tokens served from the prefix cache (prefill skipped)",
            ["pool"],
            registry=r,
        )
        self.kv_transfer_pages = Counter(
            "pagoda_kv_transfer_pages",
            "KV pages handed off between workers",
            ["pool", "direction"],
            registry=r,
        )
        self.kv_transfer_bytes = Counter(
            "pagoda_kv_transfer_bytes",
            "KV bytes handed off between workers",
            ["pool", "direction"],
            registry=r,
        )
        self.kv_transfer_failures = Counter(
            "pagoda_kv_transfer_failures",
            "KV handoffs that failed (checksum, framing, connection)",
            ["pool", "reason"],
            registry=r,
        )
        self.kv_transfer_seconds = Histogram(
            "pagoda_kv_transfer_seconds",
            "Duration of one KV handoff",
            ["pool", "direction"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.auth_failures = Counter(
            "pagoda_auth_failures",
            "Requests refused for missing or wrong credentials, by plane (public, internal, kv) and reason",
            ["pool", "plane", "reason"],
            registry=r,
        )
        self.routed = Counter(
            "pagoda_router_routed",
            "Requests routed to a worker, by the rule that chose it",
            ["pool", "worker", "rule"],
            registry=r,
        )
        self.dns_errors = Counter(
            "pagoda_router_dns_errors",
            "Router: lookups of a --prefill-dns/--decode-dns name that failed (its last addresses kept)",
            ["pool", "role", "target"],
            registry=r,
        )
        self.draining = Gauge(
            "pagoda_draining",
            "1 while the server drains after SIGTERM (no new requests, in-flight ones finishing)",
            ["pool"],
            registry=r,
        )
        self.draining.labels(pool).set(0)
        self.drain_cut = Counter(
            "pagoda_drain_cut_requests",
            "Requests still running at the drain deadline, ended with an explicit error",
            ["pool"],
            registry=r,
        )
        self.drain_cut.labels(pool)
        self.tool_calls = Counter(
            "pagoda_tool_calls",
            "Tool calls read from replies: valid (an offered function, arguments valid against its "
            "schema) or invalid (unparseable, an unknown function, arguments failing the schema)",
            ["pool", "result"],
            registry=r,
        )
        self.structured = Counter(
            "pagoda_structured_output",
            "Replies under response_format json_object/json_schema, by kind and result (valid, "
            "invalid, incomplete: ended by max_tokens before the grammar finished)",
            ["pool", "kind", "result"],
            registry=r,
        )
        for result in ("valid", "invalid"):
            self.tool_calls.labels(pool, result)
        for kind in ("json_object", "json_schema"):
            for result in ("valid", "invalid", "incomplete"):
                self.structured.labels(pool, kind, result)
        # the continuous quality probe (serving/worker/quality_loop.py): absent until a first probe
        self.quality_kl = Gauge(
            "pagoda_quality_kl",
            "Last quality probe: mean KL(reference || this pool) over the reference's top-k plus the rest",
            ["pool"],
            registry=r,
        )
        self.quality_top1 = Gauge(
            "pagoda_quality_top1",
            "Last quality probe: fraction of positions whose most likely token is the reference's",
            ["pool"],
            registry=r,
        )
        self.quality_greedy_prefix = Gauge(
            "pagoda_quality_greedy_prefix",
            "Last quality probe: mean fraction of the reference's greedy tokens reproduced before a divergence",
            ["pool"],
            registry=r,
        )
        self.quality_probe_seconds = Gauge(
            "pagoda_quality_probe_seconds", "Wall time of the last quality probe", ["pool"], registry=r
        )
        self.quality_probes = Counter(
            "pagoda_quality_probes",
            "Quality probes run, by result (ok: scored and compared; failed: could not score)",
            ["pool", "result"],
            registry=r,
        )
        self.worker_ready = _WorkerGauge(pool)
        r.register(self.worker_ready)
        if snapshot is not None:
            r.register(EngineCollector(pool, snapshot))
        for outcome in ("stop", "length", "abort", "error", "rejected", "invalid"):
            self.requests.labels(pool, outcome)
        for m in (
            self.ttft,
            self.queue_time,
            self.itl,
            self.e2e,
            self.prompt_tokens,
            self.generation_tokens,
            self.cached_tokens,
        ):
            m.labels(pool)

    def outcome(self, outcome: str) -> None:
        self.requests.labels(self.pool, outcome).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _WorkerGauge(Collector):
    """pagoda_router_worker_ready{worker, role}: 1 while the router considers a worker ready."""

    def __init__(self, pool: str) -> None:
        self.pool = pool
        self.source: Callable[[], dict[tuple[str, str], bool]] = dict

    def collect(self) -> Iterator[Metric]:
        g = GaugeMetricFamily(
            "pagoda_router_worker_ready",
            "Workers the router sends to (1 = ready)",
            labels=["pool", "worker", "role"],
        )
        for (url, role), ok in sorted(self.source().items()):
            g.add_metric([self.pool, url, role], 1.0 if ok else 0.0)
        yield g


class EngineCollector(Collector):
    """Engine state from the latest snapshot, read at scrape time."""

    def __init__(self, pool: str, snapshot: Callable[[], EngineSnapshot]) -> None:
        self.pool = pool
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot()
        p = self.pool
        kv = ["pool", "kv_pool"]
        total = GaugeMetricFamily("pagoda_kv_pages_total", "KV pages in the pool", labels=kv)
        used = GaugeMetricFamily("pagoda_kv_pages_used", "KV pages referenced by requests", labels=kv)
        cap = GaugeMetricFamily("pagoda_kv_capacity_tokens", "Tokens the KV pool holds", labels=kv)
        used_tok = GaugeMetricFamily("pagoda_kv_used_tokens", "Tokens' worth of KV pages in use", labels=kv)
        for pool in s.pools:
            total.add_metric([p, pool.name], pool.num_pages)
            used.add_metric([p, pool.name], pool.num_used)
            cap.add_metric([p, pool.name], pool.capacity_tokens)
            used_tok.add_metric([p, pool.name], pool.num_used * pool.page_size)
        yield from (total, used, cap, used_tok)
        yield preemption_family(p, s)
        yield from step_budget_families(p, s.step_budget)
        yield _gauge("pagoda_running_sequences", "Sequences in the running batch", p, s.running)
        yield _gauge("pagoda_waiting_sequences", "Sequences queued for admission", p, s.waiting)
        yield _gauge(
            "pagoda_weight_bytes", "Bytes of model weights held (all phase formats)", p, s.weight_bytes
        )
        yield from weight_families(p, s.weight_breakdown)
        yield _gauge("pagoda_ready", "1 when the engine is loaded and its loop runs", p, int(s.ready))
        yield _counter("pagoda_integrity_checks", "Batched KV tag checks", p, s.integrity.get("checks", 0))
        yield _counter(
            "pagoda_integrity_pages_checked",
            "KV pages whose tag was checked",
            p,
            s.integrity.get("pages_checked", 0),
        )
        yield _counter(
            "pagoda_integrity_mismatches", "KV tag mismatches found", p, s.integrity.get("mismatches", 0)
        )
        yield _counter(
            "pagoda_integrity_requests_aborted",
            "Requests failed closed on a tag mismatch",
            p,
            s.integrity.get("requests_aborted", 0),
        )
        yield _counter(
            "pagoda_integrity_pages_audited",
            "Sealed KV pages checksummed or verified (audit mode)",
            p,
            s.integrity.get("pages_audited", 0),
        )
        yield _counter(
            "pagoda_integrity_checksum_mismatches",
            "KV pages whose bytes changed after sealing (audit mode)",
            p,
            s.integrity.get("checksum_mismatches", 0),
        )
        info = InfoMetricFamily(
            "pagoda_engine", "Model, integrity mode and per-phase formats", labels=["pool"]
        )
        info.add_metric([p], {"model": s.model, "integrity": s.integrity_mode, **s.formats})
        yield info
        kernels = InfoMetricFamily(
            "pagoda_kernel_backend",
            "The backend each kernel op runs (kernels/selector.py)",
            labels=["pool", "op"],
        )
        for op, backend in kernel_backends().items():
            kernels.add_metric([p, op], {"backend": backend})
        yield kernels
        yield from protocol_families(s)


def preemption_family(pool: str, s: EngineSnapshot) -> CounterMetricFamily:
    """``pagoda_preemptions_total{pool, kv_pool, kv_format}``: running sequences whose KV pages were
    freed to make room (each is recomputed later), by the KV pool the pages were in."""
    c = CounterMetricFamily(
        "pagoda_preemptions",
        "Running sequences preempted (KV pages freed, recomputed later), by the KV pool they were in",
        labels=["pool", "kv_pool", "kv_format"],
    )
    formats = {kv.name: kv.kv_format for kv in s.pools}
    for name, n in sorted(s.preemptions.items()):
        c.add_metric([pool, name, formats.get(name, "")], n)
    return c


def step_budget_families(pool: str, b: dict[str, Any]) -> list[Metric]:
    """The time-budgeted step (engine/step_budget.py): predicted and measured step seconds by phase,
    and the budgeted prefill steps' planned stall against their inter-token target (none without one)."""
    if not b:
        return []
    phase = ["pool", "phase"]
    steps = CounterMetricFamily(
        "pagoda_step_timed", "Steps timed against a cost-model prediction", labels=phase
    )
    pred = CounterMetricFamily(
        "pagoda_step_predicted_seconds", "Predicted seconds of the timed steps (cost model)", labels=phase
    )
    real = CounterMetricFamily(
        "pagoda_step_actual_seconds", "Measured seconds of the timed steps", labels=phase
    )
    for ph in sorted(b.get("timed_steps", {})):
        steps.add_metric([pool, ph], b["timed_steps"][ph])
        pred.add_metric([pool, ph], b["predicted_s"].get(ph, 0.0))
        real.add_metric([pool, ph], b["actual_s"].get(ph, 0.0))
    target_sum = b.get("target_s", 0.0)
    return [
        steps,
        pred,
        real,
        _counter(
            "pagoda_step_budgeted",
            "Prefill steps sized by the time budget (decodes running)",
            pool,
            b.get("budgeted_steps", 0),
        ),
        _counter(
            "pagoda_step_budget_floor",
            "Budgeted prefill steps the floor pushed past the target",
            pool,
            b.get("floor_steps", 0),
        ),
        _counter(
            "pagoda_step_budget_planned_seconds",
            "Planned stall (decode + prefill step) of the budgeted steps, predicted",
            pool,
            b.get("planned_s", 0.0),
        ),
        _counter(
            "pagoda_step_budget_target_seconds", "Inter-token targets of the budgeted steps", pool, target_sum
        ),
        _gauge(
            "pagoda_step_budget_utilisation",
            "Planned stall over target of the budgeted steps so far (0-1; above 1 where the floor binds)",
            pool,
            b.get("planned_s", 0.0) / target_sum if target_sum > 0 else 0.0,
        ),
        _gauge(
            "pagoda_itl_target_seconds",
            "The inter-token target of the latest budgeted step",
            pool,
            b.get("last_target_s", 0.0),
        ),
    ]


def kernel_backends() -> dict[str, str]:
    """op -> backend of the kernel selection this process's model was built with ({} before one, and
    in a process that runs no model: the kernels are not even imported there, so neither is torch)."""
    selector = sys.modules.get("pagoda.kernels.selector")
    selection = selector.active_selection() if selector is not None else None
    return {} if selection is None else {op: backend for op, backend, _ in selection.rows()}


# The Gateway API inference extension's model server protocol: the names an endpoint picker
# scrapes (vLLM's spelling), mapped from the engine's own figures (docs/operator.md, Gateway).
PROTOCOL_WAITING = "vllm:num_requests_waiting"  # = pagoda_waiting_sequences
PROTOCOL_RUNNING = "vllm:num_requests_running"  # = pagoda_running_sequences
PROTOCOL_KV_USAGE = "vllm:kv_cache_usage_perc"  # = sum(kv_used_tokens) / sum(kv_capacity_tokens), 0-1
PROTOCOL_KV_USAGE_OLD = "vllm:gpu_cache_usage_perc"  # the same, under the name older pickers read
PROTOCOL_CACHE_INFO = "vllm:cache_config_info"  # block_size: the KV page size in tokens


def protocol_gauges(
    model: str, waiting: int, running: int, used: int, capacity: int
) -> list[GaugeMetricFamily]:
    """The protocol's load gauges (queue, batch, KV-cache use), labelled ``model_name``."""
    usage = used / capacity if capacity > 0 else 0.0
    out = []
    for name, doc, value in (
        (PROTOCOL_WAITING, "Requests queued for admission (pagoda_waiting_sequences)", waiting),
        (PROTOCOL_RUNNING, "Requests in the running batch (pagoda_running_sequences)", running),
        (PROTOCOL_KV_USAGE, "Fraction of KV cache tokens in use, 0-1", usage),
        (PROTOCOL_KV_USAGE_OLD, "Fraction of KV cache tokens in use, 0-1 (older name)", usage),
    ):
        g = GaugeMetricFamily(name, doc, labels=["model_name"])
        g.add_metric([model], value)
        out.append(g)
    return out


def protocol_families(s: EngineSnapshot) -> list[GaugeMetricFamily]:
    """The model-server protocol gauges of one engine snapshot, labelled ``model_name``."""
    out = protocol_gauges(s.model, s.waiting, s.running, s.kv_used_tokens, s.kv_capacity_tokens)
    if s.pools:
        info = GaugeMetricFamily(
            PROTOCOL_CACHE_INFO, "KV cache configuration (1)", labels=["model_name", "block_size"]
        )
        info.add_metric([s.model, str(s.pools[0].page_size)], 1.0)
        out.append(info)
    return out


def weight_families(pool: str, breakdown: dict[str, Any]) -> list[GaugeMetricFamily]:
    """``pagoda_weight_part_bytes{part}`` and ``pagoda_weight_format_bytes{format}``: the same total as
    ``pagoda_weight_bytes``, split by model part and by weight format (none before the engine reports);
    ``pagoda_weight_phase_format_bytes{phase,format}``: the block layers of each phase by the format
    they run in (what ``stored`` resolved to)."""
    parts = GaugeMetricFamily(
        "pagoda_weight_part_bytes",
        "Bytes of model weights held by part (embeddings incl. LM head, attention, mlp, experts, other)",
        labels=["pool", "part"],
    )
    formats = GaugeMetricFamily(
        "pagoda_weight_format_bytes",
        "Bytes of model weights held by format (linear layers and experts by weight format, others by dtype)",
        labels=["pool", "format"],
    )
    phases = GaugeMetricFamily(
        "pagoda_weight_phase_format_bytes",
        "Bytes of the block layers each phase runs, by the format each runs in (stored formats as "
        "resolved; a weight two phases share counts in both)",
        labels=["pool", "phase", "format"],
    )
    if breakdown:
        for part in WEIGHT_PARTS:
            parts.add_metric([pool, part], breakdown.get(part, 0))
        for fmt, n in sorted(breakdown.get("by_format", {}).items()):
            formats.add_metric([pool, fmt], n)
        for phase, by_fmt in sorted(breakdown.get("by_phase", {}).items()):
            for fmt, n in sorted(by_fmt.items()):
                phases.add_metric([pool, phase, fmt], n)
    return [parts, formats, phases]


def _gauge(name: str, doc: str, pool: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=["pool"])
    g.add_metric([pool], value)
    return g


def _counter(name: str, doc: str, pool: str, value: float) -> CounterMetricFamily:
    c = CounterMetricFamily(name, doc, labels=["pool"])
    c.add_metric([pool], value)
    return c


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (tests and the bench read figures this way)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            out[key] = float(value)
        except ValueError:
            continue
    return out


def metric_sum(metrics: dict[str, float], name: str, **labels: Any) -> float:
    """Sum of every series of ``name`` whose labels include ``labels``."""
    total = 0.0
    for key, value in metrics.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total
