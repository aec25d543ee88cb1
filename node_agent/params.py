"""Sampling parameters and the typed request errors, shared by the engine, the API and the router.

Torch-free (an import-linter contract keeps it so): the router validates and forwards requests
without loading a model. A ``RequestError`` carries the request field it is about (``param``), set
where it is raised, and the API answers that field as the error's ``param``: the message text is
for people and may be reworded freely.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

PROMPT = "prompt"  # a RequestError about the prompt: the API names its own field (prompt or messages)

# Seeds torch.Generator.manual_seed takes without overflow (negative ones wrap modulo 2**64).
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1
MAX_LOGPROBS = 20  # top alternatives a request may ask for per token (OpenAI's limit)
# SamplingParams.logit_bias: token id -> a bias in [-100, 100] added to its logit; -100 bans it
LOGIT_BIAS_MAX = 100.0
LOGIT_BIAS_MAX_ENTRIES = 1024  # per request: the per-step work of a bias stays small

# SamplingParams.guided: the decoding constraints (the engine compiles them with xgrammar)
GUIDED_TYPES = ("json_object", "json_schema", "regex", "tool_calls")
GUIDED_MAX_BYTES = 64 << 10  # of the constraint's JSON encoding: a larger one is refused
GUIDED_PARAM = "response_format"  # the API field a constraint error names unless it says otherwise
_GUIDED_KEYS = {
    "json_object": ({"type"}, set()),  # (required keys, optional keys) besides "param"
    "json_schema": ({"type", "schema"}, set()),
    "regex": ({"type", "pattern"}, set()),
    "tool_calls": ({"type", "format", "tools"}, {"tool_choice", "parallel_tool_calls", "reasoning"}),
}
_REASONING_MODES = ("enabled", "disabled", "auto")


class RequestError(ValueError):
    """A request that cannot be served as asked (bad parameters, too long a prompt).

    ``param``: the request field at fault (a SamplingParams field, ``PROMPT``), or None."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class CapacityError(RuntimeError):
    """The worker cannot take this request now (full); the caller may retry elsewhere or later."""


