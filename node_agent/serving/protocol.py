"""OpenAI-compatible request and response shapes, with validation that names the offending field."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from pagoda.node_agent.engine.sequence import SamplingParams

MAX_N = 8
MAX_PROMPTS = 32


class ApiError(Exception):
    """An error answered as OpenAI-style JSON: ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type_: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Request(BaseModel):
    """Fields shared by completions and chat completions (unknown extra fields are ignored)."""

    model_config = ConfigDict(extra="ignore", strict=False)

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logprobs: Any = None
    ignore_eos: bool = False
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else v or []
        if len(items) > 4 or any(not s for s in items):
            raise ValueError("stop takes up to 4 non-empty strings")
        return v

    def unsupported(self) -> None:
        """Reject what the engine does not implement instead of ignoring it silently."""
        if self.presence_penalty or self.frequency_penalty:
            name = "presence_penalty" if self.presence_penalty else "frequency_penalty"
            raise ApiError(400, f"{name} is not supported; send 0", param=name)
        if self.logprobs not in (None, False, 0):
            raise ApiError(400, "logprobs is not supported", param="logprobs")

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    def sampling(self, max_tokens: int, index: int = 0) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        seed = None if self.seed is None else self.seed + index
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            seed=seed,
            stop=stop,
            ignore_eos=self.ignore_eos,
        )


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be empty")
            if len(v) > MAX_PROMPTS and not isinstance(v[0], int):
                raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts: one string, several strings, token ids, or several id lists."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]

    def unsupported(self) -> None:
        super().unsupported()
        if self.echo:
            raise ApiError(400, "echo is not supported", param="echo")
        if self.suffix:
            raise ApiError(400, "suffix is not supported", param="suffix")


class ContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def chat_messages(self) -> list[dict[str, str]]:
        role = {"developer": "system"}
        return [{"role": role.get(m.role, m.role), "content": m.text()} for m in self.messages]

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def parse_body(raw: bytes, kind: type[_Request]) -> _Request:
    """JSON bytes -> a validated request, or an ApiError naming the field."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"malformed JSON body: {exc}", code="invalid_json") from exc
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        req = kind.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = str(err["loc"][0]) if err["loc"] else None
        where = ".".join(str(x) for x in err["loc"]) or "body"
        raise ApiError(400, f"{where}: {err['msg']}", param=field, code="invalid_value") from exc
    req.unsupported()
    return req


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event line pair."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()
