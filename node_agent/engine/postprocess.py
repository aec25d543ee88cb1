"""After a step's run: each sampled token is appended and checked against the stop rules, newly full
pages are sealed into the prefix cache, finished requests release their pages, a finished
prefill-only request gets its handoff payload, and every request that sampled a token gets its
output. A failure here ends only its own request (the loop fails the requests this returns)."""

from __future__ import annotations

from pagoda.node_agent.engine import handoff
from pagoda.node_agent.engine.guided import state as guided
from pagoda.node_agent.engine.isolation import log_failure
from pagoda.node_agent.engine.output import RequestOutput, RequestState, StopRules
from pagoda.node_agent.engine.parallel.group import ReplicaFailure
from pagoda.node_agent.engine.scheduler import ScheduledStep, Scheduler
from pagoda.node_agent.engine.sequence import Sequence
from pagoda.node_agent.engine.state import EngineStats
from pagoda.node_agent.kv.pool import KVPagePool
from pagoda.node_agent.models.tokenizer import Tokenizer


class Postprocessor:
    """Turns a step's sampled tokens into request outputs."""

    def __init__(
        self,
        scheduler: Scheduler,
        integrity,
        replica,
        stats: EngineStats,
        requests: dict[str, RequestState],
        tokenizer: Tokenizer,
        stop_rules: StopRules,
    ) -> None:
        """``requests``: the engine's requests in flight by id (a finished one leaves it here)."""
        self.scheduler = scheduler
        self.integrity = integrity
        self.replica = replica  # a handoff payload gathers every tensor-parallel rank's heads
        self.stats = stats
        self.requests = requests
        self.tokenizer, self.stop_rules = tokenizer, stop_rules  # a received sequence's output state

    def outputs(
        self, step: ScheduledStep, pool: KVPagePool, sampled: dict[Sequence, int]
    ) -> tuple[list[RequestOutput], dict[Sequence, str]]:
        """(the outputs of the requests that sampled a token, an error per request that failed here)."""
        self._advance(step)
        for seq, entries in getattr(sampled, "prompt_logprobs", {}).items():
            seq.prompt_logprobs += entries  # positions in order, each scored once (logprobs.prompt_spans)
        errors: dict[Sequence, str] = {}
        payloads = self._take_tokens(sampled, errors)
        self._seal_and_finish(step, pool, errors)
        return self._collect(sampled, payloads, errors), errors

    def admit_received(self, seq: Sequence, first_token: int) -> list[RequestOutput]:
        """Register a sequence received in the decode pool: it decodes next, or ends at once on its
        first token (its final output, which the next step reports)."""
        state = RequestState(seq, self.tokenizer, self.stop_rules)
        guided.advance(seq, first_token)  # a fresh matcher replays the token the prefill side sampled
        if seq.params.logprobs is not None:
            seq.logprobs = [None]  # sampled on the prefill worker, whose answer carries its entry
        state = RequestState(seq, self.tokenizer, self.stop_rules, received=True)
        state.check_stop(first_token)
        if seq.finished:
            self.scheduler.decode_pool.release_all(seq.block_table)
            seq.block_table = []
            out = state.output(finished=True)
            self.stats.requests_finished += 1
            return [out]
        self.scheduler.add_running(seq)
        self.requests[seq.request_id] = state
        return []

    def _advance(self, step: ScheduledStep) -> None:
        """Count the step's tokens as computed (only after a run that succeeded)."""
        for seq, n in zip(step.seqs, step.num_new_tokens, strict=True):
            seq.num_computed_tokens += n
        if step.phase == "prefill":
            self.stats.prefill_tokens += sum(step.num_new_tokens)
        else:
            self.stats.decode_tokens += sum(step.num_new_tokens)

    def _take_tokens(
        self, sampled: dict[Sequence, int], errors: dict[Sequence, str]
    ) -> dict[Sequence, handoff.KVPayload]:
        """Append each sampled token and apply the stop rules; the handoff payload of each finished
        prefill-only request (audit mode adds per-page checksums)."""
        payloads: dict[Sequence, handoff.KVPayload] = {}
        for seq, tok in sampled.items():
            try:
                seq.output_token_ids.append(tok)
                guided.advance(seq, tok)  # its grammar's matcher accepts it (or fails the request)
                if seq.params.logprobs is not None:
                    seq.logprobs.append(getattr(sampled, "logprobs", {}).get(seq))
                self.requests[seq.request_id].check_stop(tok)
                if seq.prefill_only and not seq.finished:
                    meta = self.integrity.payload_meta
                    payloads[seq] = self.replica.payload_of(seq, self.scheduler.prefill_pool, meta)
                    seq.finish("prefilled")
            except ReplicaFailure:
                raise
            except Exception as exc:
                errors[seq] = log_failure([seq], "output", exc)
        return payloads

    def _seal_and_finish(self, step: ScheduledStep, pool: KVPagePool, errors: dict[Sequence, str]) -> None:
        """Index newly full pages in the prefix cache and release finished requests' pages."""
        for seq in step.seqs:
            if seq in errors:
                continue
            try:
                self.scheduler.seal_full_pages(seq)
                self.integrity.sealed(seq, pool)  # audit: checksum of each newly sealed page
                if seq.finished:
                    self.scheduler.finish(seq)
            except Exception as exc:
                errors[seq] = log_failure([seq], "page bookkeeping", exc)

    def _collect(
        self,
        sampled: dict[Sequence, int],
        payloads: dict[Sequence, handoff.KVPayload],
        errors: dict[Sequence, str],
    ) -> list[RequestOutput]:
        """The output of every request that sampled a token (a finished one leaves the engine)."""
        outputs = []
        for seq in sampled:
            state = self.requests.get(seq.request_id)
            if state is None or seq in errors:
                continue
            try:
                out = state.output(finished=seq.finished)
            except Exception as exc:
                errors[seq] = log_failure([seq], "output", exc)
                continue
            out.kv_payload = payloads.get(seq)
            outputs.append(out)
            if seq.finished:
                del self.requests[seq.request_id]
                self.stats.requests_finished += 1
        return outputs
