"""``pagoda eval --remote URL --reference URL``: the quality gate between two live servers.

The reference scores the probe set first (``POST /internal/score`` with its texts); the candidate
(``--remote``) is then asked for its logprobs of the reference's tokens and of the reference's
top-k at every position, and for the same greedy continuations; ``pagoda.quality_probe.compare``
gives the figures offline ``pagoda eval`` prints (mean KL, top-1, greedy prefix / identical). With
``--max-kl``, ``--min-top1`` and ``--min-greedy-agreement`` (the operator's defaults unless given)
the exit status is the gate: 0 pass, 1 a threshold failed, 2 a server could not be asked. So an Argo
Rollouts analysis Job (or any pipeline) can gate on it. The internal token comes from the same
flag and environment as ``pagoda serve`` (``--internal-token-file``, ``$PAGODA_INTERNAL_TOKEN_FILE``,
``$PAGODA_INTERNAL_TOKEN``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from pagoda.node_agent.serving.api.internal_auth import InternalAuth, TokenError, load_token
from pagoda.quality_probe import SCORE_PATH, Comparison, ProbeError, ProbeSet, ScoreResponse, compare

DEFAULT_MAX_KL = 0.02
DEFAULT_MIN_TOP1 = 0.9
DEFAULT_MIN_GREEDY = 0.5
DEFAULT_MAX_NEW_TOKENS = 24  # offline pagoda eval's default, so the figures compare


class RemoteError(RuntimeError):
    """A server could not be asked or answered something unusable."""


def score(url: str, auth: InternalAuth, body: dict[str, Any], timeout_s: float) -> ScoreResponse:
    """One signed ``POST /internal/score``; retries a busy pod (503) until ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            r = httpx.post(
                url.rstrip("/") + SCORE_PATH,
                json=body,
                headers=auth.headers("POST", SCORE_PATH),
                timeout=max(deadline - time.monotonic(), 1.0),
            )
        except httpx.HTTPError as exc:
            raise RemoteError(f"{url}: {exc!r}") from exc
        if r.status_code == 503 and time.monotonic() < deadline:
            time.sleep(min(float(r.headers.get("Retry-After") or 2), max(deadline - time.monotonic(), 0)))
            continue
        if r.status_code != 200:
            raise RemoteError(f"{url}: HTTP {r.status_code}: {r.text[:300]}")
        try:
            return ScoreResponse.from_json(r.json())
        except (ValueError, ProbeError) as exc:
            raise RemoteError(f"{url}: {exc}") from exc


def gate(c: Comparison, max_kl: float, min_top1: float, min_greedy: float) -> list[str]:
    """The thresholds ``c`` fails (empty: it passes)."""
    failed = []
    if c.mean_kl > max_kl:
        failed.append(f"mean KL {c.mean_kl:.5f} > {max_kl:g}")
    if c.top1 < min_top1:
        failed.append(f"top-1 {c.top1:.4f} < {min_top1:g}")
    if c.greedy_prefix < min_greedy:
        failed.append(f"greedy agreement {c.greedy_prefix:.3f} < {min_greedy:g}")
    return failed


def short_formats(f: dict[str, str]) -> str:
    keys = ("prefill_weights", "prefill_kv", "decode_weights", "decode_kv")
    return "/".join(f.get(k, "?") for k in keys)


