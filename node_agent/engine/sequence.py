"""A request's life inside the engine: tokens, sampling parameters, block table and outcome."""

from __future__ import annotations

import enum
import itertools
import math
from dataclasses import dataclass, field

import torch

from pagoda.node_agent.kv.pool import PageRef

_arrival = itertools.count()


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class RequestError(ValueError):
    """A request that cannot be served as asked (bad parameters, too long a prompt)."""


class CapacityError(RuntimeError):
    """The worker cannot take this request now (full); the caller may retry elsewhere or later."""


# Seeds torch.Generator.manual_seed takes without overflow (negative ones wrap modulo 2**64).
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1


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
            raise RequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.seed is not None and (not is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise RequestError(f"seed: must be an integer in [{SEED_MIN}, {SEED_MAX}], got {self.seed!r}")
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise RequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p):
            raise RequestError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k):
            raise RequestError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise RequestError("stop strings must be non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Sequence:
    """One request: prompt and output tokens, KV block table and sampling state."""

    def __init__(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, cache_salt: str = ""
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.cache_salt = cache_salt
        self.status = SeqStatus.WAITING
        self.arrival = next(_arrival)
        self.block_table: list[PageRef] = []
        self.pool_name = ""  # which KV pool holds block_table's pages
        self.page_hashes: list[bytes] = []  # prefix-cache hashes of the sealed (full) pages
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache (first admission)
        self.num_preemptions = 0
        self.prefill_only = False  # stop after the first token and hand the KV to a decode worker
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def needs_prefill(self) -> bool:
        """More than the newest token lacks KV: ingest a chunk before decoding."""
        return self.num_computed_tokens < self.num_tokens - 1

    @property
    def finished(self) -> bool:
        return self.status == SeqStatus.FINISHED

    def finish(self, reason: str, error: str | None = None) -> None:
        """Mark the sequence ended: ``stop``, ``length``, ``abort``, ``error`` or ``prefilled``."""
        self.status = SeqStatus.FINISHED
        self.finish_reason = reason
        if error is not None:
            self.error = error

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, pages={len(self.block_table)})"
        )
