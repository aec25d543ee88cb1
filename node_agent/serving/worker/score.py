"""The quality probe's scoring endpoint: ``POST /internal/score`` on every engine pod.

The body is a ``pagoda.quality_probe.ScoreRequest`` (texts to teacher-force, chat prompts to
continue greedily); the answer a ``ScoreResponse``. The internal token's proof is checked before
the body is read (internal_auth.py, as for ``/internal/faults``); the body is parsed and every
limit checked (``ScoreRequest.parse``), then every text tokenized and every prompt length-checked,
before anything is allocated or computed: a bad body is a 400 that cost no model time.

What is scored is what the pod serves: each text goes through ``LLMEngine.score``, the engine's own
paged-KV prefill path with the weights and KV pool of the phase whose distribution users sample
from (the decode phase for roles both and decode, the prefill phase for role prefill), and each
prompt is continued greedily as an ordinary request of the engine (chat template, scheduler,
continuous batching). No second copy of the model exists. Per position the answer holds the
top-k (token, logprob) pairs of log_softmax of the raw logits (engine/logprobs.py's ``gather``,
the same batched top-k the completions API's logprobs use) and the logprobs of the request's
``targets``.

Low priority: one score runs at a time per pod (another is answered 503 at once); before each text
and before the greedy batch it waits for a gap, no user request in flight, up to ``gap_wait_s``
(then it runs anyway, so a saturated pod is still probed). A text is one forward pass between two
engine steps (at most ``MAX_TEXT_TOKENS`` tokens); the greedy prompts are requests of their own
cache salt that batch with user requests like any other, bounded by ``MAX_PROMPTS`` x
``MAX_NEW_TOKENS`` tokens. Cost figures: docs/quality-gates.md.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from pagoda.node_agent.engine.llm_engine import LLMEngine
from pagoda.node_agent.engine.logprobs import gather
from pagoda.node_agent.kv.pool import OutOfPages
from pagoda.node_agent.params import RequestError, SamplingParams
from pagoda.node_agent.serving.api.errors import ApiError
from pagoda.node_agent.serving.api.internal_auth import InternalAuth
from pagoda.node_agent.serving.api.metrics import ServeMetrics
from pagoda.node_agent.serving.worker.async_engine import AsyncEngine, EngineDead, Submission
from pagoda.node_agent.serving.worker.disagg_worker import json_object
from pagoda.node_agent.serving.worker.queue_deadline import QueueFull, QueueRefused
from pagoda.quality_probe import (
    MAX_TEXT_TOKENS,
    SCORE_PATH,
    ProbeError,
    ScoredText,
    ScoreRequest,
    ScoreResponse,
)

MAX_BODY = 16 << 20  # 16 texts x 4096 positions x 20 target ids fit
MAX_TEXT_CHARS = MAX_TEXT_TOKENS * 32  # a text longer than this cannot be within the token limit
GAP_WAIT_S = 10.0
GAP_POLL_S = 0.02
PROBE_SALT = "pagoda-quality-probe"  # the probe's own prefix-cache tenant
RETRY_AFTER_S = 5
ROWS = 256  # positions per float64 log-softmax (bounded memory for a 4096-token text)


class ScoreBusy(RuntimeError):
    """The pod cannot score now (another score runs, or no KV pages are free): retry later."""


@dataclass
class _Text:
    token_ids: list[int]
    targets: list[list[int]] | None


def teacher_force(
    engine: LLMEngine, ids: list[int], targets: list[list[int]] | None, top_k: int, phase: str
) -> ScoredText:
    """On the engine thread: ``ids`` through the phase's weights and paged KV; per position p the
    top-k of the distribution predicting token p + 1, and the logprobs of ``targets[p]``. The
    float64 log-softmax runs ``ROWS`` positions at a time, so its memory stays bounded."""
    logits = engine.score(ids, phase=phase)[:-1]  # the last position predicts past the text
    top: list[list[tuple[int, float]]] = []
    picked: list[list[float]] | None = None if targets is None else []
    for lo in range(0, logits.shape[0], ROWS):
        lp = torch.log_softmax(logits[lo : lo + ROWS].double(), dim=-1)
        entries, _ = gather(lp, torch.tensor(ids[lo + 1 : lo + 1 + lp.shape[0]]), [top_k] * lp.shape[0])
        top += [[(t, float(v)) for t, v in e.top] for e in entries]
        if targets is not None and picked is not None:
            rows = targets[lo : lo + lp.shape[0]]
            width = max(len(t) for t in rows)
            index = torch.tensor([t + [t[0]] * (width - len(t)) for t in rows], device=lp.device)
            got = lp.gather(1, index).tolist()
            picked += [row[: len(t)] for row, t in zip(got, rows, strict=True)]
    return ScoredText(list(ids), top, picked)


class Scorer:
    """Scores probe sets on one pod's engine, at low priority (see the module docstring)."""

    def __init__(self, aengine: AsyncEngine, gap_wait_s: float = GAP_WAIT_S) -> None:
        self.aengine = aengine
        engine = aengine.engine
        self.vocab_size = engine.model_config.vocab_size
        self.role = engine.config.role
        self.phase = "prefill" if self.role == "prefill" else "decode"
        self.gap_wait_s = gap_wait_s
        self._busy = False
        self.runs = 0  # scores finished
        self.seconds = 0.0  # their wall time in all
        self.cpu_seconds = 0.0  # this process's CPU time while they ran (all threads)

    def formats(self) -> dict[str, str]:
        """The pod's phase formats, its role and the phase its texts were scored through."""
        f = self.aengine.engine.config.formats.as_dict()
        return {**f, "role": self.role, "scored_phase": self.phase}

    def parse(self, raw: object) -> ScoreRequest:
        """The validated request (ProbeError on anything malformed or over a limit)."""
        return ScoreRequest.parse(raw, self.vocab_size)

    async def score(self, req: ScoreRequest, wait: bool = False) -> ScoreResponse:
        """Score ``req``; with ``wait`` queue behind a score in progress, else ScoreBusy. Raises
        RequestError when a text or prompt does not fit this pod (nothing computed)."""
        while self._busy:
            if not wait:
                raise ScoreBusy("another score is running on this pod")
            await asyncio.sleep(0.1)
        self._busy = True
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            texts = await asyncio.to_thread(self._prepare_texts, req)
            params = SamplingParams(max_tokens=max(req.max_new_tokens, 1), temperature=0.0, ignore_eos=True)
            await asyncio.to_thread(self._check_prompts, req.prompts, params)
            scored = []
            for t in texts:
                await self._gap()
                fn = _force(t, req.top_k, self.phase)
                try:
                    scored.append(await self.aengine.call(fn))
                except OutOfPages as exc:
                    raise ScoreBusy("no free KV pages for the probe now") from exc
            greedy = (
                await self._greedy(req.prompts, params) if req.max_new_tokens else [[] for _ in req.prompts]
            )
        finally:
            self._busy = False
        self.runs += 1
        self.seconds += time.perf_counter() - t0
        self.cpu_seconds += time.process_time() - c0
        return ScoreResponse(self.formats(), scored, greedy)

    def _prepare_texts(self, req: ScoreRequest) -> list[_Text]:
        """Every text's token ids (tokenized here, off the engine thread) within this pod's limits."""
        engine = self.aengine.engine
        pool = engine.prefill_pool if self.phase == "prefill" else engine.decode_pool
        most = min(MAX_TEXT_TOKENS, engine.admission.max_model_len, pool.capacity_tokens)
        out = []
        for n, entry in enumerate(req.texts):
            if "text" in entry:
                if len(entry["text"]) > MAX_TEXT_CHARS:
                    raise RequestError(f"texts[{n}].text is longer than {MAX_TEXT_CHARS} characters")
                ids = engine.tokenize(entry["text"])
            else:
                ids = entry["token_ids"]
            if not 2 <= len(ids) <= most:
                raise RequestError(f"texts[{n}] has {len(ids)} tokens; this pod scores 2..{most}")
            out.append(_Text(ids, entry.get("targets")))
        return out

    def _check_prompts(self, prompts: list[str], params: SamplingParams) -> None:
        engine = self.aengine.engine
        for p in prompts:
            engine.admission.check_prompt(engine.tokenize(p, chat=True), params, False)

    async def _gap(self) -> None:
        """Wait until no user request is in flight, at most ``gap_wait_s``."""
        deadline = time.monotonic() + self.gap_wait_s
        while self.aengine.num_inflight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(GAP_POLL_S)

    async def _greedy(self, prompts: list[str], params: SamplingParams) -> list[list[int]]:
        if not prompts:
            return []
        await self._gap()
        subs = [Submission(p, params, chat=True, cache_salt=PROBE_SALT) for p in prompts]
        try:
            streams = await self.aengine.submit_many(subs)
        except (QueueFull, QueueRefused) as exc:
            raise ScoreBusy(f"the pod's queue is full: {exc}") from exc
        finals = [await s.final() for s in streams]
        return [list(f.token_ids) for f in finals]


def _force(t: _Text, top_k: int, phase: str):
    return lambda engine: teacher_force(engine, t.token_ids, t.targets, top_k, phase)


def score_routes(scorer: Scorer, auth: InternalAuth, metrics: ServeMetrics):
    """``create_app``'s extra route adding ``POST /internal/score`` over ``scorer``."""

    def add(app: FastAPI) -> None:
        @app.post(SCORE_PATH)
        async def post_score(request: Request) -> JSONResponse:
            if (refusal := auth.refuse(request, metrics)) is not None:
                return refusal
            raw = await json_object(request, MAX_BODY)
            try:
                req = scorer.parse(raw)
            except ProbeError as exc:
                raise ApiError(400, str(exc), code="invalid_value") from None
            try:
                resp = await scorer.score(req)
            except RequestError as exc:
                raise ApiError(400, str(exc), code="invalid_value") from None
            except (ScoreBusy, EngineDead) as exc:
                headers = {"Retry-After": str(RETRY_AFTER_S)}
                raise ApiError(503, str(exc), code="score_unavailable", headers=headers) from None
            return JSONResponse(resp.to_json())

    return add
