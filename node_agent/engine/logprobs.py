"""Logprobs gathered in the batch: the chosen token's log-probability and the top N of each row.

A step's rows that asked for logprobs are gathered in one batched op (one ``gather`` for the chosen
tokens, one ``topk`` with the largest N asked) and brought to the host in one copy; the same holds
for the prompt rows of a prefill step (prompt logprobs, see docs/logprobs.md). Tokens a row cannot
produce (log-probability -inf: cut by top-k/top-p or masked) are never listed among the top N.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda.node_agent.engine.sequence import Sequence


@dataclass(frozen=True)
class TokenLogprobs:
    """One position: the token that came (sampled, or the prompt's next token), its log-probability
    and the ``top`` alternatives as (token id, log-probability), most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def gather(
    logprobs: torch.Tensor, chosen: torch.Tensor, n_top: list[int], extra: torch.Tensor | None = None
) -> tuple[list[TokenLogprobs], list[int]]:
    """Entries for each row of ``logprobs`` [R, V]: ``chosen`` [R] token ids, ``n_top[r]`` alternatives.

    ``extra`` (token ids, 1-D, on the same device) rides along in the same device->host copy and
    comes back as a list (the sampler's tokens)."""
    r, k = logprobs.shape[0], min(max(n_top, default=0), logprobs.shape[-1])
    chosen = chosen.view(-1).to(logprobs.device)
    parts = [extra.double()] if extra is not None else []
    if r:
        parts += [chosen.double(), logprobs.gather(1, chosen.view(-1, 1)).reshape(-1).double()]
        if k:
            vals, idx = torch.topk(logprobs, k, dim=-1)
            parts += [vals.reshape(-1).double(), idx.reshape(-1).double()]  # ids < 2**53: exact
    host = torch.cat(parts).tolist() if parts else []  # the one device->host copy
    head = len(extra) if extra is not None else 0
    tokens, rest = [int(t) for t in host[:head]], host[head:]
    ids, lps = rest[:r], rest[r : 2 * r]
    vals_all, idx_all = rest[2 * r : 2 * r + r * k], rest[2 * r + r * k :]
    out = []
    for i in range(r):
        pairs = zip(idx_all[i * k : (i + 1) * k], vals_all[i * k : (i + 1) * k], strict=True)
        top = tuple((int(t), v) for t, v in pairs if v != float("-inf"))
        out.append(TokenLogprobs(int(ids[i]), lps[i], top[: n_top[i]]))
    return out, tokens


def prompt_spans(seq: Sequence, start: int, n: int) -> tuple[int, int]:
    """Prompt positions [lo, hi) of a chunk ``start``..``start + n`` whose logits score the next prompt
    token (position j scores token j + 1) and are not scored yet; empty unless the request asked."""
    if seq.params.prompt_logprobs is None:
        return 0, 0
    lo = max(start, len(seq.prompt_logprobs))
    hi = min(start + n, len(seq.prompt_token_ids) - 1)
    return lo, max(lo, hi)


def score_prompts(
    logits: torch.Tensor, spans: list[tuple[Sequence, int, int]]
) -> dict[Sequence, list[TokenLogprobs]]:
    """Prompt logprobs (log_softmax of the raw logits, temperature 1) for ``spans``: ``logits`` holds
    their rows in order, one per position of each (seq, lo, hi)."""
    nxt = torch.tensor([t for s, lo, hi in spans for t in s.prompt_token_ids[lo + 1 : hi + 1]])
    n_top = [s.params.prompt_logprobs for s, lo, hi in spans for _ in range(hi - lo)]
    entries, _ = gather(torch.log_softmax(logits.float(), dim=-1), nxt, n_top)
    out: dict[Sequence, list[TokenLogprobs]] = {}
    at = 0
    for s, lo, hi in spans:
        out[s] = entries[at : at + hi - lo]
        at += hi - lo
    return out


def token_pieces(decode, ids: list[int]) -> list[str]:
    """The text each token adds when ``ids`` are decoded in order (``decode``: ids -> str), with a few
    tokens of context so a leading space or a character split over tokens lands where it belongs: a
    token that leaves a character incomplete gets "" and the token completing it the character."""
    pieces: list[str] = []
    prefix = read = 0
    for k in range(len(ids)):
        head = decode(ids[prefix:read])
        full = decode(ids[prefix : k + 1])
        if full.endswith("\ufffd") and k - read < 3:  # a UTF-8 character spans at most 4 tokens
            pieces.append("")
            continue
        pieces.append(full[len(head) :] if full.startswith(head) else full)
        prefix, read = read, k + 1
    return pieces
