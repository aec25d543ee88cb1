"""The API's typed errors: ``ApiError`` (answered as OpenAI-style JSON with its ``param``), how an
engine ``RequestError`` becomes one (its ``param`` attribute, never its message text), and the
failures every backend (the local engine, the router) reports the same way."""

from __future__ import annotations

from typing import Any

from pagoda.node_agent.params import PROMPT, RequestError

RETRY_AFTER_S = 1  # the Retry-After of every 429/503 that asks the client to come back


class RequestFailed(RuntimeError):
    """A request ended with an error (integrity abort, engine failure): never shown as text."""


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
        return {
            "error": {
                "message": printable(self.message),
                "type": self.type,
                "param": None if self.param is None else printable(self.param),
                "code": self.code,
            }
        }


def printable(s: str) -> str:
    """``s`` with anything not encodable as UTF-8 (lone surrogates) escaped, so it can be sent."""
    return s.encode("utf-8", "backslashreplace").decode("utf-8")


def request_error(exc: Exception, prompt_field: str = "prompt") -> ApiError:
    """An engine RequestError -> 400 naming its ``param``; ``PROMPT`` names ``prompt_field`` (``prompt``
    or ``messages``). Any other exception raised while reading a prompt is about the prompt."""
    param = exc.param if isinstance(exc, RequestError) else PROMPT
    return ApiError(400, str(exc), param=prompt_field if param == PROMPT else param, code="invalid_value")
