"""OpenAI-compatible request and response shapes, with validation that names the offending field.

What a request may hold is explicit: every field is either accepted (and implemented), accepted
and ignored because it cannot change the output (``user``, ``metadata``, ``store``,
``stream_options.include_usage`` is implemented), or an OpenAI field this server does not
implement, refused with 400 "X is not supported" unless it holds its neutral value (null, false,
an empty list or object, ``best_of: 1``, ``response_format: {"type": "text"}``...). Any other
field is 400 "unknown field X". Numbers are strict: a bool is not an int, a float is not an int,
a string is not a number. Every string of the body must be valid Unicode (no lone surrogates).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from pagoda.node_agent.params import MAX_LOGPROBS, RequestError, SamplingParams, logit_bias_from_json
from pagoda.node_agent.serving.api.errors import ApiError, printable
from pagoda.node_agent.serving.api.logprobs import chat_wants, completion_wants

MAX_N = 8
MAX_PROMPTS = 32
MAX_CHOICES = MAX_N * MAX_PROMPTS  # prompts x n of one request
MAX_DEPTH = 32  # nesting of JSON arrays and objects in a body
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
SEED_MODULUS = 2**64  # per-choice seeds are wrapped into the generator's range [0, 2**64)


# ---------------------------------------------------------------------------- field policy


def _null(v: Any) -> bool:
    return v is None


def _null_or_false(v: Any) -> bool:
    return v is None or v is False


def _null_or_empty_list(v: Any) -> bool:
    return v is None or v == []


def _null_or(*values: Any) -> Callable[[Any], bool]:
    return lambda v: v is None or any(type(v) is type(x) and v == x for x in values)


# OpenAI fields this server does not implement -> the values that mean "not used"
COMMON_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "service_tier": _null_or("auto", "default"),
}
COMPLETION_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    **COMMON_UNSUPPORTED,
    "best_of": _null_or(1),
    "suffix": _null_or(""),
}
CHAT_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    **COMMON_UNSUPPORTED,
    "functions": _null_or_empty_list,
    "function_call": _null_or("none"),
    "audio": _null,
    "modalities": lambda v: v is None or v == [] or v == ["text"],
    "prediction": _null,
    "reasoning_effort": _null,
    "web_search_options": _null,
}
MESSAGE_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "function_call": _null,
    "refusal": _null,
    "audio": _null,
}

MAX_TOOLS = 128  # OpenAI's own limit on functions per request
TOOL_NAME = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for function names
MAX_CALLS_IN_HISTORY = 128


class ApiModel(BaseModel):
    """Strict types; fields outside the model are refused."""

    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(ApiModel):
    include_usage: bool | None = None


class _Request(ApiModel):
    """Fields shared by completions and chat completions."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0, le=INT64_MAX)  # extension; 0 = off
    n: int | None = Field(default=None, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    ignore_eos: bool | None = None  # extension
    # accepted and ignored: they cannot change the output
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    # token id (a decimal string in the body) -> bias in [-100, 100]: read and checked once, here;
    # the ids against the model's vocabulary when the engine takes the request
    logit_bias: dict[int, float] | None = None
    # accepted only with their neutral values (checked before the model is built)
    service_tier: str | None = None

    UNSUPPORTED: ClassVar[dict[str, Callable[[Any], bool]]] = COMMON_UNSUPPORTED

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias(cls, v: Any) -> dict[int, float] | None:
        if v is None:
            return None
        try:
            return logit_bias_from_json(v)
        except RequestError as exc:
            raise ValueError(str(exc)) from None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else v or []
        if len(items) > 4 or any(not s for s in items):
            raise ValueError("stop takes up to 4 non-empty strings")
        return v

    @property
    def choices_per_prompt(self) -> int:
        return self.n or 1

    @property
    def streaming(self) -> bool:
        return bool(self.stream)

    def unsupported(self) -> None:
        """Reject what the engine does not implement instead of ignoring it silently."""
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise ApiError(400, f"{name} is not supported; send 0", param=name, code="unsupported")

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling(self, max_tokens: int, index: int = 0) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        seed = None if self.seed is None else (self.seed + index) % SEED_MODULUS
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_k=self.top_k or 0,
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=seed,
            stop=stop,
            ignore_eos=bool(self.ignore_eos),
            logit_bias=dict(self.logit_bias or {}),
        )


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: bool | int | None = None
    best_of: int | None = None
    echo: bool | None = None
    suffix: str | None = None

    UNSUPPORTED: ClassVar[dict[str, Callable[[Any], bool]]] = COMPLETION_UNSUPPORTED

    def unsupported(self) -> None:
        super().unsupported()
        completion_wants(self.logprobs, self.echo, "")  # 400 naming logprobs when out of range

    def sampling(self, max_tokens: int, index: int = 0) -> SamplingParams:
        p = super().sampling(max_tokens, index)
        prompt = self.prompts()[index // self.choices_per_prompt]
        p.logprobs, p.prompt_logprobs = completion_wants(self.logprobs, self.echo, prompt)
        return p

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


class ContentPart(ApiModel):
    type: Literal["text"]
    text: str


class FunctionCallIn(ApiModel):
    name: str = Field(pattern=TOOL_NAME)
    arguments: str


class ToolCallIn(ApiModel):
    """A tool call of an earlier assistant turn, as the client sends it back."""

    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCallIn


class FunctionDef(ApiModel):
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(ApiModel):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(ApiModel):
    name: str = Field(pattern=TOOL_NAME)


class NamedToolChoice(ApiModel):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(ApiModel):
    name: str = Field(default="response", pattern=TOOL_NAME)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(ApiModel):
    """``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {...}}``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatMessage(ApiModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = Field(default=None, max_length=256)
    tool_calls: list[ToolCallIn] | None = Field(default=None, max_length=MAX_CALLS_IN_HISTORY)
    tool_call_id: str | None = Field(default=None, max_length=256)
    # accepted only with their neutral values (checked before the model is built)
    function_call: None = None
    refusal: None = None
    audio: None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolDef] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    functions: list[Any] | None = None
    function_call: str | None = None
    response_format: ResponseFormat | None = None
    audio: None = None
    modalities: list[str] | None = None
    prediction: None = None
    reasoning_effort: None = None
    web_search_options: None = None

    UNSUPPORTED: ClassVar[dict[str, Callable[[Any], bool]]] = CHAT_UNSUPPORTED

    def unsupported(self) -> None:
        super().unsupported()
        check_tools(self)
        chat_wants(self.logprobs, self.top_logprobs)  # 400 naming top_logprobs without logprobs

    def sampling(self, max_tokens: int, index: int = 0) -> SamplingParams:
        p = super().sampling(max_tokens, index)
        p.logprobs = chat_wants(self.logprobs, self.top_logprobs)
        return p

    def chat_messages(self) -> list[dict[str, Any]]:
        """The messages as a chat template takes them: tool calls with their arguments as objects
        (the Hugging Face convention), tool results with their call id."""
        role = {"developer": "system"}
        out: list[dict[str, Any]] = []
        for m in self.messages:
            d: dict[str, Any] = {"role": role.get(m.role, m.role), "content": m.text()}
            if m.tool_calls:
                d["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)},
                    }
                    for c in m.tool_calls
                ]
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                d["name"] = m.name
            out.append(d)
        return out

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def tool_dicts(self) -> list[dict[str, Any]]:
        """The offered tools as plain OpenAI dicts (what templates, parsers and grammars take)."""
        return [t.model_dump(exclude_none=True) for t in self.tools or []]

    def tool_choice_value(self) -> str | dict[str, Any]:
        """``none`` / ``auto`` / ``required`` / a named function; OpenAI's default: auto with tools."""
        c = self.tool_choice
        if c is None:
            return "auto" if self.tools else "none"
        return c if isinstance(c, str) else c.model_dump()


def _arguments(text: str) -> Any:
    """A history tool call's arguments: the JSON object it holds, else the string as sent."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def check_tools(req: ChatCompletionRequest) -> None:
    """Tools, tool_choice and response_format that fit together (400 naming the field)."""
    names = [t.function.name for t in req.tools or []]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ApiError(400, f"tools: duplicate function name {dup[0]!r}", param="tools", code="invalid_value")
    for i, t in enumerate(req.tools or []):
        params = t.function.parameters
        if params is not None and params.get("type", "object") != "object":
            where = f"tools[{i}].function.parameters"
            raise ApiError(
                400, f"{where}: must be a JSON schema of an object", param=where, code="invalid_value"
            )
    choice = req.tool_choice
    if choice not in (None, "none") and not names:
        raise ApiError(
            400, "tool_choice needs tools (or send 'none')", param="tool_choice", code="invalid_value"
        )
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise ApiError(
            400,
            f"tool_choice: function {choice.function.name!r} is not among the tools",
            param="tool_choice",
            code="invalid_value",
        )
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise ApiError(
                400,
                "response_format.json_schema.schema is required for type json_schema",
                param="response_format.json_schema",
                code="invalid_value",
            )
    if fmt is not None and fmt.type != "text" and names and req.tool_choice_value() != "none":
        raise ApiError(
            400,
            "response_format json_object/json_schema cannot be combined with tools here; "
            "send tool_choice 'none' or leave the tools out",
            param="response_format",
            code="unsupported",
        )


# ---------------------------------------------------------------------------- parsing


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_body(raw: bytes, kind: type[_Request]) -> _Request:
    """JSON bytes -> a validated request, or an ApiError naming the field."""
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except RecursionError as exc:
        raise ApiError(400, "malformed JSON body: nested too deeply", code="invalid_json") from exc
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, NaN, an int of >4300 digits
        why = "an integer has too many digits" if "integer string conversion" in str(exc) else str(exc)
        raise ApiError(400, f"malformed JSON body: {why}", code="invalid_json") from exc
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    check_strings(data)
    check_fields(data, kind)
    try:
        req = kind.model_validate(data)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        where = loc_path(data, err["loc"], err["type"] in ("missing", "extra_forbidden")) or "body"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] not in ("missing", "extra_forbidden"):
            msg += f" (got {json_type(err.get('input'))})"
        raise ApiError(
            400, f"{where}: {msg}", param=None if where == "body" else where, code="invalid_value"
        ) from exc
    req.unsupported()
    return req


def check_strings(data: Any) -> None:
    """Every key and string of ``data`` is valid Unicode and nesting stays under MAX_DEPTH."""
    stack: list[tuple[Any, str, int]] = [(data, "", 0)]
    while stack:
        node, path, depth = stack.pop()
        if isinstance(node, str):
            bad = not _encodable(node)
        elif isinstance(node, dict | list):
            if depth >= MAX_DEPTH:
                raise ApiError(
                    400,
                    f"{path or 'body'}: nested deeper than {MAX_DEPTH} levels",
                    param=path or None,
                    code="invalid_value",
                )
            items = node.items() if isinstance(node, dict) else enumerate(node)
            for k, v in items:
                if isinstance(k, str):
                    sub = f"{path}.{k}" if path else k
                    if not _encodable(k):
                        raise ApiError(
                            400,
                            f"{printable(sub)}: a field name is not valid Unicode (lone surrogate)",
                            param=printable(sub),
                            code="invalid_value",
                        )
                else:
                    sub = f"{path}[{k}]"
                stack.append((v, sub, depth + 1))
            continue
        else:
            continue
        if bad:
            raise ApiError(
                400,
                f"{path}: the string is not valid Unicode (lone surrogate)",
                param=path,
                code="invalid_value",
            )


def _encodable(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_fields(data: dict[str, Any], kind: type[_Request]) -> None:
    """Unknown fields and non-neutral values of unsupported ones -> 400 naming the field."""
    _check_keys(data, kind.model_fields, kind.UNSUPPORTED, "")
    if kind is ChatCompletionRequest and isinstance(data.get("messages"), list):
        for i, m in enumerate(data["messages"]):
            if isinstance(m, dict):
                _check_keys(m, ChatMessage.model_fields, MESSAGE_UNSUPPORTED, f"messages[{i}].")
                parts = m.get("content")
                if isinstance(parts, list):
                    for j, part in enumerate(parts):
                        kind_ = part.get("type") if isinstance(part, dict) else None
                        if isinstance(kind_, str) and kind_ != "text":
                            where = f"messages[{i}].content[{j}].type"
                            raise ApiError(
                                400,
                                f"{where}: {kind_!r} content is not supported (only text)",
                                param=where,
                                code="unsupported",
                            )


def _check_keys(
    obj: dict[str, Any], known: dict[str, Any], unsupported: dict[str, Callable[[Any], bool]], prefix: str
) -> None:
    for key, value in obj.items():
        where = prefix + key
        if key in unsupported:
            if not unsupported[key](value):
                raise ApiError(400, f"{where} is not supported", param=where, code="unsupported")
        elif key not in known:
            raise ApiError(400, f"unknown field {where}", param=where, code="unknown_field")


def json_type(v: Any) -> str:
    """The JSON type of a parsed value, for messages."""
    if v is None:
        return "null"
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}
    names.update({list: "an array", dict: "an object"})
    return names.get(type(v), type(v).__name__)


def loc_path(data: Any, loc: tuple[Any, ...], absent: bool = False) -> str:
    """A pydantic error location as a path into ``data`` (``messages[0].role``), skipping the
    names pydantic gives union members; ``absent``: the last part names a field not in ``data``."""
    out = ""
    node = data
    for k, part in enumerate(loc):
        if absent and k == len(loc) - 1 and isinstance(node, dict) and isinstance(part, str):
            return f"{out}.{part}" if out else part
        if isinstance(node, dict) and isinstance(part, str) and part in node:
            out = f"{out}.{part}" if out else part
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            out = f"{out}[{part}]"
            node = node[part]
    return out


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
