"""The byte-length limit on a prompt, checked before it is tokenized.

Tokenizing costs time in proportion to the text, so a prompt far longer than the model could ever
take is refused by its size alone: the UTF-8 bytes of its text (a string, or every string of chat
messages and tools; token ids are counted by the token-count check instead). The worker's default
is the model length times ``BYTES_PER_TOKEN`` (text averages 3-5 bytes a token; a prompt under the
limit may still be too long in tokens, which the token-count check, off the engine loop, answers).
"""

from __future__ import annotations

from typing import Any

from pagoda.node_agent.serving.api.errors import ApiError

BYTES_PER_TOKEN = 16


def default_prompt_bytes(max_model_len: int) -> int:
    """The byte limit for a model of ``max_model_len`` tokens."""
    return max(1, max_model_len) * BYTES_PER_TOKEN


def text_bytes(x: Any, stop_at: int | None = None) -> int:
    """UTF-8 bytes of every string in ``x`` (strings, lists, dicts' values; keys too short to matter
    are skipped), counting stopped soon after ``stop_at``."""
    total = 0
    todo = [x]
    while todo:
        item = todo.pop()
        if isinstance(item, str):
            total += len(item) if item.isascii() else len(item.encode("utf-8", "surrogatepass"))
            if stop_at is not None and total > stop_at:
                return total
        elif isinstance(item, dict):
            todo.extend(item.values())
        elif isinstance(item, list | tuple):
            if item and isinstance(item[0], int) and not isinstance(item[0], bool):
                continue  # token ids
            todo.extend(item)
    return total


def too_large(size: int, limit: int, param: str) -> str:
    return (
        f"{param}: the prompt text is {'over ' if size > limit else ''}{size} bytes; this server takes "
        f"at most {limit} bytes of prompt (checked before tokenizing)"
    )


def check_prompt_bytes(prompt: Any, limit: int | None, param: str) -> None:
    """413 ``prompt_too_large`` naming ``param`` when the prompt's text exceeds ``limit`` bytes."""
    if limit is None:
        return
    size = text_bytes(prompt, limit)
    if size > limit:
        raise ApiError(413, too_large(size, limit, param), param=param, code="prompt_too_large")
