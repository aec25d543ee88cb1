"""OpenAI logprobs for the API: what a request asks for, and the shapes of chat and legacy completions
built from the entries the engine streams (StreamChunk.logprobs / prompt_logprobs; docs/logprobs.md).

- chat: ``logprobs: true`` (+ ``top_logprobs`` 0..20) -> ``choice.logprobs = {"content": [entry...],
  "refusal": null}``, each entry ``{"token", "logprob", "bytes", "top_logprobs": [...]}``.
- completions: ``logprobs: N`` (0..20) -> ``{"tokens", "token_logprobs", "top_logprobs" (a dict token
  -> logprob per token), "text_offset"}``; ``echo: true`` puts the prompt before the completion, in
  the text and (with ``logprobs``) in the four lists, the first prompt token with null logprobs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from pagoda.node_agent.params import MAX_LOGPROBS
from pagoda.node_agent.serving.api.backend import GenRequest, StreamChunk
from pagoda.node_agent.serving.api.errors import ApiError


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code="invalid_value")


def chat_wants(logprobs: bool | None, top_logprobs: int | None) -> int | None:
    """SamplingParams.logprobs of a chat request (400 naming the field when inconsistent)."""
    if top_logprobs is not None and not logprobs:
        raise _bad("top_logprobs", "needs logprobs: true")
    return (top_logprobs or 0) if logprobs else None


def completion_wants(
    logprobs: bool | int | None, echo: bool | None, prompt: str | list[int]
) -> tuple[int | None, int | None]:
    """(logprobs, prompt_logprobs) of one completions prompt. ``echo`` of a token-id prompt without
    ``logprobs`` still scores the prompt (N = 0): its tokens' texts are how its text comes back."""
    if logprobs is False:
        logprobs = None  # OpenAI's neutral value
    if logprobs is True or (logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS):
        raise _bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}] (got {json.dumps(logprobs)})")
    if not echo:
        return logprobs, None
    if logprobs is not None:
        return logprobs, logprobs
    return None, None if isinstance(prompt, str) else 0


@dataclass
class _Choice:
    """What one choice has streamed so far (completions: the text offset of the next token)."""

    offset: int = 0
    started: bool = False


@dataclass
class Shaper:
    """Builds each choice's text and ``logprobs`` in the OpenAI shape of its endpoint."""

    chat: bool
    prompts: list[str | list[int] | list[dict]]  # per choice
    echo: bool = False
    state: dict[int, _Choice] = field(default_factory=dict)

    @classmethod
    def of(cls, req: Any, gens: list[GenRequest], chat: bool) -> Shaper:
        echo = bool(getattr(req, "echo", False)) and not chat
        return cls(chat, [g.prompt for g in gens], echo)

    def final(self, i: int, text: str, last: StreamChunk) -> tuple[str, dict | None]:
        """A whole choice: (its text, its logprobs); ``last`` carries every entry (``gather``)."""
        return self.delta(i, replace(last, delta=text))[:2]

    def delta(self, i: int, c: StreamChunk) -> tuple[str, dict | None, bool]:
        """A streamed chunk of choice ``i``: (its text, its logprobs, whether it says anything)."""
        st = self.state.setdefault(i, _Choice())
        first, st.started = not st.started, True
        entries = [e for e in c.logprobs or [] if e is not None]
        if self.chat:
            lp = {"content": entries, "refusal": None} if c.logprobs is not None else None
            return c.delta, lp, bool(c.delta or entries)
        text = c.delta
        lists: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        if self.echo and first:
            prompt = self.prompts[i]
            echoed = prompt if isinstance(prompt, str) else (c.prompt_text or "")
            if c.prompt_logprobs is not None and c.logprobs is not None:
                self._prompt_lists(lists, c, st)
            st.offset = len(echoed)
            text = echoed + text
        for e in entries:
            _add(lists, e["token"], e["logprob"], _tops(e), st.offset)
            st.offset += len(e["token"])
        lp = lists if c.logprobs is not None else None
        return text, lp, bool(text or entries)

    def _prompt_lists(self, lists: dict[str, list], c: StreamChunk, st: _Choice) -> None:
        """The prompt's tokens first: the first has null logprobs and its text is what the others
        leave of the decoded prompt."""
        rest = c.prompt_logprobs[1:]
        whole = c.prompt_text or ""
        tail = "".join(e["token"] for e in rest if e is not None)
        head = whole[: len(whole) - len(tail)] if whole.endswith(tail) else ""
        _add(lists, head, None, None, 0)
        at = len(head)
        for e in rest:
            if e is None:
                continue
            _add(lists, e["token"], e["logprob"], _tops(e), at)
            at += len(e["token"])


def _tops(e: dict) -> dict[str, float]:
    return {t["token"]: t["logprob"] for t in e.get("top_logprobs") or []}


def _add(lists: dict[str, list], token: str, lp: float | None, top: dict | None, offset: int) -> None:
    lists["tokens"].append(token)
    lists["token_logprobs"].append(lp)
    lists["top_logprobs"].append(top)
    lists["text_offset"].append(offset)


class Gathered:
    """A choice's entries over all its chunks (for the non-streaming answer)."""

    def __init__(self) -> None:
        self.entries: list[dict | None] | None = None
        self.prompt: list[dict | None] | None = None
        self.prompt_text: str | None = None

    def add(self, c: StreamChunk) -> None:
        if c.logprobs is not None:
            self.entries = self.entries or []
            self.entries.extend(c.logprobs)
        if c.prompt_logprobs is not None and self.prompt is None:
            self.prompt, self.prompt_text = c.prompt_logprobs, c.prompt_text

    def onto(self, last: StreamChunk) -> StreamChunk:
        """``last`` carrying every entry of the choice."""
        return replace(last, logprobs=self.entries, prompt_logprobs=self.prompt, prompt_text=self.prompt_text)
