"""The quality probe: one contract for scoring a live pod and comparing it with a reference.

An engine pod answers ``POST /internal/score`` (internal auth) with a ``ScoreRequest``'s texts
teacher-forced through exactly the formats it serves, and greedy continuations of its prompts.
A gate (the operator, ``pagoda eval --remote``, a continuous probe) scores the reference first,
then asks the candidate for its logprobs of the reference's top-k tokens at every position
(``targets``), and compares with ``compare``. Pure Python: the operator imports it without torch.

The KL here is over the reference's top-k tokens plus one lumped "rest" bucket; lumping can only
lower KL (it is a coarse-graining), so the figure is a lower bound of the full-vocabulary KL,
close to it when the top-k hold nearly all the mass (k = 20 on the built-in probe set: see
docs/quality-gates.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

SCORE_PATH = "/internal/score"
MAX_TOP_K = 20
MAX_TEXTS = 16
MAX_TEXT_TOKENS = 4096
MAX_PROMPTS = 32
MAX_NEW_TOKENS = 256
REFERENCE_CONFIGMAP_KEY = "reference.json"  # the gate's reference response, in {md}-quality-reference
FLOOR = 1e-12  # probability floor inside logs

PROBE_TEXT = (
    "Every spring the river below the old mill rises with melted snow from the northern hills. "
    "The miller's daughter keeps a notebook of the water level: she marks the stone steps at dawn, "
    "writes the date beside each mark, and compares the pages year after year. In a dry year the "
    "water barely touches the fourth step; in a wet one it floods the yard and the geese swim "
    "where the cart usually stands.\n\n"
    "A sorting algorithm arranges items in order. Insertion sort walks through a list and moves "
    "each element left until the element before it is smaller:\n\n"
    "def insertion_sort(items):\n"
    "    for i in range(1, len(items)):\n"
    "        key = items[i]\n"
    "        j = i - 1\n"
    "        while j >= 0 and items[j] > key:\n"
    "            items[j + 1] = items[j]\n"
    "            j -= 1\n"
    "        items[j + 1] = key\n"
    "    return items\n\n"
    "It takes quadratic time in the worst case but is fast on lists that are almost sorted.\n\n"
    "Question: How many days are there in a leap year?\n"
    "Answer: A leap year has 366 days; February gets a twenty-ninth day.\n\n"
    "The human heart has four chambers: two atria receive blood and two ventricles pump it out. "
    "The right side sends blood to the lungs, where it picks up oxygen; the left side pushes it "
    "through the rest of the body. A resting adult heart beats about sixty to one hundred times a "
    "minute. Tokyo is the capital of Japan, Canberra is the capital of Australia, and Ottawa is "
    "the capital of Canada. El tren sale a las ocho; le train part à huit heures."
)

PROBE_PROMPTS = (
    "What is the capital of Italy?",
    "Give two reasons why people keep cats as pets.",
    "Write one sentence about the ocean at night.",
    "How do plants make their food?",
    "Name three planets of the solar system.",
    "What should I pack for a rainy day hike?",
)


class ProbeError(ValueError):
    """A malformed score request or response (the message says which field)."""


@dataclass
class ProbeSet:
    """What is scored: texts (teacher-forced, raw) and chat prompts (greedy continuations)."""

    texts: list[str] = field(default_factory=lambda: [PROBE_TEXT])
    prompts: list[str] = field(default_factory=lambda: list(PROBE_PROMPTS))
    max_new_tokens: int = 32
    top_k: int = MAX_TOP_K

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> ProbeSet:
        """From a ConfigMap's ``probes.json`` (same keys as the request; absent keys default)."""
        d = cls()
        texts = raw.get("texts", d.texts)
        prompts = raw.get("prompts", d.prompts)
        if not _str_list(texts, MAX_TEXTS) or not texts:
            raise ProbeError(f"texts: a list of 1..{MAX_TEXTS} strings")
        if not _str_list(prompts, MAX_PROMPTS):
            raise ProbeError(f"prompts: a list of at most {MAX_PROMPTS} strings")
        return cls(
            list(texts),
            list(prompts),
            _int(raw.get("max_new_tokens", d.max_new_tokens), "max_new_tokens", 0, MAX_NEW_TOKENS),
            _int(raw.get("top_k", d.top_k), "top_k", 1, MAX_TOP_K),
        )

    def request(self, reference: ScoreResponse | None = None) -> dict[str, Any]:
        """The score request body; against a reference, its token ids and top-k ids as targets."""
        body: dict[str, Any] = {
            "prompts": self.prompts,
            "max_new_tokens": self.max_new_tokens,
            "top_k": self.top_k,
        }
        if reference is None:
            body["texts"] = [{"text": t} for t in self.texts]
        else:
            body["texts"] = [
                {"token_ids": t.token_ids, "targets": [[i for i, _ in pos] for pos in t.top]}
                for t in reference.texts
            ]
        return body


