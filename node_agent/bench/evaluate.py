"""Quality evaluation (``pagoda eval``): decode weight/KV formats against the float32 reference.

Every format entry is ``DECODE_WEIGHTS/DECODE_KV`` (prefill stays dense) or a full ``PW/PKV/DW/DKV``.
Each is compared with the reference (float32 dense weights, float32 KV) on the same tokens:

* ``mean_kl``: mean over positions of KL(reference || format) of the next-token distributions of
  ``EVAL_TEXT``, scored through the decode weights and the decode KV pool (``engine.score``);
* ``top1``: fraction of positions whose most likely next token is the reference's;
* ``ppl``: perplexity of ``EVAL_TEXT`` under the format (the reference's is reported beside it);
* ``greedy_prefix``: mean fraction of the ``max_new_tokens`` greedy tokens generated identically
  before the first divergence, over ``EVAL_PROMPTS`` (chat template); ``greedy_identical``: the
  fraction of prompts whose greedy continuation is fully identical;
* ``vs_baseline``: the same KL / top-1 / greedy figures against a baseline entry's run instead of
  the float32 reference (default ``bf16/bf16``: FP8 KV judged against bf16 KV);
* ``kv_bytes_per_token``: bytes one token costs in the decode KV pool per layer (values plus
  per-token FP8 scales; static scales and page tags excluded).

Entries with FP8 KV run once per ``kv_granularities`` entry (FP8 KV scale granularity), named
``ENTRY[granularity]``.
"""

from __future__ import annotations

import gc
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from pagoda.node_agent.bench.common import EngineFactory, Log, echo, engine_factory, set_threads
from pagoda.node_agent.engine.config import EngineConfig, PhaseFormats
from pagoda.node_agent.kv.pool import TAG_BYTES
from pagoda.quality_probe import PROBE_PROMPTS, PROBE_TEXT, greedy_agreement

EVAL_TEXT = PROBE_TEXT  # the built-in probe set, shared with the quality gate
EVAL_PROMPTS = list(PROBE_PROMPTS)

DEFAULT_FORMATS = "bf16/bf16,bf16/fp8,bf16/int8,int4/bf16,int4/fp8,int4/int8,fp8/bf16"


@dataclass
class EvalRow:
    """Quality of one format set against the reference."""

    formats: str
    phase_formats: dict
    mean_kl: float
    top1: float
    ppl: float
    greedy_prefix: float
    greedy_identical: float
    seconds: float
    kv_scale_granularity: str | None = None
    kv_bytes_per_token: float = 0.0
    vs_baseline: dict | None = None


def kl_top1(ref_logits: torch.Tensor, logits: torch.Tensor) -> tuple[float, float]:
    """(mean KL(ref || other) over positions, top-1 agreement) of two [T, V] logit sets."""
    lp_ref = F.log_softmax(ref_logits.double(), dim=-1)
    lp = F.log_softmax(logits.double(), dim=-1)
    kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1).clamp(min=0.0)
    top1 = (ref_logits.argmax(-1) == logits.argmax(-1)).double().mean()
    return float(kl.mean()), float(top1)


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    """exp(mean NLL) of ids[1:] under the logits predicted at ids[:-1]."""
    target = torch.tensor(ids[1:], dtype=torch.long)
    nll = F.cross_entropy(logits[:-1].double(), target)
    return math.exp(float(nll))


