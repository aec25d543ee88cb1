"""A client's prompt (text, token ids or chat messages) as validated token ids."""

from __future__ import annotations

from pagoda.node_agent.models.tokenizer import Tokenizer
from pagoda.node_agent.params import PROMPT, RequestError

Prompt = str | list[int] | list[dict] | dict  # dict: {"messages": [...], "tools": [...]}


def prompt_token_ids(tokenizer: Tokenizer, prompt: Prompt, vocab_size: int, chat: bool = False) -> list[int]:
    """Token ids of ``prompt``; raises RequestError on an empty prompt, a bad type or an id out of range.

    ``chat`` wraps a plain string in the chat template as one user turn; a dict holds chat
    ``messages`` and the ``tools`` the template describes to the model."""
    if isinstance(prompt, dict):
        messages, tools = prompt.get("messages"), prompt.get("tools")
        if not isinstance(messages, list) or not messages or not isinstance(tools, list | None):
            raise RequestError("a chat prompt holds a non-empty messages list and a tools list", PROMPT)
        ids = render(tokenizer, messages, tools or None)
    elif isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        ids = render(tokenizer, prompt, None)
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


def render(tokenizer: Tokenizer, messages: list[dict], tools: list[dict] | None) -> list[int]:
    """Chat messages (and tools) through the model's template; a template that refuses the
    conversation (an unsupported role, a bad turn order) is the client's error, not a 500."""
    try:
        return tokenizer.apply_chat_template(messages, tools=tools)
    except RequestError:
        raise
    except Exception as exc:  # jinja2's TemplateError, raise_exception() in the template, KeyError...
        raise RequestError(f"the chat template cannot render these messages: {exc}"[:500], PROMPT) from exc
