"""What flows between the API layer and whatever generates (local engine or router): one request's
generation parameters in, and a stream of chunks out."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from pagoda.node_agent.params import SamplingParams


@dataclass(frozen=True)
class ChatFormat:
    """How the served model's chat template meets tools and reasoning (reported by the worker)."""

    tool_parser: str = "generic"  # a family parser name, or "generic" (no tool support in the template)
    reasoning_parser: str | None = None  # None: no reasoning separation
    reasoning_open: bool = False  # the generation prompt already opens the reasoning block

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Any) -> ChatFormat:
        if not isinstance(d, dict):
            return cls()
        parser = d.get("tool_parser")
        reasoning = d.get("reasoning_parser")
        return cls(
            parser if isinstance(parser, str) else "generic",
            reasoning if isinstance(reasoning, str) else None,
            d.get("reasoning_open") is True,
        )


@dataclass
class GenRequest:
    """One prompt to generate for (one choice of an API request)."""

    prompt: str | list[int] | list[dict] | dict  # a dict: {"messages", "tools"} for the template
    params: SamplingParams
    chat: bool = False
    cache_salt: str = ""
    session: str | None = None
    request_id: str | None = None


@dataclass
class StreamChunk:
    """Progress of one request: the new text, token counts so far, and how it ended."""

    delta: str
    num_tokens: int
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    # logprobs (docs/logprobs.md): OpenAI-shaped entries of the tokens new in this chunk, when asked;
    # on the internal plane an entry is None for a handoff's first token (the router fills it in)
    logprobs: list[dict | None] | None = None
    prompt_logprobs: list[dict | None] | None = None  # first chunk only; the first prompt token None
    prompt_text: str | None = None  # with prompt_logprobs: the decoded prompt (its tokens joined)

    @classmethod
    def of(cls, out: Any) -> StreamChunk:
        """From an engine RequestOutput."""
        return cls(
            out.delta,
            len(out.token_ids),
            out.finished,
            out.finish_reason,
            len(out.prompt_token_ids),
            out.num_cached_tokens,
            out.error,
            out.logprobs,
            out.prompt_logprobs,
            out.prompt_text,
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> StreamChunk:
        return cls(**{k: d.get(k) for k in cls.__dataclass_fields__ if k in d})


class Handle(Protocol):
    """A running request: iterate its chunks; ``abort`` cancels it and frees its pages."""

    request_id: str

    def __aiter__(self) -> AsyncIterator[StreamChunk]: ...

    def abort(self) -> None: ...


class Backend(Protocol):
    """Starts generations; ``open`` and ``open_all`` raise ApiError before anything is streamed
    when they cannot."""

    @property
    def ready(self) -> bool: ...

    def ready_detail(self) -> dict[str, Any]: ...

    def chat_format(self) -> ChatFormat:
        """The served model's chat format (tool parser, reasoning), as its worker reports it."""
        ...

    async def open(self, req: GenRequest) -> Handle: ...

    async def open_all(self, reqs: list[GenRequest]) -> list[Handle]:
        """Start every choice of one API request, or none: the whole set is admitted or refused at
        once (400 when it can never fit or a prompt is invalid, 429 when it does not fit now),
        before any of them does work."""
        ...
