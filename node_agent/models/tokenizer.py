"""Tokenizer and chat template from the model files, with incremental detokenization."""

from __future__ import annotations

import logging
import os

log = logging.getLogger("pagoda.tokenizer")


class Tokenizer:
    """Wraps the model's own tokenizer (tokenizer.json or the GGUF vocabulary)."""

    def __init__(self, model_dir: str, gguf_file: str | None = None) -> None:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        if gguf_file:
            from pagoda.node_agent.models.gguf_names import gguf_tokenizer

            self._tok = gguf_tokenizer(model_dir, gguf_file)
        else:
            self._tok = AutoTokenizer.from_pretrained(model_dir)
        self.eos_token_id: int | None = self._tok.eos_token_id
        self.vocab_size = len(self._tok)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=True))

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Render chat messages with the model's template, ready for the assistant's turn."""
        if not self.has_chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        text = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


class Detokenizer:
    """Turns a growing list of token ids into text, holding back incomplete UTF-8 sequences."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tok = tokenizer
        self.text = ""

    def update(self, ids: list[int]) -> str:
        """Full text of ``ids`` so far (only complete characters)."""
        text = self.tok.decode(ids)
        if text.endswith("\ufffd"):
            return self.text  # a multi-byte character is still incomplete
        self.text = text
        return text
