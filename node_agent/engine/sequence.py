"""A request's life inside the engine: tokens, sampling parameters, block table and outcome."""

from __future__ import annotations

import enum
import itertools
from typing import TYPE_CHECKING

import torch

from pagoda.node_agent.kv.pool import PageRef
from pagoda.node_agent.params import SamplingParams

if TYPE_CHECKING:
    from pagoda.node_agent.engine.guided.state import GrammarState

_arrival = itertools.count()


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


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
        self.grammar: GrammarState | None = None  # a constrained request's matcher (engine/guided/)
        # logprobs (engine/logprobs.py TokenLogprobs), kept only when the request asked: one per output
        # token (None for a token sampled on another worker), and one per prompt position scored so
        # far (position j scores prompt token j + 1)
        self.logprobs: list = []
        self.prompt_logprobs: list = []
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
