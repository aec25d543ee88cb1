"""Failure isolation: a failure ends only the requests that cause it.

A step that raises is re-run in halves down to single sequences, so a sequence fails only when it
fails alone and its batch mates' output is what it would have been anyway. A failed request ends
with finish_reason "error" and a message naming where it failed; its pages go back to the pool.
A ReplicaFailure (a tensor-parallel rank is lost) is never retried: the replica cannot run at all.
"""

from __future__ import annotations

import logging

import torch

from pagoda.node_agent.engine.integrity import IntegrityError, release_owned
from pagoda.node_agent.engine.output import RequestOutput, RequestState
from pagoda.node_agent.engine.parallel.group import ReplicaFailure
from pagoda.node_agent.engine.sampling import StepSamples
from pagoda.node_agent.engine.scheduler import ScheduledStep, Scheduler
from pagoda.node_agent.engine.sequence import Sequence
from pagoda.node_agent.engine.state import EngineStats
from pagoda.node_agent.kv.pool import KVPagePool

log = logging.getLogger("pagoda.engine")

MAX_ERROR_CHARS = 500  # of an exception's text in a failed request's error


def describe(exc: BaseException, where: str) -> str:
    """The error a request ended by ``exc`` (raised in ``where``) reports."""
    text = f"engine {where} failed for this request: {type(exc).__name__}: {exc}"
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


def log_failure(seqs: list[Sequence], where: str, exc: BaseException) -> str:
    """Log a failure once, with the request ids it ends; returns the message those requests get."""
    ids = ", ".join(s.request_id for s in seqs)
    log.error("%s failed; ending request(s) %s with an error", where, ids, exc_info=exc)
    return describe(exc, where)


class FailureIsolation:
    """Runs a step so that a failure stays with its request, and ends failed requests."""

    def __init__(
        self, runner, scheduler: Scheduler, stats: EngineStats, requests: dict[str, RequestState]
    ) -> None:
        """``requests``: the engine's requests in flight by id (a failed one leaves it here)."""
        self.runner = runner
        self.scheduler = scheduler
        self.stats = stats
        self.requests = requests

    def run(
        self, step: ScheduledStep, pool: KVPagePool, tables: tuple | None = None
    ) -> tuple[dict[Sequence, int], dict[Sequence, str]]:
        """Run the step; if it raises, re-run it in halves down to single sequences (a sequence fails
        only when it fails alone). Returns the sampled tokens and an error message per failed sequence.

        A retry rewrites the KV slots the failed run may have written (the same slots, computed
        again) and starts every seeded generator from its state before the failed run."""
        # seeded draws consume the generator: snapshot it (~2 us per sampling request) for a retry
        gens = {
            s: s.generator.get_state() for s in step.seqs if s.generator is not None and not s.params.greedy
        }
        try:
            return self.runner.run(step, pool, tables), {}
        except ReplicaFailure:
            raise  # the replica cannot run anything any more: no retry
        except Exception as exc:
            first = exc
        sampled = StepSamples()  # the parts' tokens and logprobs, merged
        failed: dict[Sequence, Exception] = {}
        self._retry_halves(step, pool, gens, sampled, failed)
        if not failed:
            log.warning(
                "a %s step of %d requests raised, and every part succeeded when re-run",
                step.phase,
                len(step.seqs),
                exc_info=first,
            )
            return sampled, {}
        where = f"{step.phase} step"
        log_failure(list(failed), where, next(iter(failed.values())))
        return sampled, {seq: describe(exc, where) for seq, exc in failed.items()}

    def _retry_halves(
        self,
        step: ScheduledStep,
        pool: KVPagePool,
        gens: dict[Sequence, torch.Tensor],
        sampled: dict[Sequence, int],
        failed: dict[Sequence, Exception],
    ) -> None:
        """Re-run a failed step's two halves; a failing half of several sequences splits again."""
        mid = len(step.seqs) // 2
        for part in (step.seqs[:mid], step.seqs[mid:]):
            if not part:
                continue
            sub = step.only(part)
            for seq in part:
                if seq in gens:
                    seq.generator.set_state(gens[seq])
            try:
                sampled.update(self.runner.run(sub, pool))
            except ReplicaFailure:
                raise
            except Exception as exc:
                if len(part) == 1:
                    failed[part[0]] = exc
                else:
                    self._retry_halves(sub, pool, gens, sampled, failed)

    def fail_all(self, errors: dict[Sequence, str]) -> list[RequestOutput]:
        """End each sequence with its error: pages released, no longer scheduled, counted as aborted."""
        outs = [self.fail_request(seq, msg) for seq, msg in errors.items()]
        return [o for o in outs if o is not None]

    def fail_request(self, seq: Sequence, message: str) -> RequestOutput | None:
        """End one request with ``message``; its final output (None when it has none in flight)."""
        try:
            self.scheduler.abort(seq)  # leaves the running set first, then releases the pages
        except Exception:
            log.exception("releasing the pages of failed request %s", seq.request_id)
            seq.block_table = []
        seq.finish("error", message)
        self.stats.requests_aborted += 1
        state = self.requests.get(seq.request_id)
        if state is None or state.seq is not seq:
            return None
        del self.requests[seq.request_id]
        return state.output(finished=True)  # an errored output builds no text: it cannot raise here

    def discard(self, seq: Sequence) -> None:
        """Undo a half-admitted received sequence: its pages back to the decode pool, no entry anywhere."""
        if seq in self.scheduler.running:
            self.scheduler.running.remove(seq)
        self.scheduler.decode_pool.release_all(seq.block_table)
        seq.block_table = []
        state = self.requests.get(seq.request_id)
        if state is not None and state.seq is seq:
            del self.requests[seq.request_id]

    def fail_integrity(self, seq: Sequence, err: IntegrityError) -> RequestOutput:
        """Fail closed: end only this request with an explicit error and release its pages."""
        log.error("integrity: aborting %s: %s", seq.request_id, err)
        live = self.scheduler.running + list(self.scheduler.waiting)
        release_owned(seq, self.scheduler.pool_of(seq), live)  # never a page now owned by another
        self.scheduler.abort(seq)
        seq.finish("error", str(err))
        self.stats.requests_aborted += 1
        return self.requests.pop(seq.request_id).output(finished=True)
