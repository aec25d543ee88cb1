"""A tiktoken-based tokenizer laid out as Kimi-K2 ships its own: custom code next to the weights,
named by ``auto_map`` in tokenizer_config.json, reading byte-pair ranks from ``tiktoken.model``
(one ``base64(token bytes) rank`` per line). transformers imports this file only when the caller
passes ``trust_remote_code=True``. Written for the tests (a tiny vocabulary), not Kimi's own file.

Ordinary text is split by ``PATTERN`` and merged by tiktoken; the special tokens (listed in
``added_tokens_decoder`` with ids after the ranks) are cut out by transformers before that. Tokens
are spelled as strings through the GPT-2 byte-to-character table, so every byte sequence has a name.
"""

from __future__ import annotations

import os
from shutil import copyfile

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from transformers import PreTrainedTokenizer

# letters with an optional leading mark, 1-3 digits, punctuation runs, line breaks, other spaces
PATTERN = r"""[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


def _byte_names() -> dict[int, str]:
    """Each byte's printable stand-in (printable Latin-1 bytes stand for themselves)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    names, extra = {}, 0
    for b in range(256):
        if b in keep:
            names[b] = chr(b)
        else:
            names[b] = chr(256 + extra)
            extra += 1
    return names


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "tiktoken.model"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file: str, **kwargs) -> None:
        self.vocab_file = vocab_file
        ranks = load_tiktoken_bpe(vocab_file)
        self.model = tiktoken.Encoding(
            name=os.path.basename(vocab_file), pat_str=PATTERN, mergeable_ranks=ranks, special_tokens={}
        )
        names = _byte_names()
        self._unnames = {c: b for b, c in names.items()}
        self.decoder = {i: "".join(names[b] for b in t) for t, i in ranks.items()}
        self.encoder = {s: i for i, s in self.decoder.items()}
        super().__init__(**kwargs)

    @property
    def vocab_size(self) -> int:
        return len(self.encoder)

    def get_vocab(self) -> dict[str, int]:
        return {**self.encoder, **self.added_tokens_encoder}

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        return [self.decoder[i] for i in self.model.encode_ordinary(text)]

    def _convert_token_to_id(self, token: str) -> int:
        return self.encoder[token]

    def _convert_id_to_token(self, index: int) -> str:
        return self.decoder[index]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        raw = bytes(self._unnames[c] for c in "".join(tokens))
        return raw.decode("utf-8", errors="replace")

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str]:
        out = os.path.join(save_directory, (filename_prefix or "") + "tiktoken.model")
        if os.path.abspath(out) != os.path.abspath(self.vocab_file):
            copyfile(self.vocab_file, out)
        return (out,)
