"""Continuous quality probes: each pool scores the probe set on a schedule against its reference.

``pagoda serve --quality-reference FILE`` (a ``ScoreResponse`` JSON: the reference's answer to the
probe set, as the operator records it at rollout and mounts from the ``{md}-quality-reference``
ConfigMap under ``pagoda.quality_probe.REFERENCE_CONFIGMAP_KEY``) and
``--quality-probe-interval SECONDS`` (default 600, 0 off): every interval the pod asks its own
``Scorer`` (score.py: low priority, in gaps between user requests) for the logprobs of the
reference's tokens and top-k, compares them (``pagoda.quality_probe.compare``) and exports
``pagoda_quality_kl``, ``pagoda_quality_top1``, ``pagoda_quality_greedy_prefix``,
``pagoda_quality_probe_seconds`` and ``pagoda_quality_probes_total{result}``; the agent report
carries the last figures (``AgentReport.quality``). The prompts are the built-in probe set's, or
``--quality-probe-set FILE`` (a ``probes.json``); the greedy length and the top-k come from the
reference itself, so the candidate is asked exactly what the reference answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import logging
import time
from pathlib import Path

from pagoda.agent_report import QualityReport
from pagoda.node_agent.serving.api.metrics import ServeMetrics
from pagoda.node_agent.serving.worker.score import Scorer
from pagoda.quality_probe import MAX_TOP_K, Comparison, ProbeError, ProbeSet, ScoreResponse, compare

log = logging.getLogger("pagoda.quality")

DEFAULT_INTERVAL_S = 600.0
FIRST_PROBE_S = 30.0  # the first probe after start (or the interval, when shorter)


class QualityConfigError(ValueError):
    """A reference or probe set the loop cannot use (the server refuses to start)."""


def load_reference(path: str) -> ScoreResponse:
    """The reference ``ScoreResponse`` from a file; QualityConfigError naming it when unusable."""
    try:
        ref = ScoreResponse.from_json(json.loads(Path(path).read_text()))
    except (OSError, ValueError) as exc:
        raise QualityConfigError(f"--quality-reference {path}: {exc}") from exc
    if not ref.texts:
        raise QualityConfigError(f"--quality-reference {path}: the reference scored no text")
    return ref


def probe_set_for(reference: ScoreResponse, probe_file: str | None = None) -> ProbeSet:
    """The probe set that asks what ``reference`` answered: its prompts (built-in or the file's),
    its greedy length and its top-k width."""
    probes = ProbeSet()
    if probe_file:
        try:
            probes = ProbeSet.from_mapping(json.loads(Path(probe_file).read_text()))
        except (OSError, ValueError) as exc:
            raise QualityConfigError(f"--quality-probe-set {probe_file}: {exc}") from exc
    if len(reference.greedy) != len(probes.prompts):
        raise QualityConfigError(
            f"the reference continued {len(reference.greedy)} prompts, the probe set has {len(probes.prompts)}"
        )
    probes.max_new_tokens = max((len(g) for g in reference.greedy), default=0)
    probes.top_k = min(MAX_TOP_K, max((len(p) for t in reference.texts for p in t.top), default=1))
    return probes


class QualityLoop:
    """Scores the probe set every ``interval_s`` and keeps the last figures.

    The reference is read from its file, and read again whenever the file changes (the operator
    mounts it from a ConfigMap that it writes only when a rollout's gate passes, so a new pair's
    pods can start before it exists, and it is replaced at each later rollout). A reference that
    is there at start but unusable refuses the server; one that turns unusable later is logged and
    the last good one stays. With no reference yet, the loop waits and counts no failure."""

    def __init__(
        self,
        scorer: Scorer,
        reference_path: str,
        metrics: ServeMetrics,
        interval_s: float = DEFAULT_INTERVAL_S,
        probe_file: str | None = None,
    ) -> None:
        self.scorer, self.reference_path, self.probe_file = scorer, reference_path, probe_file
        self.metrics, self.interval_s = metrics, interval_s
        self.reference: ScoreResponse | None = None
        self.probes: ProbeSet | None = None
        self.body: dict | None = None
        self._stamp: tuple[int, int] | None = None
        self.last: QualityReport | None = None
        self.probes_run = 0
        self.failures = 0
        self._task: asyncio.Task | None = None
        self.event_loop: asyncio.AbstractEventLoop | None = None  # the server's, once started
        for result in ("ok", "failed"):
            metrics.quality_probes.labels(metrics.pool, result)
        if self._file_stamp() is not None:
            self._load()  # an unusable reference at start refuses the server
        else:
            log.info("quality probe: no reference at %s yet; probing starts when it appears", reference_path)

    def _file_stamp(self) -> tuple[int, int] | None:
        try:
            st = Path(self.reference_path).stat()  # follows the ConfigMap volume's symlinks
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size)

    def _load(self) -> None:
        stamp = self._file_stamp()
        reference = load_reference(self.reference_path)
        probes = probe_set_for(reference, self.probe_file)
        body = probes.request(reference)
        try:
            self.scorer.parse(body)  # a reference this pod cannot be asked about is unusable
        except ProbeError as exc:
            raise QualityConfigError(f"--quality-reference {self.reference_path}: {exc}") from exc
        self.reference, self.probes, self.body, self._stamp = reference, probes, body, stamp

    def refresh(self) -> bool:
        """Read the reference again if its file changed; whether there is a usable one."""
        stamp = self._file_stamp()
        if stamp is not None and stamp != self._stamp:
            try:
                self._load()
                log.info("quality probe: reference loaded from %s", self.reference_path)
            except QualityConfigError as exc:
                self._stamp = stamp  # not again until the file changes
                log.warning("quality probe: keeping the last reference: %s", exc)
        return self.reference is not None

    async def start(self) -> None:
        self.event_loop = asyncio.get_running_loop()
        if self.interval_s > 0:
            self._task = asyncio.create_task(self._loop(), name="pagoda-quality-probe")
            log.info("quality probe every %.0fs against the reference", self.interval_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def report(self) -> QualityReport | None:
        """The last figures for the agent report (None before the first probe)."""
        return self.last

    async def probe_once(self) -> Comparison:
        """Score the probe set now (waiting behind a score in progress), export and keep the figures."""
        pool = self.metrics.pool
        if not self.refresh():
            raise RuntimeError(f"no quality reference at {self.reference_path} yet")
        t0 = time.perf_counter()
        try:
            candidate = await self.scorer.score(self.scorer.parse(self.body), wait=True)
            result = compare(self.reference, candidate)
        except Exception:
            self.failures += 1
            self.metrics.quality_probes.labels(pool, "failed").inc()
            self._keep(None, time.perf_counter() - t0)
            raise
        seconds = time.perf_counter() - t0
        self.probes_run += 1
        m = self.metrics
        m.quality_kl.labels(pool).set(result.mean_kl)
        m.quality_top1.labels(pool).set(result.top1)
        m.quality_greedy_prefix.labels(pool).set(result.greedy_prefix)
        m.quality_probe_seconds.labels(pool).set(seconds)
        m.quality_probes.labels(pool, "ok").inc()
        self._keep(result, seconds)
        return result

    def _keep(self, result: Comparison | None, seconds: float) -> None:
        prev = self.last or QualityReport()
        now = dt.datetime.now(dt.UTC).replace(microsecond=0)
        if result is None:  # a failed probe keeps the last figures, counts the failure
            self.last = QualityReport(**{**prev.__dict__, "failures": self.failures})
            return
        self.last = QualityReport(
            mean_kl=result.mean_kl,
            top1=result.top1,
            greedy_prefix=result.greedy_prefix,
            greedy_identical=result.greedy_identical,
            positions=result.positions,
            prompts=result.prompts,
            probe_seconds=seconds,
            probes=self.probes_run,
            failures=self.failures,
            last_probe_time=now,
        )

    async def _loop(self) -> None:
        await asyncio.sleep(min(FIRST_PROBE_S, self.interval_s))
        while True:
            if not self.refresh():
                await asyncio.sleep(min(FIRST_PROBE_S, self.interval_s))  # waiting for the reference
                continue
            try:
                r = await self.probe_once()
                log.info("quality probe: KL %.5f top-1 %.4f greedy %.3f", r.mean_kl, r.top1, r.greedy_prefix)
            except (ProbeError, RuntimeError, ValueError) as exc:
                log.warning("quality probe failed: %s", exc)
            except Exception:
                log.exception("quality probe failed")
            await asyncio.sleep(self.interval_s)
