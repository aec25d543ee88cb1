"""A request's logprobs as OpenAI-shaped entries, released in step with the text it returns.

Each sampled token's entry is ``{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
"bytes"}]}``. A sampled token's ``token`` is the text it added to the reply (so the entries' tokens
concatenate to the text; a token that leaves a character incomplete has "" and the one completing it
the character; a special token such as EOS adds no text and has ""); an alternative's ``token`` is
that token's own text. ``bytes`` is the UTF-8 encoding of ``token``.

Entries follow the visible text: while a stop string may still match, a token is released once its
text is wholly visible; when a stop string cuts the text, the tokens whose text starts before the
cut are listed (the last may reach into the cut-away stop string) and the rest are not.
"""

from __future__ import annotations

import bisect

from pagoda.node_agent.engine.logprobs import TokenLogprobs, token_pieces
from pagoda.node_agent.engine.sequence import Sequence
from pagoda.node_agent.models.tokenizer import Tokenizer


def entry(tokenizer: Tokenizer, e: TokenLogprobs, text: str) -> dict:
    """One OpenAI-shaped entry: the token as ``text``, its alternatives by their own text."""
    top = [
        {"token": (t := tokenizer.token_text(i)), "logprob": lp, "bytes": list(t.encode())} for i, lp in e.top
    ]
    return {"token": text, "logprob": e.logprob, "bytes": list(text.encode()), "top_logprobs": top}


class LogprobsOut:
    """Which of a sequence's logprobs have gone out, and the text offset of each output token."""

    def __init__(self, tokenizer: Tokenizer, seq: Sequence, prompt_sent: bool = False) -> None:
        self.tok = tokenizer
        self.seq = seq
        self.ends: list[int] = []  # the text's length after each output token (appended per token)
        self.sent = 0  # entries already released
        self.prompt_sent = prompt_sent or seq.params.prompt_logprobs is None
        self.prompt_text: str | None = None  # the decoded prompt (its tokens' texts joined), once built

    def new(
        self, text: str, visible: int, finished: bool, failed: bool, cut: bool = False
    ) -> tuple[list[dict | None] | None, list[dict | None] | None]:
        """(the entries released now, the prompt entries on the first output); ``text``: the whole
        uncut text, ``visible``: how much of it is returned; ``cut``: a stop string cut it there."""
        prompt = None
        if not self.prompt_sent and not failed:
            prompt = self.prompt_entries()
            self.prompt_sent = True
        if self.seq.params.logprobs is None:
            return None, prompt
        if failed:
            return [], prompt
        n = self._ready(visible, finished, cut)
        out: list[dict | None] = []
        for k in range(self.sent, n):
            e = self.seq.logprobs[k] if k < len(self.seq.logprobs) else None
            start = self.ends[k - 1] if k else 0
            out.append(None if e is None else entry(self.tok, e, text[start : self.ends[k]]))
        self.sent = max(self.sent, n)
        return out, prompt

    def token_added(self, text_len: int) -> None:
        """An output token was appended and the text is ``text_len`` characters long now."""
        self.ends.append(max(text_len, self.ends[-1] if self.ends else 0))

    def _ready(self, visible: int, finished: bool, cut: bool) -> int:
        """How many output tokens may have their entries out (``ends`` never decreases)."""
        ends = self.ends
        if finished and not cut:
            return len(ends)
        if finished:  # the tokens whose text starts before the cut: token k starts at ends[k - 1]
            return min(len(ends), bisect.bisect_left(ends, visible) + 1) if visible > 0 else 0
        return bisect.bisect_right(ends, visible)  # wholly visible

    def prompt_entries(self) -> list[dict | None]:
        """The prompt's entries: None for the first token, then one per token scored; each token's text
        is what it adds to the decoded prompt (special tokens spelled out)."""
        ids = self.seq.prompt_token_ids
        pieces = token_pieces(lambda x: self.tok.decode(x, skip_special_tokens=False), ids)
        scored = self.seq.prompt_logprobs
        self.prompt_text = "".join(pieces)
        return [None] + [entry(self.tok, e, pieces[j + 1]) for j, e in enumerate(scored[: len(ids) - 1])]
