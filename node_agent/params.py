"""Sampling parameters and the typed request errors, shared by the engine, the API and the router.

Torch-free (an import-linter contract keeps it so): the router validates and forwards requests
without loading a model. A ``RequestError`` carries the request field it is about (``param``), set
where it is raised, and the API answers that field as the error's ``param``: the message text is
for people and may be reworded freely.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

PROMPT = "prompt"  # a RequestError about the prompt: the API names its own field (prompt or messages)

# Seeds torch.Generator.manual_seed takes without overflow (negative ones wrap modulo 2**64).
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1


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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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
}
# The fields a wrong JSON type is answered under (the others keep param null, as before).
_NAMED_ON_TYPE_ERROR = frozenset({"max_tokens", "temperature", "top_k", "top_p", "seed", "stop"})


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
    p = SamplingParams(**d)
    p.validate()
    return p
