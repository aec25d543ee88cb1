"""What every benchmark shares: the measuring method, prompts, engines over one model load, and
JSON + PNG output.

The method: each variant compared (an engine, a format, a mode, at one concurrency) runs once
untimed (warm-up), then ``repeats`` timed runs interleaved A B C A B C ..., so that drift of a
shared machine hits every variant alike. Rows report the median with min and max; a ratio between
two variants is taken per repeat (the pair ran back to back) and reported as median and spread.
Every result carries the machine, the torch threads actually used, library versions, the git
commit, the date and the command line (``environment``)."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import random
import statistics
import subprocess
from collections.abc import Callable, Sequence
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


# ---------------------------------------------------------------- the method


@dataclasses.dataclass
class Variant:
    """One thing a bench compares: ``run(repeat)`` measures once and returns figures (a dict);
    ``warm()`` runs untimed before the repeats (default: ``run(-1)``, result discarded)."""

    name: str
    run: Callable[[int], dict]
    warm: Callable[[], object] | None = None


def run_interleaved(
    variants: Sequence[Variant], repeats: int, log: Log | None = None
) -> dict[str, list[dict]]:
    """Warm every variant up once, then ``repeats`` rounds of every variant in order (A B C A B C).

    Returns each variant's per-repeat results, in repeat order (index i of two variants ran in the
    same round, which is what ``paired_ratio`` pairs)."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    names = [v.name for v in variants]
    if len(set(names)) != len(names):
        raise ValueError(f"variant names must be distinct, got {names}")
    for v in variants:
        v.warm() if v.warm is not None else v.run(-1)
    out: dict[str, list[dict]] = {v.name: [] for v in variants}
    for r in range(repeats):
        for v in variants:
            out[v.name].append(v.run(r))
        if log is not None:
            log(f"  repeat {r + 1}/{repeats} done")
    return out


def spread(values: Sequence[float]) -> dict:
    """Median, min, max and every value of repeated measurements."""
    vals = [float(v) for v in values]
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "runs": vals}


def summarize(runs: Sequence[dict], keys: Sequence[str]) -> dict:
    """Flatten repeated results for a row: ``k`` (median), ``k_min``, ``k_max``, ``k_runs`` per key."""
    row: dict = {}
    for k in keys:
        s = spread([r[k] for r in runs])
        row[k], row[f"{k}_min"], row[f"{k}_max"], row[f"{k}_runs"] = (
            s["median"],
            s["min"],
            s["max"],
            s["runs"],
        )
    return row


def paired_ratio(num: Sequence[float], den: Sequence[float]) -> dict:
    """``num[i] / den[i]`` per repeat (the pair ran in the same round): median, min, max, runs."""
    if len(num) != len(den) or not num:
        raise ValueError(f"paired_ratio needs two equal, non-empty series, got {len(num)} and {len(den)}")
    return spread([a / b if b else float("inf") for a, b in zip(num, den, strict=True)])


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def git_commit() -> dict | None:
    """The checkout's commit and whether tracked files differ from it (None outside a git checkout)."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip())}


def package_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def environment(command: str | None = None) -> dict:
    """The block every result JSON carries: machine, torch threads in use, versions, commit, date."""
    import torch

    return {
        "machine": {
            "platform": platform.platform(),
            "cpu": cpu_model(),
            "logical_cores": os.cpu_count(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        },
        "threads": torch.get_num_threads(),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": package_version("transformers"),
            "pagoda": package_version("pagoda"),
            "llama-cpp-python": package_version("llama-cpp-python"),  # None when not installed
        },
        "git": git_commit(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": command,
    }


# ---------------------------------------------------------------- engines and output


def engine_factory(cfg: EngineConfig) -> EngineFactory:
    """``make(**overrides)``: an LLMEngine on ``cfg`` with fields replaced, all over one load of the model."""
    from pagoda.node_agent.engine.llm_engine import LLMEngine
    from pagoda.node_agent.models.loader import load_model
    from pagoda.node_agent.models.tokenizer import Tokenizer

    loaded = load_model(cfg.model)
    tok = Tokenizer(loaded.tokenizer_dir, loaded.gguf_file, cfg.trust_remote_code)

    def make(**overrides):
        return LLMEngine(dataclasses.replace(cfg, **overrides), loaded=loaded, tokenizer=tok)

    return make


def set_threads(threads: int | None) -> None:
    """Pin torch's CPU threads (0 or None: leave torch's default)."""
    if threads:
        import torch

        torch.set_num_threads(threads)


def kernel_report() -> dict:
    """The kernel table of the model this process built (kernels/selector.py), else the one this
    machine selects for float32 on its default device (a bench that builds no model)."""
    import torch

    from pagoda.kernels.selector import active_selection, select_kernels

    selection = active_selection()
    if selection is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        selection = select_kernels(device, torch.float32, allow_fallback=True)
    return selection.as_dict()


def write_result(
    json_path: str | None, result: dict, plot: Callable[[Path], None], command: str | None = None
) -> None:
    """Write ``result`` as JSON to ``json_path`` and ``plot`` to a PNG beside it (nothing if no path).

    ``command`` (the command line that produced it) is stored under ``"command"``; what a result
    lacks of the method's block (``environment``) is added here, so every JSON names its machine
    (keys the bench set itself, such as the threads a kernel bench pinned, are kept)."""
    for key, value in environment().items():
        result.setdefault(key, value)
    result.setdefault("kernels", kernel_report())
    if command is not None:
        result["command"] = command
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
