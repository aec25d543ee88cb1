"""Tokenizer and chat template from the model files, with incremental detokenization."""

from __future__ import annotations

import copy
import logging
import os

log = logging.getLogger("pagoda.tokenizer")


class Tokenizer:
    """Wraps the model's own tokenizer (tokenizer.json or the GGUF vocabulary)."""

    def __init__(self, model_dir: str, gguf_file: str | None = None, trust_remote_code: bool = False) -> None:
        """``trust_remote_code``: a directory whose tokenizer is custom code (models/tokenizer_code.py)
        may run it; without it such a tokenizer is refused, naming --trust-remote-code."""
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        from transformers.utils import logging as hf_logging

        from pagoda.node_agent.models.tokenizer_code import load_dir_tokenizer

        hf_logging.set_verbosity_error()
        if gguf_file:
            from pagoda.node_agent.models.gguf_names import gguf_tokenizer

            self._tok = gguf_tokenizer(model_dir, gguf_file)
        else:
            self._tok = load_dir_tokenizer(model_dir, trust_remote_code)
        self.eos_token_id: int | None = self._tok.eos_token_id
        self.vocab_size = len(self._tok)
        self.template_override: str | None = None  # --chat-template: used instead of the model's

    def with_chat_template(self, template: str) -> Tokenizer:
        """This tokenizer rendering chats with ``template`` (a Jinja chat template) instead of the
        model's own; the original is left as it is (engines may share one tokenizer)."""
        other = copy.copy(self)
        other.template_override = template
        return other

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=True))

    @property
    def chat_template(self) -> str | None:
        if self.template_override is not None:
            return self.template_override
        template = getattr(self._tok, "chat_template", None)
        return template if isinstance(template, str) else None

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """Chat messages (and tools, for templates that take them) as the prompt text, ready for
        the assistant's turn."""
        if not self.has_chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        return self._tok.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=True,
            tokenize=False,
            chat_template=self.template_override,
        )

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Render chat messages with the model's template, ready for the assistant's turn."""
        text = self.render_chat(messages, tools)
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's own text, special tokens spelled out (cached: logprobs list many per step)."""
        cache = self.__dict__.setdefault("_token_texts", {})
        text = cache.get(token_id)
        if text is None:
            text = cache[token_id] = self._tok.decode([token_id], skip_special_tokens=False)
        return text


class Detokenizer:
    """Turns a growing list of token ids into text, holding back incomplete UTF-8 sequences."""

    def __init__(
        self, tokenizer: Tokenizer, skip_special: bool = True, hidden: frozenset[int] = frozenset()
    ) -> None:
        """``skip_special`` False keeps special tokens in the text (a tool-call parser reads its
        family's markers from it), all but a last token in ``hidden`` (the stop token)."""
        self.tok = tokenizer
        self.skip_special, self.hidden = skip_special, hidden
        self.text = ""
        self._seen = 0  # len(ids) of the last update: ids only grow, so the same length is the same text

    def update(self, ids: list[int]) -> str:
        """Full text of ``ids`` so far (only complete characters)."""
        if len(ids) == self._seen:
            return self.text
        self._seen = len(ids)
        if not self.skip_special and ids and ids[-1] in self.hidden:
            ids = ids[:-1]
        text = self.tok.decode(ids, self.skip_special)
        if text.endswith("\ufffd"):
            return self.text  # a multi-byte character is still incomplete
        self.text = text
        return text
