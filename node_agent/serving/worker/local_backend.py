"""The API backend of a single-process worker (``--role both``): requests go to the local engine."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from pagoda.node_agent.params import CapacityError, RequestError
from pagoda.node_agent.serving.api.backend import ChatFormat, GenRequest, StreamChunk
from pagoda.node_agent.serving.api.errors import RETRY_AFTER_S, ApiError, request_error
from pagoda.node_agent.serving.worker.async_engine import (
    AsyncEngine,
    EngineDead,
    QueueFull,
    QueueTimeout,
    RequestStream,
    Submission,
    TooManyChoices,
)


def too_many_error(exc: Exception) -> ApiError:
    return ApiError(400, str(exc), param="n", code="too_many_choices")


def retry_after(exc: Exception) -> str:
    """The Retry-After of a refusal: the queue's own estimate when it made one."""
    return str(getattr(exc, "retry_after_s", None) or RETRY_AFTER_S)


def busy_error(exc: Exception) -> ApiError:
    if isinstance(exc, QueueFull | CapacityError):
        return ApiError(
            429,
            f"the server is busy ({exc}); retry later",
            code="queue_full",
            type_="rate_limit_error",
            headers={"Retry-After": retry_after(exc)},
        )
    return ApiError(
        503,
        f"the engine is not available: {exc}",
        code="engine_unavailable",
        type_="server_error",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


class LocalHandle:
    """Chunks of one local request."""

    def __init__(self, stream: RequestStream) -> None:
        self.stream = stream
        self.request_id = stream.request_id

    def __aiter__(self) -> AsyncIterator[StreamChunk]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[StreamChunk]:
        try:
            async for out in self.stream:
                yield StreamChunk.of(out)
        except QueueTimeout as exc:  # 503 before any byte, or a stream's final error event
            raise ApiError(
                503,
                str(exc),
                code="queue_timeout",
                type_="server_error",
                headers={"Retry-After": retry_after(exc)},
            ) from exc

    def abort(self) -> None:
        self.stream.abort()


class LocalBackend:
    """Generates with an AsyncEngine in this process."""

    def __init__(self, engine: AsyncEngine, chat_format: ChatFormat | None = None) -> None:
        self.engine = engine
        self._chat_format = chat_format or ChatFormat()

    def chat_format(self) -> ChatFormat:
        return self._chat_format

    @property
    def ready(self) -> bool:
        return self.engine.ready

    def ready_detail(self) -> dict[str, Any]:
        snap = self.engine.snapshot()
        return {
            "engine": self.engine.ready,
            "kv_capacity_tokens": snap.kv_capacity_tokens,
            "kv_pools": [p.name for p in snap.pools],
        }

    async def open(self, req: GenRequest) -> LocalHandle:
        try:
            stream = await self.engine.submit(
                req.prompt, req.params, chat=req.chat, cache_salt=req.cache_salt, request_id=req.request_id
            )
        except RequestError as exc:
            raise request_error(exc, "messages" if req.chat else "prompt") from exc
        except (QueueFull, EngineDead, CapacityError) as exc:
            raise busy_error(exc) from exc
        return LocalHandle(stream)

    async def open_all(self, reqs: list[GenRequest]) -> list[LocalHandle]:
        if not reqs:
            return []
        subs = [Submission(r.prompt, r.params, r.chat, r.cache_salt, r.request_id) for r in reqs]
        try:
            streams = await self.engine.submit_many(subs)
        except TooManyChoices as exc:
            raise too_many_error(exc) from exc
        except RequestError as exc:
            raise request_error(exc, "messages" if reqs[0].chat else "prompt") from exc
        except (QueueFull, EngineDead, CapacityError) as exc:
            raise busy_error(exc) from exc
        return [LocalHandle(s) for s in streams]
