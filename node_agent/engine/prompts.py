"""A client's prompt (text, token ids or chat messages) as validated token ids."""

from __future__ import annotations

from pagoda.node_agent.models.tokenizer import Tokenizer
from pagoda.node_agent.params import PROMPT, RequestError

Prompt = str | list[int] | list[dict]


def prompt_token_ids(tokenizer: Tokenizer, prompt: Prompt, vocab_size: int, chat: bool = False) -> list[int]:
    """Token ids of ``prompt``; raises RequestError on an empty prompt, a bad type or an id out of range.

    ``chat`` wraps a plain string in the chat template as one user turn."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        ids = tokenizer.apply_chat_template(prompt)
    elif isinstance(prompt, list):
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"token ids out of range [0, {vocab_size}): {bad[:5]}", PROMPT)
    elif isinstance(prompt, str):
        if chat:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        else:
            ids = tokenizer.encode(prompt)
    else:
        raise RequestError(
            f"prompt must be a string, token ids or chat messages, got {type(prompt).__name__}", PROMPT
        )
    if not ids or (isinstance(prompt, str) and not prompt):
        raise RequestError("prompt is empty", PROMPT)
    return ids