def is_int(x: object) -> bool:
    """A plain integer (bool is not one here)."""
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    """An int or float (bool is not a number here)."""
    return isinstance(x, int | float) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. ``temperature == 0`` means greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True  # False: special tokens stay in the text (tool-call markers)
    guided: dict | None = None  # a decoding constraint (GUIDED_TYPES); see check_guided
    logprobs: int | None = None  # None: off; N: each sampled token's logprob and its top N
    prompt_logprobs: int | None = None  # None: off; N: every prompt token's logprob and top N
    # token id -> bias added to its logit before sampling (-100: the token is never sampled);
    # ids are checked against the model's vocabulary when the engine takes the request
    logit_bias: dict[int, float] = field(default_factory=dict)

    def validate(self) -> None:
        """Raise RequestError naming the first parameter that cannot be served."""
        if not is_int(self.max_tokens) or self.max_tokens <= 0:
            raise RequestError(
                f"max_tokens must be a positive integer, got {self.max_tokens!r}", "max_tokens"
            )
        if self.seed is not None and (not is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise RequestError(
                f"seed: must be an integer in [{SEED_MIN}, {SEED_MAX}], got {self.seed!r}", "seed"
            )
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise RequestError(
                f"temperature must be a finite number >= 0, got {self.temperature!r}", "temperature"
            )
        if not _is_real(self.top_p):
            raise RequestError(f"top_p must be a number in (0, 1], got {self.top_p!r}", "top_p")
        if not is_int(self.top_k):
            raise RequestError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}", "top_k")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0 (0 disables it), got {self.top_k}", "top_k")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise RequestError("stop strings must be non-empty strings", "stop")
        if self.guided is not None:
            check_guided(self.guided)
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise RequestError(
                    f"{name} must be null or an integer in [0, {MAX_LOGPROBS}], got {v!r}", name
                )
        check_logit_bias(self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def check_logit_bias(bias: object, vocab_size: int | None = None) -> None:
    """Raise RequestError (param ``logit_bias``) unless ``bias`` maps at most LOGIT_BIAS_MAX_ENTRIES
    non-negative token ids (below ``vocab_size`` when given) to finite numbers in [-100, 100]."""
    if not isinstance(bias, dict):
        raise RequestError(f"logit_bias must be an object, got {type(bias).__name__}", "logit_bias")
    if len(bias) > LOGIT_BIAS_MAX_ENTRIES:
        raise RequestError(
            f"logit_bias takes at most {LOGIT_BIAS_MAX_ENTRIES} tokens, got {len(bias)}", "logit_bias"
        )
    for tok, v in bias.items():
        if not is_int(tok) or tok < 0 or (vocab_size is not None and tok >= vocab_size):
            where = f" (the vocabulary has {vocab_size})" if vocab_size is not None else ""
            raise RequestError(f"logit_bias: {str(tok)[:40]!r} is not a token id{where}", "logit_bias")
        if not _is_real(v) or not math.isfinite(v) or abs(v) > LOGIT_BIAS_MAX:
            raise RequestError(
                f"logit_bias[{tok}] must be a number in [-100, 100], got {str(v)[:40]}", "logit_bias"
            )


def logit_bias_from_json(raw: object) -> dict[int, float]:
    """A JSON ``logit_bias`` (token ids as decimal strings, as OpenAI's API sends them) -> ids to
    biases; RequestError naming ``logit_bias`` for a key that is not a decimal token id."""
    if not isinstance(raw, dict):
        raise RequestError(f"logit_bias must be an object, got {type(raw).__name__}", "logit_bias")
    out: dict[int, float] = {}
    for k, v in raw.items():
        key = str(k)
        if not (key.isascii() and key.isdigit()) or len(key) > 12:
            raise RequestError(f"logit_bias: {key[:40]!r} is not a token id", "logit_bias")
        out[int(key)] = v
    check_logit_bias(out)
    return out


def guided_param(guided: object) -> str:
    """The API field a constraint's errors name: its ``param`` key, else GUIDED_PARAM."""
    p = guided.get("param") if isinstance(guided, dict) else None
    return p if isinstance(p, str) and p else GUIDED_PARAM


def check_guided(g: object) -> None:
    """Raise RequestError (naming the constraint's param) unless ``g`` is a well-formed constraint:
    ``{"type": "json_object"}``, ``{"type": "json_schema", "schema": {...}}``, ``{"type": "regex",
    "pattern": str}`` or ``{"type": "tool_calls", "format": str, "tools": [{...}], "tool_choice":
    "auto" | "required" | {"type": "function", "function": {"name": str}}, "parallel_tool_calls":
    bool, "reasoning": "enabled" | "disabled" | "auto"}``, plus an optional ``"param"`` string, and at
    most GUIDED_MAX_BYTES as JSON. Whether the grammar compiles is the engine's check."""
    param = guided_param(g)

    def bad(why: str) -> RequestError:
        return RequestError(f"constraint: {why}", param)

    if not isinstance(g, dict):
        raise bad(f"must be an object, got {type(g).__name__}")
    kind = g.get("type")
    if kind not in _GUIDED_KEYS:
        raise bad(f"type must be one of {list(GUIDED_TYPES)}, got {str(kind)[:40]!r}")
    required, optional = _GUIDED_KEYS[kind]
    keys = set(g) - {"param"}
    if not required <= keys or not keys <= required | optional:
        raise bad(
            f"{kind} takes the keys {sorted(required)} (and {sorted(optional)}), got {sorted(map(str, keys))}"
        )
    if "param" in g and (not isinstance(g["param"], str) or not 0 < len(g["param"]) <= 64):
        raise bad("param must be a string of 1..64 characters")
    try:
        size = len(json.dumps(g, allow_nan=False).encode())
    except (TypeError, ValueError, RecursionError) as exc:
        raise bad(f"must be plain JSON ({str(exc)[:80]})") from None
    if size > GUIDED_MAX_BYTES:
        raise bad(f"{size} bytes as JSON, at most {GUIDED_MAX_BYTES} are accepted")
    if kind == "json_schema" and not isinstance(g["schema"], dict):
        raise bad(f"schema must be a JSON object, got {type(g['schema']).__name__}")
    if kind == "regex" and (not isinstance(g["pattern"], str) or not g["pattern"]):
        raise bad("pattern must be a non-empty string")
    if kind == "tool_calls":
        _check_tool_calls(g, bad)


def _check_tool_calls(g: dict, bad) -> None:
    """The tool_calls constraint's own fields (``bad(why)`` makes the error)."""
    if not isinstance(g["format"], str) or not g["format"]:
        raise bad("format must be the name of a tool-call format")
    tools = g["tools"]
    if not isinstance(tools, list) or not tools or not all(isinstance(t, dict) for t in tools):
        raise bad("tools must be a non-empty list of tool objects")
    choice = g.get("tool_choice", "auto")
    named = (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and isinstance(choice.get("function"), dict)
        and isinstance(choice["function"].get("name"), str)
    )
    if choice not in ("auto", "required") and not named:
        raise bad('tool_choice must be "auto", "required" or {"type": "function", "function": {"name": ...}}')
    if type(g.get("parallel_tool_calls", True)) is not bool:
        raise bad("parallel_tool_calls must be a boolean")
    if g.get("reasoning", "auto") not in _REASONING_MODES:
        raise bad(f"reasoning must be one of {list(_REASONING_MODES)}")


# The internal plane's JSON form of SamplingParams: each field's accepted JSON types.
_PARAM_TYPES: dict[str, tuple[type, ...]] = {
    "max_tokens": (int,),
    "temperature": (int, float),
    "top_k": (int,),
    "top_p": (int, float),
    "seed": (int, type(None)),
    "stop": (list,),
    "stop_token_ids": (list,),
    "ignore_eos": (bool,),
    "skip_special_tokens": (bool,),
    "guided": (dict, type(None)),
    "logprobs": (int, type(None)),
    "prompt_logprobs": (int, type(None)),
    "logit_bias": (dict,),
}
# The fields a wrong JSON type is answered under (the others keep param null, as before).
_NAMED_ON_TYPE_ERROR = frozenset(
    {"max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "logprobs", "prompt_logprobs"}
)


def params_to_json(p: SamplingParams) -> dict[str, Any]:
    """SamplingParams as the internal plane's JSON (router -> workers)."""
    return {
        "max_tokens": p.max_tokens,
        "temperature": p.temperature,
        "top_k": p.top_k,
        "top_p": p.top_p,
        "seed": p.seed,
        "stop": list(p.stop),
        "stop_token_ids": list(p.stop_token_ids),
        "ignore_eos": p.ignore_eos,
        "skip_special_tokens": p.skip_special_tokens,
        "guided": p.guided,
        "logprobs": p.logprobs,
        "prompt_logprobs": p.prompt_logprobs,
        "logit_bias": {str(t): v for t, v in p.logit_bias.items()},
    }


def params_from_json(d: Any) -> SamplingParams:
    """SamplingParams from the internal plane's JSON; RequestError naming the first bad field."""
    if not isinstance(d, dict):
        raise RequestError("params must be a JSON object")
    for k, v in d.items():
        types = _PARAM_TYPES.get(k)
        if types is None:
            raise RequestError(f"params: unknown field {str(k)[:40]!r}")
        if type(v) not in types:
            raise RequestError(
                f"{k} has the wrong JSON type ({type(v).__name__})", k if k in _NAMED_ON_TYPE_ERROR else None
            )
    if any(type(t) is not int or t < 0 for t in d.get("stop_token_ids", [])):
        raise RequestError("stop_token_ids must be non-negative integers")
    if "logit_bias" in d:
        d = {**d, "logit_bias": logit_bias_from_json(d["logit_bias"])}
    p = SamplingParams(**d)
    p.validate()
    return p