def greedy_tokens(engine, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations of chat prompts, batched, a fixed length (EOS ignored)."""
    from pagoda.node_agent.params import SamplingParams

    params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params, chat=True) for p in prompts]
    final = engine.run_until_done()
    return [final[i].token_ids for i in ids]


def kv_bytes_per_token(engine) -> float:
    """Bytes per token and layer of the engine's decode KV pool (values and per-token scales)."""
    pool = engine.decode_pool
    per_page = pool.bytes_per_page(
        pool.num_layers, pool.page_size, pool.components, pool.dtype, pool.token_scaled
    )
    return (per_page - TAG_BYTES) / (pool.page_size * pool.num_layers)


def expand_entries(entries: list[str], kv_granularities: list[str] | None) -> list[tuple[str, str | None]]:
    """(row name, FP8 KV scale granularity or None for the engine's) per run: FP8 KV entries once
    per granularity."""
    out: list[tuple[str, str | None]] = []
    for e in entries:
        if kv_granularities and "fp8_e4m3" in PhaseFormats.parse(e).as_dict().values():
            out += [(f"{e}[{g}]", g) for g in kv_granularities]
        else:
            out.append((e, None))
    return out


def run_eval(
    make_engine: EngineFactory,
    entries: list[str],
    dtype: str = "auto",
    kv_memory: int = 64 << 20,
    max_new_tokens: int = 24,
    text: str = EVAL_TEXT,
    prompts: list[str] | None = None,
    log: Log = echo,
    max_text_tokens: int | None = None,
    baseline: str | None = "bf16/bf16",
    kv_granularities: list[str] | None = None,
) -> dict:
    """Score every entry against the float32 reference (and the ``baseline`` entry's run, when
    given); returns the JSON-ready result."""
    prompts = EVAL_PROMPTS if prompts is None else prompts
    t0 = time.perf_counter()
    ref = make_engine(
        dtype="float32", formats=PhaseFormats.reference(), kv_memory=kv_memory, decode_lm_head="dense"
    )
    ids = ref.tokenize(text)[:max_text_tokens]
    ref_logits = ref.score(ids, phase="decode")
    ref_greedy = greedy_tokens(ref, prompts, max_new_tokens)
    ref_ppl = perplexity(ref_logits, ids)
    ref.close()  # a tensor-parallel replica's ranks stop before the next one starts
    del ref
    log(f"reference (float32 weights + KV): ppl {ref_ppl:.3f} on {len(ids)} tokens")

    def run_one(entry: str, granularity: str | None) -> tuple[torch.Tensor, list[list[int]], float]:
        kw = {"kv_scale_granularity": granularity} if granularity else {}
        eng = make_engine(dtype=dtype, formats=PhaseFormats.parse(entry), kv_memory=kv_memory, **kw)
        try:
            return (
                eng.score(ids, phase="decode"),
                greedy_tokens(eng, prompts, max_new_tokens),
                kv_bytes_per_token(eng),
            )
        finally:
            eng.close()
            del eng
            gc.collect()

    runs = expand_entries(entries, kv_granularities)
    base = run_one(baseline, None) if baseline is not None else None  # first: every row compares to it
    rows: list[EvalRow] = []
    for name, granularity in runs:
        t1 = time.perf_counter()
        entry = name.split("[")[0]
        logits, greedy, kv_bytes = base if name == baseline else run_one(entry, granularity)
        kl, top1 = kl_top1(ref_logits, logits)
        gp, gi = greedy_agreement(ref_greedy, greedy)
        row = EvalRow(
            name,
            PhaseFormats.parse(entry).as_dict(),
            kl,
            top1,
            perplexity(logits, ids),
            gp,
            gi,
            time.perf_counter() - t1,
            granularity,
            kv_bytes,
        )
        if base is not None:
            bkl, btop1 = kl_top1(base[0], logits)
            bgp, bgi = greedy_agreement(base[1], greedy)
            row.vs_baseline = {"mean_kl": bkl, "top1": btop1, "greedy_prefix": bgp, "greedy_identical": bgi}
        rows.append(row)
        log(f"{name}: KL {kl:.5f} top-1 {top1:.4f} ({row.seconds:.0f} s)")
    return {
        "bench": "eval",
        "baseline": baseline,
        "reference": {"weights": "float32", "kv": "float32", "ppl": ref_ppl},
        "dtype": dtype,
        "text_tokens": len(ids),
        "num_prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "rows": [asdict(r) for r in rows],
        "seconds": time.perf_counter() - t0,
    }


def format_table(result: dict) -> str:
    """The printed table (the last columns against the baseline run, when there is one)."""
    w = max([14, *(len(r["formats"]) + 2 for r in result["rows"])])
    base = result.get("baseline")
    head = f"{'decode W/KV':<{w}}{'mean KL':>10}{'top-1':>8}{'ppl':>9}{'greedy prefix':>15}{'identical':>11}"
    head += f"{'KV B/tok':>10}"
    if base:
        head += f"{'KL vs ' + base:>18}{'top-1 vs base':>15}{'greedy vs base':>16}"
    ref = result["reference"]["ppl"]
    lines = [head, f"{'reference':<{w}}{0.0:>10.5f}{1.0:>8.3f}{ref:>9.3f}{1.0:>15.3f}{1.0:>11.3f}"]
    for r in result["rows"]:
        line = (
            f"{r['formats']:<{w}}{r['mean_kl']:>10.5f}{r['top1']:>8.3f}{r['ppl']:>9.3f}"
            f"{r['greedy_prefix']:>15.3f}{r['greedy_identical']:>11.3f}{r.get('kv_bytes_per_token', 0):>10.1f}"
        )
        vb = r.get("vs_baseline")
        if base and vb:
            line += f"{vb['mean_kl']:>18.5f}{vb['top1']:>15.3f}{vb['greedy_prefix']:>16.3f}"
        lines.append(line)
    return "\n".join(lines)


def plot_eval(path: Path, result: dict) -> None:
    """Bar charts: mean KL, top-1 agreement, greedy prefix agreement per format."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    names = [r["formats"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.8))
    for ax, key, title in zip(
        axes,
        ("mean_kl", "top1", "greedy_prefix"),
        ("mean KL vs float32 (lower is better)", "top-1 agreement", "greedy prefix agreement"),
        strict=True,
    ):
        ax.bar(names, [r[key] for r in rows], color="tab:blue")
        ax.set_title(title, fontsize=9)
        ax.tick_params(axis="x", rotation=30, labelsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle("decode weights/KV formats vs the float32 reference", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def bench_eval(
    cfg: EngineConfig,
    entries: list[str],
    max_new_tokens: int = 24,
    num_prompts: int = len(EVAL_PROMPTS),
    max_text_tokens: int | None = None,
    threads: int | None = None,
    log: Log = echo,
    baseline: str | None = "bf16/bf16",
    kv_granularities: list[str] | None = None,
) -> dict:
    """``run_eval`` over one load of ``cfg.model``, KV budget ``cfg.kv_memory`` (default 64 MiB)."""
    set_threads(threads)
    result = run_eval(
        engine_factory(cfg),
        entries,
        dtype=cfg.dtype,
        kv_memory=cfg.kv_memory or 64 << 20,
        max_new_tokens=max_new_tokens,
        prompts=EVAL_PROMPTS[:num_prompts],
        log=log,
        max_text_tokens=max_text_tokens,
        baseline=baseline,
        kv_granularities=kv_granularities,
    )
    result["model"] = cfg.model
    result["kv_scale_granularity"] = cfg.kv_scale_granularity  # of rows without [granularity]
    result["threads"] = torch.get_num_threads()
    log(format_table(result))
    return result
