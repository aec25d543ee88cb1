"""What flows between the API layer and whatever generates (local engine or router): one request's
generation parameters in, and a stream of chunks out."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from pagoda.node_agent.params import SamplingParams


@dataclass
class GenRequest:
    """One prompt to generate for (one choice of an API request)."""

    prompt: str | list[int] | list[dict]
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

    async def open(self, req: GenRequest) -> Handle: ...

    async def open_all(self, reqs: list[GenRequest]) -> list[Handle]:
        """Start every choice of one API request, or none: the whole set is admitted or refused at
        once (400 when it can never fit or a prompt is invalid, 429 when it does not fit now),
        before any of them does work."""
        ...