def run_remote(a: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    """Score both servers and compare; (the JSON result, the failed thresholds)."""
    try:
        token = load_token(a.internal_token_file)
    except TokenError as exc:
        raise RemoteError(str(exc)) from exc
    if token is None:
        raise RemoteError(
            "--remote needs the internal token: --internal-token-file FILE, $PAGODA_INTERNAL_TOKEN_FILE "
            "or $PAGODA_INTERNAL_TOKEN"
        )
    auth = InternalAuth(token)
    probes = ProbeSet()
    if a.probe_set:
        try:
            probes = ProbeSet.from_mapping(json.loads(Path(a.probe_set).read_text()))
        except (OSError, ValueError) as exc:
            raise RemoteError(f"--probe-set {a.probe_set}: {exc}") from exc
    probes.max_new_tokens = a.max_new_tokens if a.max_new_tokens is not None else DEFAULT_MAX_NEW_TOKENS
    if a.num_prompts is not None:
        probes.prompts = probes.prompts[: a.num_prompts]
    t0 = time.perf_counter()
    ref = score(a.reference, auth, probes.request(), a.timeout)
    t1 = time.perf_counter()
    cand = score(a.remote, auth, probes.request(ref), a.timeout)
    t2 = time.perf_counter()
    try:
        c = compare(ref, cand)
    except ProbeError as exc:
        raise RemoteError(f"the servers' answers do not compare: {exc}") from exc
    failed = gate(c, a.max_kl, a.min_top1, a.min_greedy_agreement)
    row = {
        "formats": short_formats(cand.formats),
        "phase_formats": cand.formats,
        "mean_kl": c.mean_kl,
        "top1": c.top1,
        "greedy_prefix": c.greedy_prefix,
        "greedy_identical": c.greedy_identical,
        "seconds": t2 - t1,
    }
    result = {
        "bench": "eval",
        "mode": "remote",
        "remote": a.remote,
        "reference": {"url": a.reference, "formats": ref.formats, "seconds": t1 - t0},
        "text_tokens": sum(len(t.token_ids) for t in ref.texts),
        "positions": c.positions,
        "num_prompts": c.prompts,
        "max_new_tokens": probes.max_new_tokens,
        "top_k": probes.top_k,
        "rows": [row],
        "gate": {
            "maxKL": a.max_kl,
            "minTop1": a.min_top1,
            "minGreedyAgreement": a.min_greedy_agreement,
            "passed": not failed,
            "failed": failed,
            "figures": c.to_status(),
        },
    }
    return result, failed


def cmd_eval_remote(a: argparse.Namespace) -> int:
    """Print the comparison like offline ``pagoda eval``; exit 0 pass, 1 fail, 2 error."""
    if not a.reference:
        print("pagoda eval: --remote needs --reference URL", file=sys.stderr)
        return 2
    try:
        result, failed = run_remote(a)
    except RemoteError as exc:
        print(f"pagoda eval: {exc}", file=sys.stderr)
        return 2
    row = result["rows"][0]
    ref = short_formats(result["reference"]["formats"])
    w = max(16, len(row["formats"]) + 2, len(ref) + 2)
    print(f"{'PW/PKV/DW/DKV':<{w}}{'mean KL':>10}{'top-1':>8}{'greedy prefix':>15}{'identical':>11}")
    print(f"{ref + ' (ref)':<{w}}{0.0:>10.5f}{1.0:>8.3f}{1.0:>15.3f}{1.0:>11.3f}")
    print(
        f"{row['formats']:<{w}}{row['mean_kl']:>10.5f}{row['top1']:>8.3f}"
        f"{row['greedy_prefix']:>15.3f}{row['greedy_identical']:>11.3f}"
    )
    print(
        f"{result['positions']} positions, {result['num_prompts']} prompts x {result['max_new_tokens']} tokens"
    )
    print("gate: " + ("passed" if not failed else "FAILED: " + "; ".join(failed)))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2) + "\n")
    return 1 if failed else 0


def add_remote_args(e: argparse.ArgumentParser) -> None:
    """``pagoda eval``'s remote flags."""
    e.add_argument(
        "--remote", default=None, metavar="URL", help="compare this live server (its /internal/score)"
    )
    e.add_argument(
        "--reference", default=None, metavar="URL", help="with --remote: the reference live server"
    )
    e.add_argument(
        "--max-kl",
        type=float,
        default=DEFAULT_MAX_KL,
        help=f"--remote gate: mean KL at most (default {DEFAULT_MAX_KL})",
    )
    e.add_argument(
        "--min-top1",
        type=float,
        default=DEFAULT_MIN_TOP1,
        help=f"--remote gate: top-1 at least ({DEFAULT_MIN_TOP1})",
    )
    e.add_argument(
        "--min-greedy-agreement",
        type=float,
        default=DEFAULT_MIN_GREEDY,
        help=f"--remote gate: greedy prefix agreement at least ({DEFAULT_MIN_GREEDY})",
    )
    e.add_argument(
        "--internal-token-file",
        default=None,
        help="--remote: the internal token's file (else $PAGODA_INTERNAL_TOKEN_FILE or $PAGODA_INTERNAL_TOKEN)",
    )
    e.add_argument(
        "--probe-set", default=None, metavar="FILE", help="--remote: a probes.json (default: built-in)"
    )
    e.add_argument("--timeout", type=float, default=600.0, help="--remote: seconds each server may take")
