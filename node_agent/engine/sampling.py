"""Token selection: greedy, temperature, top-k, top-p, with per-request seeded generators, and the
logprobs of the distribution each token was drawn from, batched over the step's rows.

A seeded request's generator is a CPU ``torch.Generator`` whatever the compute device (sequence.py):
its state (``get_state()``, a uint8 tensor) has one size on every worker, so a handoff carries it
between CPU and GPU workers alike; the probabilities of a seeded draw move to the CPU for it.

Logprobs (``SamplingParams.logprobs``) are of the distribution actually sampled from: a greedy row
(temperature 0) reports the log_softmax of its logits at temperature 1; a sampling row reports the
log of the probabilities it drew from, after temperature, top-k and top-p (renormalized; tokens cut
away are -inf and never listed). See docs/logprobs.md.

Before any of that, a constrained row keeps only its grammar's tokens, then a request's
``logit_bias`` is added to its logits (OpenAI's semantics: -100 bans a token, +100 all but forces
it), so logprobs and greedy choices are of the biased logits.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pagoda.node_agent.engine.guided.masking import apply_grammar_masks
from pagoda.node_agent.engine.logprobs import TokenLogprobs, gather
from pagoda.node_agent.engine.sequence import Sequence
from pagoda.node_agent.params import LOGIT_BIAS_MAX, SamplingParams

# Below this, float32 logits / temperature overflow (a subnormal temperature even rounds to 0);
# every temperature this small picks the top token anyway, so it is used in their place.
MIN_TEMPERATURE = 1e-30


class StepSamples(dict):
    """A step's sampled token per sequence (a dict Sequence -> token id, as before logprobs), with
    ``logprobs`` (Sequence -> TokenLogprobs, for those that asked) and ``prompt_logprobs`` (Sequence
    -> the entries of the prompt positions scored in this step, also for a prefill chunk that
    samples nothing) beside it. ``update`` merges all three (a step re-run in parts)."""

    def __init__(self, tokens=(), logprobs=None, prompt_logprobs=None) -> None:
        super().__init__(tokens)
        self.logprobs: dict[Sequence, TokenLogprobs] = dict(logprobs or {})
        self.prompt_logprobs: dict[Sequence, list[TokenLogprobs]] = dict(prompt_logprobs or {})

    def update(self, other=(), **kw) -> None:
        super().update(other, **kw)
        if isinstance(other, StepSamples):
            self.logprobs.update(other.logprobs)
            self.prompt_logprobs.update(other.prompt_logprobs)


class Sampled(NamedTuple):
    """One step's picks: a token per row, and per row its logprobs (None where not asked)."""

    tokens: list[int]
    logprobs: list[TokenLogprobs | None]


