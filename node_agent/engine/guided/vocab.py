"""The vocabulary the grammar engine matches against: the tokenizer's tokens, as the engine's
detokenizer turns them into text.

A token the detokenizer drops (a special token: ``decode(skip_special_tokens=True)``) must never be
allowed by a grammar, or the text returned would differ from the bytes the grammar accepted: those
tokens are given empty text, which xgrammar treats as never allowed. The end-of-sequence ids are the
grammar's stop tokens (allowed only once the grammar is complete). Ids past the tokenizer's vocabulary
(a model's padded embedding rows) are never allowed either.
"""

from __future__ import annotations

from collections.abc import Iterable

from pagoda.node_agent.models.tokenizer import Tokenizer


def special_token_ids(hf_tokenizer) -> set[int]:
    """The ids ``decode(skip_special_tokens=True)`` drops from text."""
    ids = set(getattr(hf_tokenizer, "all_special_ids", []) or [])
    for i, tok in getattr(hf_tokenizer, "added_tokens_decoder", {}).items():
        if getattr(tok, "special", False):
            ids.add(int(i))
    return ids


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int, stop_ids: Iterable[int]):
    """xgrammar's TokenizerInfo for ``tokenizer`` over the model's ``vocab_size`` logits."""
    import xgrammar as xgr

    hf = tokenizer._tok
    stops = sorted({int(i) for i in stop_ids if 0 <= int(i) < vocab_size})
    if not stops:
        raise ValueError("the grammar engine needs at least one end-of-sequence id")
    # vocabulary type and prefix-space handling as xgrammar detects them for this tokenizer
    base = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=stops)
    encoded = [""] * vocab_size
    for text, i in hf.get_vocab().items():
        if 0 <= i < vocab_size:
            encoded[i] = text
    for i in special_token_ids(hf):
        if 0 <= i < vocab_size:
            encoded[i] = ""  # never allowed by a grammar (stop ids still end a complete one)
    return xgr.TokenizerInfo(
        encoded,
        base.vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=stops,
        add_prefix_space=base.add_prefix_space,
    )
