"""``pagoda bench load``: load time and peak host memory of every tensor-parallel rank.

The bench writes a synthetic Qwen3-MoE checkpoint itself (random BF16 weights, many experts per
layer, several safetensors shards), then loads it the engine's way (``load_model(..., part, lazy)``
and ``rank_weights``: each rank lists its experts and reads its slices) at each tensor-parallel
degree, every rank a fresh process started at once, as a replica's ranks load. A rank reports its
resident memory after its imports (the fixed process overhead: Python, torch, safetensors, Pagoda),
its peak resident memory (``ru_maxrss``), the bytes it holds and its load time. The old whole-file
path (every shard read with ``safetensors.torch.load_file``, converted, then sliced) runs at one
rank beside it, for the time and memory it took.

What is measured is the load up to the weights a rank holds (float32, the loader's output), before
the engine packs them into its phase formats. ``weights`` below is that float32 size (a BF16
checkpoint is half of it on disk).

``gguf=True`` writes the same model as a qwen3moe GGUF file instead (every matrix Q8_0, experts
stacked per projection as llama.cpp stores them, random codes) and loads it per rank
(``gguf-sharded``: deferred GGUF tensors, a rank dequantizing its experts and slices) and the
whole way at one rank (``gguf-whole``: every tensor dequantized, then sliced), the decoded-model
cache off.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

FORMATS = {"fp8", "int4"}  # the CPU default phase formats: they set column units and FP8 row amax


def checkpoint_config(hidden: int, experts: int, vocab: int, layers: int) -> dict:
    """A Qwen3-MoE config: ``hidden`` wide, 8 query and 4 KV heads of hidden/8, ``experts`` routed
    experts of width hidden/4 per layer, 8 of them per token."""
    from transformers import Qwen3MoeConfig

    c = Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        moe_intermediate_size=hidden // 4,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=hidden // 8,
        num_experts=experts,
        num_experts_per_tok=min(8, experts),
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    out = c.to_dict()
    out["num_experts"] = experts  # transformers 5 writes num_local_experts; both are read
    out["architectures"] = ["Qwen3MoeForCausalLM"]
    out["torch_dtype"] = "bfloat16"
    return out


def tensor_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Every weight of the checkpoint (per-expert names, as released checkpoints store them)."""
    h, v, d = cfg["hidden_size"], cfg["vocab_size"], cfg["head_dim"]
    q, kv, i = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d, cfg["moe_intermediate_size"]
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (v, h))]
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out += [
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (q, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, q)),
            (p + "self_attn.q_norm.weight", (d,)),
            (p + "self_attn.k_norm.weight", (d,)),
            (p + "mlp.gate.weight", (cfg["num_experts"], h)),
        ]
        for e in range(cfg["num_experts"]):
            x = f"{p}mlp.experts.{e}."
            out += [
                (x + "gate_proj.weight", (i, h)),
                (x + "up_proj.weight", (i, h)),
                (x + "down_proj.weight", (h, i)),
            ]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    return out


def layers_for(size_bytes: int, hidden: int, experts: int, vocab: int) -> int:
    """Decoder layers that bring a BF16 checkpoint of this shape to about ``size_bytes``."""
    cfg = checkpoint_config(hidden, experts, vocab, 1)
    per_layer = sum(_numel(s) for n, s in tensor_shapes(cfg) if n.startswith("model.layers.")) * 2
    rest = 2 * vocab * hidden * 2
    return max(1, round((size_bytes - rest) / per_layer))