def processed_logprobs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Log-probabilities [R, V] of the distribution each row samples from (float32 ``logits`` [R, V]):
    temperature, then top-k, then top-p, renormalized; a greedy row gets temperature 1 and no cut."""
    dev, vocab = logits.device, logits.shape[-1]
    temps = [1.0 if p.greedy else max(p.temperature, MIN_TEMPERATURE) for p in params]
    x = logits - logits.max(dim=-1, keepdim=True).values  # <= 0: no +inf, so no NaN, at any temperature
    x = x / torch.tensor(temps, device=dev).view(-1, 1)
    ks = [p.top_k if not p.greedy and 0 < p.top_k < vocab else 0 for p in params]
    if any(ks):
        kth = torch.topk(x, max(ks), dim=-1).values.gather(
            1, (torch.tensor(ks, device=dev) - 1).clamp(0)[:, None]
        )
        cut = (x < kth) & (torch.tensor(ks, device=dev) > 0)[:, None]
        x = x.masked_fill(cut, float("-inf"))
    lp = torch.log_softmax(x, dim=-1)
    top_ps = [1.0 if p.greedy else p.top_p for p in params]
    if any(t < 1.0 for t in top_ps):
        sorted_lp, idx = torch.sort(lp, dim=-1, descending=True)
        sorted_p = sorted_lp.exp()
        drop = torch.cumsum(sorted_p, dim=-1) - sorted_p > torch.tensor(top_ps, device=dev)[:, None]
        lp = torch.empty_like(lp).scatter_(1, idx, sorted_lp.masked_fill(drop, float("-inf")))
        lp = lp - torch.logsumexp(lp, dim=-1, keepdim=True)  # the kept set, renormalized
    return lp


def _draw(lp: torch.Tensor, rows: list[int], seqs: list[Sequence], chosen: torch.Tensor) -> None:
    """Draw the sampling rows' tokens from ``lp`` (the processed rows ``rows`` of the step) into
    ``chosen``: one batched draw for the unseeded rows, each seeded row on its own CPU generator."""
    free = [j for j, i in enumerate(rows) if not seqs[i].params.greedy and seqs[i].generator is None]
    if free:
        drawn = torch.multinomial(lp[free].exp(), 1).view(-1)
        chosen[torch.tensor([rows[j] for j in free], device=chosen.device)] = drawn
    for j, i in enumerate(rows):
        gen = seqs[i].generator
        if seqs[i].params.greedy or gen is None:
            continue
        probs = lp[j].exp()
        if gen.device != probs.device:
            probs = probs.to(gen.device)  # seeded draws use the sequence's CPU generator on every device
        chosen[i] = int(torch.multinomial(probs, 1, generator=gen).item())


def apply_logit_bias(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Add each biased row's ``logit_bias`` to its logits in place (-100 bans a token: -inf), in one
    scatter over the biased entries only. A constrained row the bias would leave with no token to
    sample (its grammar allows only banned ones) keeps its logits unbiased: the constraint is kept,
    the bias cannot be. An unconstrained row (finite logits) can only be emptied by a ban of its
    whole vocabulary (a tiny model's), and is guarded the same way."""
    rows = [i for i, s in enumerate(seqs) if s.params.logit_bias]
    if not rows:
        return
    at, cols, vals = [], [], []
    for i in rows:
        for tok, v in seqs[i].params.logit_bias.items():
            at.append(i)
            cols.append(tok)
            vals.append(float("-inf") if v <= -LOGIT_BIAS_MAX else float(v))
    dev = logits.device
    vocab = logits.shape[-1]
    guarded = [i for i in rows if seqs[i].grammar is not None or len(seqs[i].params.logit_bias) >= vocab]
    with torch.inference_mode():  # the model's logits are inference tensors
        saved = logits[guarded].clone() if guarded else None
        idx = (torch.tensor(at, device=dev), torch.tensor(cols, device=dev))
        logits.index_put_(idx, torch.tensor(vals, dtype=logits.dtype, device=dev), accumulate=True)
        if guarded:
            g = torch.tensor(guarded, device=dev)
            dead = ~torch.isfinite(logits[g]).any(dim=-1)
            if bool(dead.any()):
                logits[g[dead]] = saved[dead]


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> Sampled:
    """Pick one token per row of ``logits`` [B, V] following each sequence's parameters, with the
    logprobs of the rows whose request asked (one device->host copy for tokens and logprobs)."""
    logits = logits.float()
    apply_grammar_masks(logits, seqs)  # a constrained row keeps only the tokens its grammar allows
    apply_logit_bias(logits, seqs)  # then each request's own biases
    chosen = logits.argmax(dim=-1)
    rows = [i for i, s in enumerate(seqs) if not s.params.greedy or s.params.logprobs is not None]
    if not rows:
        return Sampled(chosen.tolist(), [None] * len(seqs))
    at = torch.tensor(rows, device=logits.device)
    lp = processed_logprobs(logits[at], [seqs[i].params for i in rows])
    _draw(lp, rows, seqs, chosen)
    asked = [j for j, i in enumerate(rows) if seqs[i].params.logprobs is not None]
    sel = torch.tensor(asked, dtype=torch.long, device=lp.device)
    n_top = [seqs[rows[j]].params.logprobs for j in asked]
    entries, tokens = gather(lp[sel], chosen[at[sel]], n_top, extra=chosen)
    out: list[TokenLogprobs | None] = [None] * len(seqs)
    for j, e in zip(asked, entries, strict=True):
        out[rows[j]] = e
    return Sampled(tokens, out)
