"""The agent report: what a node agent patches into ``status.agents.<pod>`` of its ModelDeployment.

One typed shape for both sides: the agent's reporter builds an ``AgentReport`` and sends
``to_status()``; the operator reads each agent's key with ``AgentReport.from_status``. The wire is
camelCase JSON and only ever gains fields. Reading never raises: a report comes from a peer that
may be older (no ``version``), newer (unknown fields, ignored) or broken (a malformed field takes
its default). Pure Python: the operator imports it without the engine's dependencies.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

REPORT_VERSION = 1  # 0 = an agent from before the version field
# Each agent writes its report as this annotation on its own Pod; the operator reads the pods.
REPORT_ANNOTATION = "pagoda.dev/agent-report"
MAX_REPORT_BYTES = 16 * 1024  # a longer annotation is not read
INTEGRITY_COUNTERS = (
    "checks",  # batched tag checks run
    "pages_checked",  # block-table entries compared
    "mismatches",  # sequences with a tag mismatch
    "requests_aborted",  # requests failed closed (tag or checksum)
    "pages_audited",  # audit: sealed pages checksummed or verified
    "checksum_mismatches",  # audit: pages whose bytes changed after sealing
)


def camel(name: str) -> str:
    """``pages_checked`` -> ``pagesChecked`` (the wire spelling of a field)."""
    head, *rest = name.split("_")
    return head + "".join(part.capitalize() for part in rest)


def parse_time(value: Any) -> dt.datetime | None:
    """An RFC 3339 timestamp as an aware datetime, or None when absent or malformed."""
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.UTC)


def format_time(value: dt.datetime) -> str:
    """RFC 3339 in UTC with a Z suffix, seconds precision (as Kubernetes writes it)."""
    return value.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _count(value: Any) -> int:
    """A non-negative integer; 0 when absent, not a number, negative or not finite."""
    if isinstance(value, bool):
        return 0
    if isinstance(value, int):
        return max(0, value)
    if isinstance(value, float) and math.isfinite(value):
        return max(0, int(value))
    return 0


def _rate(value: Any) -> float:
    """A non-negative finite float; 0.0 otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0.0
    value = float(value)
    return value if math.isfinite(value) and value > 0 else 0.0


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


@dataclass
class PhaseFormats:
    """The weight and KV formats of each phase, as the engine runs them."""

    prefill_weights: str = ""
    prefill_kv: str = ""
    decode_weights: str = ""
    decode_kv: str = ""

    @classmethod
    def from_formats(cls, formats: Mapping[str, Any]) -> PhaseFormats:
        """From the engine's snake_case formats (``EngineSnapshot.formats``)."""
        return cls(**{f.name: _text(formats.get(f.name)) for f in fields(cls)})

    @classmethod
    def from_status(cls, raw: Any) -> PhaseFormats:
        raw = _mapping(raw)
        return cls(**{f.name: _text(raw.get(camel(f.name))) for f in fields(cls)})

    def to_status(self) -> dict[str, str]:
        return {camel(f.name): getattr(self, f.name) for f in fields(self)}


@dataclass
class IntegrityReport:
    """The integrity mode and the engine's integrity counters (cumulative since the agent started)."""

    mode: str = ""
    checks: int = 0
    pages_checked: int = 0
    mismatches: int = 0
    requests_aborted: int = 0
    pages_audited: int = 0
    checksum_mismatches: int = 0

    @classmethod
    def from_counters(cls, mode: str, counters: Mapping[str, Any]) -> IntegrityReport:
        """From the engine's snake_case counters (``dataclasses.asdict(IntegrityCounters)``)."""
        return cls(_text(mode), **{name: _count(counters.get(name)) for name in INTEGRITY_COUNTERS})

    @classmethod
    def from_status(cls, raw: Any) -> IntegrityReport:
        raw = _mapping(raw)
        return cls(
            _text(raw.get("mode")), **{name: _count(raw.get(camel(name))) for name in INTEGRITY_COUNTERS}
        )

    def to_status(self) -> dict[str, Any]:
        return {"mode": self.mode, **{camel(name): getattr(self, name) for name in INTEGRITY_COUNTERS}}


WEIGHT_PARTS = ("embeddings", "attention", "mlp", "experts", "other")
MAX_WEIGHT_FORMATS = 8  # distinct format keys read from a peer's ``weights.byFormat``
MAX_FORMAT_NAME = 32


@dataclass
class WeightReport:
    """Resident weight bytes by part (``WEIGHT_PARTS``) and by weight format (``bf16``, ``fp8``, ``int4``,
    unquantized tensors under their dtype). Empty (all zero, no formats) from an agent that predates it."""

    parts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(WEIGHT_PARTS, 0))
    by_format: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_breakdown(cls, breakdown: Mapping[str, Any]) -> WeightReport:
        """From the model's ``weight_bytes()`` dict (``EngineSnapshot.weight_breakdown``)."""
        return cls.from_status({**breakdown, "byFormat": _mapping(breakdown).get("by_format")})

    @classmethod
    def from_status(cls, raw: Any) -> WeightReport:
        """Known parts only; at most ``MAX_WEIGHT_FORMATS`` formats with short string names."""
        raw = _mapping(raw)
        formats: dict[str, int] = {}
        for name, value in _mapping(raw.get("byFormat")).items():
            if len(formats) >= MAX_WEIGHT_FORMATS:
                break
            if isinstance(name, str) and 0 < len(name) <= MAX_FORMAT_NAME:
                formats[name] = _count(value)
        return cls({part: _count(raw.get(part)) for part in WEIGHT_PARTS}, formats)

    def to_status(self) -> dict[str, Any]:
        return {**{part: self.parts.get(part, 0) for part in WEIGHT_PARTS}, "byFormat": dict(self.by_format)}