def write_checkpoint(path: Path, cfg: dict, shard_bytes: int, seed: int = 0) -> dict:
    """Random BF16 weights of ``cfg`` in shards of about ``shard_bytes`` (written one at a time),
    config.json, the index and a one-word tokenizer: {files, stored_bytes, tensors}."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    shapes = tensor_shapes(cfg)
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in shapes:
        if size >= shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, shape))
        size += _numel(shape) * 2
    index: dict[str, str] = {}
    stored = 0
    for n, group in enumerate(groups, 1):
        fname = f"model-{n:05d}-of-{len(groups):05d}.safetensors"
        part = {}
        for name, shape in group:
            t = torch.randn(shape, generator=gen, dtype=torch.float32) * (1.0 if len(shape) == 1 else 0.02)
            part[name] = t.to(torch.bfloat16)
            index[name] = fname
            stored += part[name].numel() * 2
        save_file(part, str(path / fname), metadata={"format": "pt"})
        del part
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": stored}, "weight_map": index})
    )
    Tokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>")).save(str(path / "tokenizer.json"))
    return {"files": len(groups), "stored_bytes": stored, "tensors": len(shapes)}


def write_gguf_checkpoint(path: Path, cfg: dict, seed: int = 0) -> dict:
    """The checkpoint of ``cfg`` as one qwen3moe GGUF file: matrices Q8_0 (random codes, scale
    2^-11), experts stacked [E, out, in] per projection, norms F32: {files, stored_bytes, tensors,
    params}."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    h, e, i = cfg["hidden_size"], cfg["num_experts"], cfg["moe_intermediate_size"]
    d, heads, kv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(h)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(d)
    w.add_value_length(d)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(cfg["vocab_size"])
    w.add_expert_count(e)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(i)
    q8 = gguf.GGMLQuantizationType.Q8_0
    scale = np.float16(2.0**-11).tobytes()
    stored = params = tensors = 0

    def add(name: str, shape: tuple[int, ...]) -> None:
        nonlocal stored, params, tensors
        tensors += 1
        params += _numel(shape)
        if len(shape) == 1:
            arr = np.ones(shape, np.float32)
            w.add_tensor(name, arr)
        else:
            blocks = rng.integers(0, 256, size=(*shape[:-1], shape[-1] // 32, 34), dtype=np.uint8)
            blocks[..., :2] = np.frombuffer(scale, np.uint8)
            arr = blocks.reshape(*shape[:-1], -1)
            w.add_tensor(name, arr, raw_dtype=q8)
        stored += arr.nbytes

    add("token_embd.weight", (cfg["vocab_size"], h))
    for n in range(cfg["num_hidden_layers"]):
        p = f"blk.{n}."
        for base, shape in (
            ("attn_norm", (h,)),
            ("ffn_norm", (h,)),
            ("attn_q", (heads * d, h)),
            ("attn_k", (kv * d, h)),
            ("attn_v", (kv * d, h)),
            ("attn_output", (h, heads * d)),
            ("attn_q_norm", (d,)),
            ("attn_k_norm", (d,)),
            ("ffn_gate_inp", (e, h)),
            ("ffn_gate_exps", (e, i, h)),
            ("ffn_up_exps", (e, i, h)),
            ("ffn_down_exps", (e, h, i)),
        ):
            add(f"{p}{base}.weight", shape)
    add("output_norm.weight", (h,))
    add("output.weight", (cfg["vocab_size"], h))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {"files": 1, "stored_bytes": stored, "tensors": tensors, "params": params}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ---------------------------------------------------------------- one rank (a fresh process)


def _rank_main(path: str, rank: int, world: int, mode: str, threads: int, out) -> None:
    """Load rank ``rank`` of ``world`` (``mode`` sharded or whole) and send what it measured."""
    import resource

    import psutil
    import torch

    from pagoda.node_agent.models.loader import load_model
    from pagoda.node_agent.models.parallel import (
        ColumnShard,
        make_plan,
        mlp_units,
        rank_weights,
        shard_weights,
    )

    if threads > 0:
        torch.set_num_threads(threads)
    if mode.startswith("gguf"):
        os.environ["PAGODA_NO_MODEL_CACHE"] = "1"  # the decode itself, not the cache, is measured
    me = psutil.Process()
    overhead = me.memory_info().rss
    overhead_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0, c0 = time.perf_counter(), _cpu_s(resource)
    if mode == "gguf-sharded" and world == 1:  # one rank keeps the whole decode: defer it here
        from pagoda.node_agent.models.loader import _decode_gguf

        loaded = _decode_gguf(path, Path(path), (0, 1))
        _, weights = rank_weights(loaded.weights, loaded.config, rank, world, FORMATS, None)
    elif mode in ("sharded", "gguf-sharded"):
        loaded = load_model(path, part=(rank, world), lazy=True)
        _, weights = rank_weights(loaded.weights, loaded.config, rank, world, FORMATS, None)
    else:  # the old path: every shard read (GGUF: every tensor dequantized), then this rank's slice
        loaded = load_model(path) if mode == "gguf-whole" else _load_whole(path)
        units = mlp_units(loaded.weights, loaded.config, FORMATS, None)
        plan = make_plan(loaded.config, rank, world, *units)
        weights = shard_weights(loaded.weights, loaded.config, plan, FORMATS)
        loaded = None
    seconds, cpu = time.perf_counter() - t0, _cpu_s(resource) - c0
    held = sum((w.weight if isinstance(w, ColumnShard) else w).nbytes for w in weights.values())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out.send(
        {
            "rank": rank,
            "load_s": round(seconds, 3),
            "cpu_s": round(cpu, 3),
            "held_bytes": int(held),
            "overhead_rss_bytes": int(overhead),
            "overhead_peak_bytes": int(overhead_peak),
            "peak_rss_bytes": int(peak),
            "rss_after_bytes": int(me.memory_info().rss),
        }
    )
    out.close()


def _cpu_s(resource) -> float:
    """User + system CPU seconds of this process (less disturbed by other load than wall time)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _warm(path: Path) -> None:
    """Read every shard once, so each variant starts from the same (warm) page cache."""
    for f in sorted(path.glob("*.safetensors")) if path.is_dir() else [path]:
        with open(f, "rb") as fh:
            while fh.read(64 * 2**20):
                pass


def _load_whole(path: str):
    """The loader before sharded loading: safetensors.torch.load_file per shard, float32."""
    from safetensors.torch import load_file

    from pagoda.node_agent.models.config import config_from_hf
    from pagoda.node_agent.models.loader import LoadedModel

    weights = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        for k, v in load_file(str(f)).items():
            weights[k] = v.float()
    cfg = config_from_hf(json.loads((Path(path) / "config.json").read_text()))
    return LoadedModel(path, cfg, weights, path, None)


def run_ranks(path: str, world: int, mode: str, threads: int, timeout_s: float = 900) -> dict:
    """Every rank of ``world`` started at once in a fresh process; their reports and the wall time."""
    ctx = mp.get_context("spawn")
    procs, pipes = [], []
    t0 = time.perf_counter()
    for r in range(world):
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_rank_main, args=(path, r, world, mode, threads, send), daemon=True)
        p.start()
        send.close()
        procs.append(p)
        pipes.append(recv)
    ranks = []
    for r, (p, recv) in enumerate(zip(procs, pipes, strict=True)):
        if not recv.poll(timeout_s):
            for q in procs:
                q.kill()
            raise RuntimeError(f"rank {r} of {world} ({mode}) sent no result within {timeout_s:.0f} s")
        try:
            ranks.append(recv.recv())
        except EOFError as exc:
            raise RuntimeError(f"rank {r} of {world} ({mode}) died (exit code {p.exitcode})") from exc
    for p in procs:
        p.join(30)
    return {"ranks": ranks, "wall_s": round(time.perf_counter() - t0, 3)}


# ---------------------------------------------------------------- the bench


def bench_load(
    size_mib: int = 1100,
    shard_mib: int = 256,
    hidden: int = 1024,
    experts: int = 64,
    vocab: int = 32000,
    tp: tuple[int, ...] = (1, 2, 4),
    repeats: int = 1,
    threads: int = 1,
    workdir: str | None = None,
    gguf: bool = False,
) -> dict:
    """Write the checkpoint (``gguf``: as a GGUF file), load it at each degree (sharded) and at one
    rank the old way, each ``repeats`` times, interleaved; the median load time and the largest
    peak per rank."""
    bytes_per_param = 34 / 32 if gguf else 2
    layers = layers_for(int(size_mib * 2**20 * 2 / bytes_per_param), hidden, experts, vocab)
    cfg = checkpoint_config(hidden, experts, vocab, layers)
    tmp = Path(tempfile.mkdtemp(prefix="pagoda-bench-load-", dir=workdir))
    ckpt_path = tmp / ("model.gguf" if gguf else "ckpt")
    whole_mode, sharded_mode = ("gguf-whole", "gguf-sharded") if gguf else ("whole", "sharded")
    try:
        t0 = time.perf_counter()
        if gguf:
            ckpt = write_gguf_checkpoint(ckpt_path, cfg)
        else:
            ckpt = write_checkpoint(ckpt_path, cfg, shard_mib * 2**20)
        ckpt["write_s"] = round(time.perf_counter() - t0, 1)
        variants = [(whole_mode, 1)] + [(sharded_mode, w) for w in tp]
        runs: dict[tuple[str, int], list[dict]] = {v: [] for v in variants}
        for _ in range(repeats):
            for mode, world in variants:
                _warm(ckpt_path)
                runs[mode, world].append(run_ranks(str(ckpt_path), world, mode, threads))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    weights = 4 * ckpt["params"] if gguf else 2 * ckpt["stored_bytes"]  # float32 held over all ranks
    rows = [_row(mode, world, runs[mode, world], weights) for mode, world in variants]
    by = {(r["mode"], r["tp"]): r for r in rows}
    whole, tp1 = by[whole_mode, 1], by.get((sharded_mode, 1))
    return {
        "bench": "load",
        "gguf": gguf,
        "method": (
            (
                "GGUF variant: the same model as one qwen3moe GGUF file (matrices Q8_0, experts stacked); "
                "gguf-sharded = deferred GGUF tensors dequantized per rank, gguf-whole = every tensor "
                "dequantized then sliced, model cache off. "
                if gguf
                else ""
            )
            + "a synthetic Qwen3-MoE checkpoint (random BF16, per-expert tensors, several safetensors "
            "shards) written by the bench, loaded by every rank of a degree at once, each a fresh "
            "process: sharded = load_model(part, lazy) + rank_weights (the engine's path: a rank lists "
            "its experts and reads its slices through safetensors' lazy slices, converting tensor by "
            "tensor); whole = the old path (load_file per shard, float32, then sliced), one rank. "
            "Per rank: RSS after imports (the fixed overhead), peak RSS (ru_maxrss), bytes held "
            "(float32), load time and CPU time (user + system; medians of repeats, interleaved, each "
            "from a warm page cache); the load ends with the float32 "
            "weights a rank holds, before the engine packs its phase formats. ratio = (peak - overhead) "
            "/ (weights / tp)."
        ),
        "checkpoint": {
            **ckpt,
            "layers": layers,
            "hidden": hidden,
            "experts": experts,
            "vocab": vocab,
            "moe_intermediate": hidden // 4,
            "shard_mib": shard_mib,
        },
        "weights_float32_bytes": weights,
        "repeats": repeats,
        "threads": threads,
        "formats": sorted(FORMATS),
        "rows": rows,
        "sharded_vs_whole_time_tp1": round(tp1["load_s"] / whole["load_s"], 3) if tp1 else None,
        "sharded_vs_whole_cpu_tp1": round(tp1["cpu_s"] / whole["cpu_s"], 3) if tp1 else None,
    }


def _row(mode: str, world: int, runs: list[dict], weights: int) -> dict:
    ranks = []
    for r in range(world):
        per = [run["ranks"][r] for run in runs]
        peak = max(p["peak_rss_bytes"] for p in per)
        overhead = statistics.median(p["overhead_rss_bytes"] for p in per)
        ranks.append(
            {
                "rank": r,
                "load_s": round(statistics.median(p["load_s"] for p in per), 3),
                "cpu_s": round(statistics.median(p["cpu_s"] for p in per), 3),
                "held_bytes": per[0]["held_bytes"],
                "overhead_rss_bytes": int(overhead),
                "peak_rss_bytes": int(peak),
                "ratio_to_share": round((peak - overhead) / (weights / world), 3),
            }
        )
    return {
        "mode": mode,
        "tp": world,
        "load_s": max(r["load_s"] for r in ranks),  # the replica has loaded when its slowest rank has
        "load_s_runs": (per_run := [max(p["load_s"] for p in run["ranks"]) for run in runs]),
        "load_s_min": min(per_run),
        "load_s_max": max(per_run),
        "wall_s": round(statistics.median(run["wall_s"] for run in runs), 3),  # with process start
        "cpu_s": max(r["cpu_s"] for r in ranks),
        "share_bytes": weights // world,
        "max_ratio_to_share": max(r["ratio_to_share"] for r in ranks),
        "ranks": ranks,
    }


def plot_load(path: Path, result: dict) -> None:
    """Peak RSS per rank over its share (bars per degree) and load time per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    labels, peaks, shares, overheads = [], [], [], []
    for row in rows:
        for r in row["ranks"]:
            labels.append(f"{row['mode']}\nTP{row['tp']} r{r['rank']}")
            peaks.append(r["peak_rss_bytes"] / 2**30)
            overheads.append(r["overhead_rss_bytes"] / 2**30)
            shares.append(row["share_bytes"] / 2**30)
    x = range(len(labels))
    a.bar(x, peaks, color="tab:blue", label="peak RSS")
    a.bar(x, overheads, color="tab:gray", label="RSS after imports (overhead)")
    a.scatter(
        x,
        [s * 1.3 + o for s, o in zip(shares, overheads, strict=True)],
        color="tab:red",
        marker="_",
        s=300,
        label="1.3 x share + overhead",
        zorder=3,
    )
    a.set_xticks(list(x), labels, fontsize=7)
    a.set_ylabel("GiB")
    a.set_title("peak host memory per rank")
    a.legend(fontsize=7)
    names = [f"{r['mode']} TP{r['tp']}" for r in rows]
    b.bar(
        range(len(rows)),
        [r["load_s"] for r in rows],
        color=["tab:orange" if r["mode"] == "whole" else "tab:green" for r in rows],
    )
    b.set_xticks(range(len(rows)), names, fontsize=8)
    b.set_ylabel("seconds (all ranks loaded)")
    ck = result["checkpoint"]
    b.set_title(
        f"load time: {ck['stored_bytes'] / 2**30:.2f} GiB {'GGUF Q8_0' if result.get('gguf') else 'BF16'}, "
        f"{ck['files']} shards, {ck['experts']} experts"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