@dataclass
class ScoreRequest:
    """A validated ``/internal/score`` body (the pod checks it before it computes anything)."""

    texts: list[dict[str, Any]]  # {"text": str} or {"token_ids": [int], "targets": [[int]] optional}
    prompts: list[str]
    max_new_tokens: int
    top_k: int

    @classmethod
    def parse(cls, raw: Any, vocab_size: int) -> ScoreRequest:
        if not isinstance(raw, Mapping):
            raise ProbeError("the body must be a JSON object")
        texts = raw.get("texts", [])
        if not isinstance(texts, list) or len(texts) > MAX_TEXTS:
            raise ProbeError(f"texts: a list of at most {MAX_TEXTS} entries")
        prompts = raw.get("prompts", [])
        if not _str_list(prompts, MAX_PROMPTS):
            raise ProbeError(f"prompts: a list of at most {MAX_PROMPTS} strings")
        top_k = _int(raw.get("top_k", MAX_TOP_K), "top_k", 1, MAX_TOP_K)
        out = [_text_entry(t, n, vocab_size, top_k) for n, t in enumerate(texts)]
        return cls(
            out,
            list(prompts),
            _int(raw.get("max_new_tokens", 32), "max_new_tokens", 0, MAX_NEW_TOKENS),
            top_k,
        )


@dataclass
class ScoredText:
    """One teacher-forced text: per position p (predicting token p + 1), the top-k (id, logprob)
    pairs, and the logprobs of the request's targets at p when it named any."""

    token_ids: list[int]
    top: list[list[tuple[int, float]]]
    targets: list[list[float]] | None = None

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "token_ids": self.token_ids,
            "top": [[[i, lp] for i, lp in pos] for pos in self.top],
        }
        if self.targets is not None:
            d["targets"] = self.targets
        return d


@dataclass
class ScoreResponse:
    """What a pod answers: its formats, each text's scores and each prompt's greedy tokens."""

    formats: dict[str, str]
    texts: list[ScoredText]
    greedy: list[list[int]]

    def to_json(self) -> dict[str, Any]:
        return {"formats": self.formats, "texts": [t.to_json() for t in self.texts], "greedy": self.greedy}

    @classmethod
    def from_json(cls, raw: Any) -> ScoreResponse:
        """Parse a peer's answer; anything malformed is a ``ProbeError`` (never a crash)."""
        try:
            texts = []
            for t in raw["texts"]:
                ids = [int(i) for i in t["token_ids"]]
                top = [[(int(i), float(lp)) for i, lp in pos] for pos in t["top"]]
                tg = t.get("targets")
                targets = None if tg is None else [[float(x) for x in pos] for pos in tg]
                if len(top) != max(len(ids) - 1, 0) or (targets is not None and len(targets) != len(top)):
                    raise ProbeError("a text's positions do not match its tokens")
                texts.append(ScoredText(ids, top, targets))
            greedy = [[int(i) for i in g] for g in raw["greedy"]]
            formats = {str(k): str(v) for k, v in dict(raw.get("formats", {})).items()}
        except ProbeError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise ProbeError(f"malformed score response: {e!r}") from None
        return cls(formats, texts, greedy)


@dataclass
class Comparison:
    """A candidate's figures against a reference (the ``pagoda eval`` names)."""

    mean_kl: float
    top1: float
    greedy_prefix: float
    greedy_identical: float
    positions: int
    prompts: int

    def to_status(self) -> dict[str, Any]:
        return {
            "meanKL": round(self.mean_kl, 6),
            "top1": round(self.top1, 4),
            "greedyPrefix": round(self.greedy_prefix, 4),
            "greedyIdentical": round(self.greedy_identical, 4),
            "positions": self.positions,
            "prompts": self.prompts,
        }