def _fraction(value: Any) -> float:
    """A finite float in [0, 1]; 0.0 otherwise."""
    v = _rate(value)
    return min(v, 1.0)


@dataclass
class QualityReport:
    """The last continuous quality probe (serving/worker/quality_loop.py) against the pool's
    reference: the ``pagoda.quality_probe.Comparison`` figures, its wall time, the probes run and
    failed since the agent started and when the last one ended. Absent (None in ``AgentReport``)
    from an agent that probes nothing or predates it."""

    mean_kl: float = 0.0
    top1: float = 0.0
    greedy_prefix: float = 0.0
    greedy_identical: float = 0.0
    positions: int = 0
    prompts: int = 0
    probe_seconds: float = 0.0
    probes: int = 0
    failures: int = 0
    last_probe_time: dt.datetime | None = None

    @classmethod
    def from_status(cls, raw: Any) -> QualityReport:
        raw = _mapping(raw)
        return cls(
            mean_kl=_rate(raw.get("meanKL")),
            top1=_fraction(raw.get("top1")),
            greedy_prefix=_fraction(raw.get("greedyPrefix")),
            greedy_identical=_fraction(raw.get("greedyIdentical")),
            positions=_count(raw.get("positions")),
            prompts=_count(raw.get("prompts")),
            probe_seconds=_rate(raw.get("probeSeconds")),
            probes=_count(raw.get("probes")),
            failures=_count(raw.get("failures")),
            last_probe_time=parse_time(raw.get("lastProbeTime")),
        )

    def to_status(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "meanKL": round(self.mean_kl, 6),
            "top1": round(self.top1, 4),
            "greedyPrefix": round(self.greedy_prefix, 4),
            "greedyIdentical": round(self.greedy_identical, 4),
            "positions": self.positions,
            "prompts": self.prompts,
            "probeSeconds": round(self.probe_seconds, 3),
            "probes": self.probes,
            "failures": self.failures,
        }
        if self.last_probe_time is not None:
            out["lastProbeTime"] = format_time(self.last_probe_time)
        return out


@dataclass
class AgentReport:
    """One agent's report. ``stale`` is the operator's mark on the report; agents leave it None."""

    version: int = REPORT_VERSION
    pool: str = ""
    node: str = ""
    ready: bool = False
    model: str = ""
    formats: PhaseFormats = field(default_factory=PhaseFormats)
    weight_bytes: int = 0
    kv_capacity_tokens: int = 0
    kv_used_tokens: int = 0
    tokens_per_second: float = 0.0
    running_requests: int = 0
    waiting_requests: int = 0
    integrity: IntegrityReport = field(default_factory=IntegrityReport)
    weights: WeightReport = field(default_factory=WeightReport)
    last_report_time: dt.datetime | None = None
    stale: bool | None = None
    quality: QualityReport | None = None  # the last continuous quality probe, when the pool runs them

    def to_status(self) -> dict[str, Any]:
        """The camelCase JSON of ``status.agents.<pod>`` (no ``stale``: that key is the operator's)."""
        out: dict[str, Any] = {
            "version": self.version,
            "pool": self.pool,
            "node": self.node,
            "ready": self.ready,
            "model": self.model,
            "formats": self.formats.to_status(),
            "weightBytes": self.weight_bytes,
            "kvCapacityTokens": self.kv_capacity_tokens,
            "kvUsedTokens": self.kv_used_tokens,
            "tokensPerSecond": self.tokens_per_second,
            "runningRequests": self.running_requests,
            "waitingRequests": self.waiting_requests,
            "integrity": self.integrity.to_status(),
        }
        if any(self.weights.parts.values()) or self.weights.by_format:  # agents now leave it out
            out["weights"] = self.weights.to_status()
        if self.last_report_time is not None:
            out["lastReportTime"] = format_time(self.last_report_time)
        if self.quality is not None:
            out["quality"] = self.quality.to_status()
        return out

    @classmethod
    def from_status(cls, raw: Any) -> AgentReport:
        """Read a peer's report; missing or malformed fields take their defaults, never raising."""
        raw = _mapping(raw)
        stale = raw.get("stale")
        return cls(
            version=_count(raw.get("version")),
            pool=_text(raw.get("pool")),
            node=_text(raw.get("node")),
            ready=raw.get("ready") is True,
            model=_text(raw.get("model")),
            formats=PhaseFormats.from_status(raw.get("formats")),
            weight_bytes=_count(raw.get("weightBytes")),
            kv_capacity_tokens=_count(raw.get("kvCapacityTokens")),
            kv_used_tokens=_count(raw.get("kvUsedTokens")),
            tokens_per_second=_rate(raw.get("tokensPerSecond")),
            running_requests=_count(raw.get("runningRequests")),
            waiting_requests=_count(raw.get("waitingRequests")),
            integrity=IntegrityReport.from_status(raw.get("integrity")),
            weights=WeightReport.from_status(raw.get("weights")),
            last_report_time=parse_time(raw.get("lastReportTime")),
            stale=stale if isinstance(stale, bool) else None,
            quality=QualityReport.from_status(raw["quality"])
            if isinstance(raw.get("quality"), Mapping)
            else None,
        )


def to_annotation(report: AgentReport) -> str:
    """The report as the compact JSON text of the ``REPORT_ANNOTATION`` annotation."""
    return json.dumps(report.to_status(), separators=(",", ":"), sort_keys=True)


def from_annotation(text: Any) -> AgentReport | None:
    """A pod's report annotation read back; None when absent, too long or not a JSON object."""
    if not isinstance(text, str) or not text or len(text) > MAX_REPORT_BYTES:
        return None
    try:
        raw = json.loads(text)
    except ValueError:
        return None
    return AgentReport.from_status(raw) if isinstance(raw, dict) else None
