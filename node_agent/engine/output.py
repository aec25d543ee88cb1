"""What a request has produced: stop rules, incremental detokenization, stop-string hold-back."""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.node_agent.engine.handoff import KVPayload
from pagoda.node_agent.engine.logprobs_out import LogprobsOut
from pagoda.node_agent.engine.sequence import Sequence
from pagoda.node_agent.models.tokenizer import Detokenizer, Tokenizer


@dataclass
class RequestOutput:
    """What a request has produced so far (``delta`` is the new text since the last output)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    delta: str
    finished: bool
    finish_reason: str | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    kv_payload: KVPayload | None = None  # set on a prefill-only request's final output
    # OpenAI-shaped entries (docs/logprobs.md) for the tokens new in this output, when asked; an entry
    # is None for a token sampled on another worker (a handoff's first token: the router fills it)
    logprobs: list[dict | None] | None = None
    prompt_logprobs: list[dict | None] | None = None  # the first output only; the first token None
    prompt_text: str | None = None  # with prompt_logprobs: the decoded prompt, its tokens' texts joined


@dataclass(frozen=True)
class StopRules:
    """Model-wide stop conditions: end-of-sequence ids and the context length."""

    eos_ids: frozenset[int]
    max_model_len: int


class RequestState:
    """Per-request output state kept beside the Sequence: detokenizer and text already sent."""

    def __init__(self, seq: Sequence, tokenizer: Tokenizer, rules: StopRules, received: bool = False) -> None:
        """``received``: the sequence was prefilled on another worker (its prompt logprobs, and the
        first token's entry, travel from there)."""
        self.seq = seq
        p = seq.params
        self.detok = Detokenizer(
            tokenizer, p.skip_special_tokens, rules.eos_ids | frozenset(p.stop_token_ids)
        )
        self.rules = rules
        self.sent = 0  # characters of text already emitted
        self.stop_text: str | None = None  # final text, cut before a matched stop string
        self.logprobs = LogprobsOut(tokenizer, seq, prompt_sent=received)

    def check_stop(self, tok: int) -> None:
        """After ``tok`` was appended: finish the sequence on EOS, a stop id/string or its length."""
        seq, p = self.seq, self.seq.params
        reason = None
        if (tok in self.rules.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            reason = "stop"
        elif len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.rules.max_model_len:
            reason = "length"
        if p.logprobs is not None:
            self.logprobs.token_added(len(self.detok.update(seq.output_token_ids)))
        if p.stop:
            text = self.detok.update(seq.output_token_ids)
            hits = [text.find(s) for s in p.stop if s in text]
            if hits:
                self.stop_text = text[: min(hits)]
                reason = "stop"
        if reason:
            seq.finish(reason)

    def output(self, finished: bool) -> RequestOutput:
        """The request's output now; unfinished text holds back what could start a stop string."""
        seq = self.seq
        if seq.error is not None:
            text = ""  # fail closed: nothing built on a bad step is returned
        elif self.stop_text is not None:
            text = self.stop_text
        else:
            text = self.detok.update(seq.output_token_ids)
        visible = text
        if not finished and seq.params.stop:
            hold = max(len(s) for s in seq.params.stop) - 1
            visible = text[: max(len(text) - hold, self.sent)]
        delta = visible[self.sent :]
        self.sent = max(self.sent, len(visible))
        cut = self.stop_text is not None
        lps, prompt = self.logprobs.new(self.detok.text, len(visible), finished, seq.error is not None, cut)
        return RequestOutput(
            seq.request_id,
            seq.prompt_token_ids,
            list(seq.output_token_ids),
            text,
            delta,
            finished,
            seq.finish_reason,
            seq.error,
            seq.num_cached_tokens,
            logprobs=lps,
            prompt_logprobs=prompt,
            prompt_text=self.logprobs.prompt_text if prompt is not None else None,
        )
