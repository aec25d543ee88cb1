"""A sequence's place in its grammar: an xgrammar matcher that accepts each token as it is appended.

The matcher lives on the Sequence (``seq.grammar``), so it stays as it is through preemption and
recompute (the output tokens do not change) and through the in-process prefill -> decode migration.
A decode worker receiving a handed-off sequence builds a fresh matcher from the same constraint and
replays the output tokens the prefill side sampled (``advance`` on its first token).
"""

from __future__ import annotations

from pagoda.node_agent.params import RequestError, SamplingParams, guided_param


class GrammarState:
    """The matcher of one constrained sequence."""

    def __init__(self, compiled, param: str) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = int(compiled.tokenizer_info.vocab_size)
        self.param = param  # the API field a rejection names

    @classmethod
    def of(cls, params: SamplingParams, compiled) -> GrammarState:
        return cls(compiled, guided_param(params.guided))

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted."""
        return self.matcher.is_terminated()


class GrammarRejected(RequestError):
    """A token the sequence's grammar does not allow (a handoff whose first token breaks it)."""


def advance(seq, tok: int) -> None:
    """After ``tok`` was appended to ``seq``: its matcher accepts it (GrammarRejected if the grammar
    forbids it); a grammar that has terminated finishes the sequence with "stop". No-op unconstrained."""
    g = seq.grammar
    if g is None:
        return
    if not g.matcher.accept_token(tok):
        raise GrammarRejected(f"token {tok} is not allowed by the request's {g.param} constraint", g.param)
    if g.terminated:
        seq.finish("stop")
