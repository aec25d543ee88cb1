"""Helpers every benchmark shares: prompts, engines over one model load, JSON + PNG output."""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Callable
from pathlib import Path

from pagoda.node_agent.engine.config import EngineConfig

BENCH_PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator works to a ten year old.",
    "List five ideas for a weekend trip in the mountains and explain each one.",
    "Describe the water cycle in detail, step by step.",
    "What are the main differences between a violin and a cello?",
    "Give me a recipe for a simple vegetable soup and explain each step.",
    "Why is the sky blue? Answer with a careful physical explanation.",
    "Summarize the plot of a detective novel you would like to write.",
]

Log = Callable[[str], None]
EngineFactory = Callable[..., object]


def echo(line: str) -> None:
    """The default progress log: a flushed line on stdout."""
    print(line, flush=True)


def bench_prompts(n: int, salt: str = "") -> list[str]:
    """n distinct prompts (a numbered variant of the base set, so no two share a prefix page)."""
    return [f"[{salt}{i}] {BENCH_PROMPTS[i % len(BENCH_PROMPTS)]}" for i in range(n)]


def random_token_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """n distinct token-id prompts (no shared prefix page), deterministic per seed."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]


def engine_factory(cfg: EngineConfig) -> EngineFactory:
    """``make(**overrides)``: an LLMEngine on ``cfg`` with fields replaced, all over one load of the model."""
    from pagoda.node_agent.engine.llm_engine import LLMEngine
    from pagoda.node_agent.models.loader import load_model
    from pagoda.node_agent.models.tokenizer import Tokenizer

    loaded = load_model(cfg.model)
    tok = Tokenizer(loaded.tokenizer_dir, loaded.gguf_file)

    def make(**overrides):
        return LLMEngine(dataclasses.replace(cfg, **overrides), loaded=loaded, tokenizer=tok)

    return make


def set_threads(threads: int | None) -> None:
    """Pin torch's CPU threads (0 or None: leave torch's default)."""
    if threads:
        import torch

        torch.set_num_threads(threads)


def write_result(json_path: str | None, result: dict, plot: Callable[[Path], None]) -> None:
    """Write ``result`` as JSON to ``json_path`` and ``plot`` to a PNG beside it (nothing if no path)."""
    if not json_path:
        return
    path = Path(json_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    png = path.with_suffix(".png")
    plot(png)
    print(f"wrote {path} and {png}")


def plot_lines(path: Path, rows: list[dict], key: str, x: str, y: str, title: str, ylabel: str) -> None:
    """One line per distinct ``row[key]``: ``y`` over ``x`` (log2 x axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name in dict.fromkeys(r[key] for r in rows):
        pts = sorted((r[x], r[y]) for r in rows if r[key] == name)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=str(name))
    ax.set_xscale("log", base=2)
    ax.set_xlabel(x)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