def position_kl(ref: Sequence[tuple[int, float]], cand_lps: Sequence[float]) -> float:
    """KL(ref || cand) over the reference's top-k tokens plus the lumped rest of the vocabulary."""
    if len(ref) != len(cand_lps):
        raise ProbeError("a position's targets do not match the reference's top-k")
    p = [math.exp(lp) for _, lp in ref]
    q = [math.exp(lp) for lp in cand_lps]
    kl = sum(pi * (math.log(max(pi, FLOOR)) - math.log(max(qi, FLOOR))) for pi, qi in zip(p, q, strict=True))
    p_rest, q_rest = max(1.0 - sum(p), 0.0), max(1.0 - sum(q), 0.0)
    if p_rest > FLOOR:
        kl += p_rest * (math.log(p_rest) - math.log(max(q_rest, FLOOR)))
    return max(kl, 0.0)


def greedy_agreement(ref: Sequence[Sequence[int]], cand: Sequence[Sequence[int]]) -> tuple[float, float]:
    """(mean identical-prefix fraction, fraction of fully identical continuations)."""
    if len(ref) != len(cand):
        raise ProbeError("the candidate answered a different number of prompts")
    if not ref:
        return 1.0, 1.0
    fracs, same = [], 0
    for a, b in zip(ref, cand, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        fracs.append(n / max(len(a), 1))
        same += list(a) == list(b)
    return sum(fracs) / len(fracs), same / len(ref)


def compare(reference: ScoreResponse, candidate: ScoreResponse) -> Comparison:
    """Figures of a candidate that was asked with ``ProbeSet.request(reference)``."""
    if len(reference.texts) != len(candidate.texts):
        raise ProbeError("the candidate answered a different number of texts")
    kls, hits = [], 0
    for r, c in zip(reference.texts, candidate.texts, strict=True):
        if c.token_ids != r.token_ids or c.targets is None or len(c.top) != len(r.top):
            raise ProbeError("the candidate did not score the reference's tokens")
        for rpos, cpos, lps in zip(r.top, c.top, c.targets, strict=True):
            kls.append(position_kl(rpos, lps))
            hits += bool(rpos and cpos and rpos[0][0] == cpos[0][0])
    gp, gi = greedy_agreement(reference.greedy, candidate.greedy)
    n = max(len(kls), 1)
    return Comparison(sum(kls) / n, hits / n, gp, gi, len(kls), len(reference.greedy))


def _str_list(v: Any, most: int) -> bool:
    return isinstance(v, list) and len(v) <= most and all(isinstance(s, str) and s for s in v)


def _int(v: Any, name: str, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ProbeError(f"{name}: an integer in {lo}..{hi}")
    return v


def _text_entry(t: Any, n: int, vocab_size: int, top_k: int) -> dict[str, Any]:
    where = f"texts[{n}]"
    if not isinstance(t, Mapping):
        raise ProbeError(f"{where}: an object with text or token_ids")
    if "text" in t:
        if not isinstance(t["text"], str) or not t["text"]:
            raise ProbeError(f"{where}.text: a non-empty string")
        return {"text": t["text"]}
    ids = t.get("token_ids")
    if not isinstance(ids, list) or not 2 <= len(ids) <= MAX_TEXT_TOKENS:
        raise ProbeError(f"{where}.token_ids: a list of 2..{MAX_TEXT_TOKENS} token ids")
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in ids):
        raise ProbeError(f"{where}.token_ids: ids in 0..{vocab_size - 1}")
    out: dict[str, Any] = {"token_ids": list(ids)}
    targets = t.get("targets")
    if targets is not None:
        ok = isinstance(targets, list) and len(targets) == len(ids) - 1
        ok = ok and all(isinstance(p, list) and 1 <= len(p) <= top_k for p in targets)
        ok = ok and all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for p in targets for i in p
        )
        if not ok:
            raise ProbeError(f"{where}.targets: one list of 1..{top_k} token ids per position but the last")
        out["targets"] = [list(p) for p in targets]
    return out
