"""Admission: whether a request may enter the engine, checked before anything is queued or allocated.

Both entry points ask here: a new prompt (``LLMEngine.add_request``) and a sequence prefilled elsewhere
(``LLMEngine.add_prefilled``). They share one capacity rule: the prompt plus the tokens it may still
generate must fit in the decode pool.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection

from pagoda.node_agent.engine import handoff
from pagoda.node_agent.kv.pool import KVPagePool
from pagoda.node_agent.params import PROMPT, CapacityError, RequestError, SamplingParams, check_logit_bias


def tokens_needed(num_prompt: int, params: SamplingParams, max_model_len: int) -> int:
    """KV tokens a sequence holds at its end: the prompt and every token it may still generate."""
    return num_prompt + min(params.max_tokens, max_model_len - num_prompt)


def check_fits(need: int, pool: KVPagePool, what: str) -> None:
    """The one capacity check: ``need`` tokens fit in ``pool`` (called ``what`` in the error)."""
    if need > pool.capacity_tokens:
        raise RequestError(
            f"prompt + max_tokens ({need} tokens) exceeds the {what} capacity ({pool.capacity_tokens} tokens)",
            PROMPT,
        )


class Admission:
    """The checks a request passes before it is queued: lengths, capacity, free room, its id."""

    def __init__(
        self,
        prefill_pool: KVPagePool,
        decode_pool: KVPagePool,
        max_model_len: int,
        vocab_size: int,
        max_num_seqs: int,
    ) -> None:
        self.prefill_pool = prefill_pool
        self.decode_pool = decode_pool
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_num_seqs = max_num_seqs

    def check_vocab(self, params: SamplingParams) -> None:
        """The parameters' token ids (``logit_bias``) name tokens of this model. Raises RequestError."""
        if params.logit_bias:
            check_logit_bias(params.logit_bias, self.vocab_size)

    def check_prompt(self, ids: list[int], params: SamplingParams, prefill_only: bool = False) -> None:
        """A new prompt of token ``ids``: it fits the model length, the prefill pool and, with its
        new tokens (only the first one for ``prefill_only``), the decode pool. Raises RequestError."""
        self.check_vocab(params)
        n = len(ids)
        if n >= self.max_model_len:
            raise RequestError(
                f"prompt has {n} tokens; the model length is {self.max_model_len} "
                f"(prompt + at least one new token must fit)",
                PROMPT,
            )
        if n + 1 > self.prefill_pool.capacity_tokens:
            raise RequestError(
                f"prompt has {n} tokens; the prefill KV pool holds {self.prefill_pool.capacity_tokens}",
                PROMPT,
            )
        need = n + 1 if prefill_only else tokens_needed(n, params, self.max_model_len)
        check_fits(need, self.decode_pool, "KV cache")

    def check_prefilled(self, payload: handoff.KVPayload, params: SamplingParams, num_running: int) -> int:
        """A handoff payload (validated against the decode pool) that fits and finds room now; returns
        the pages it needs. RequestError for a malformed payload or one too large ever to fit,
        CapacityError when the decode pool lacks free pages or max_num_seqs is reached."""
        self.check_vocab(params)
        pool = self.decode_pool
        num_pages = handoff.check_payload(payload, pool, self.vocab_size, self.max_model_len)
        need = tokens_needed(len(payload.prompt_token_ids), params, self.max_model_len)
        check_fits(need, pool, "decode KV cache")
        if num_running >= self.max_num_seqs:
            raise CapacityError("decode worker is at max_num_seqs; retry later")
        if pool.num_free < num_pages:
            raise CapacityError(
                f"decode KV pool has {pool.num_free} free pages, the handoff needs {num_pages}; retry later"
            )
        return num_pages

    @staticmethod
    def new_id(request_id: str | None, in_flight: Collection[str]) -> str:
        """The request's id (validated, or a fresh one); RequestError when it is already in flight."""
        rid = handoff.check_request_id(request_id) if request_id else uuid.uuid4().hex
        if rid in in_flight:
            raise RequestError(f"request id {rid!r} is already in flight", PROMPT)
        return rid
