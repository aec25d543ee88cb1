"""Load time of one random Llama-shaped model stored two ways: BF16, and block-scaled FP8
(DeepSeek-V3's 128x128 ``weight_scale_inv`` layout). Rounds interleave the two sources; each times
``load_model`` (read + convert) and the engine build (model, per-phase weights, KV pool).

    python tools/fp8_block_load.py [--layers 8] [--hidden 1024] [--repeats 3] [--threads 1]

Prints one JSON object: per source and per formats setting the runs, the median, and the paired
FP8/BF16 ratio per round."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
from safetensors.torch import save_file

from pagoda.kernels.fp8_block import quantize_fp8_block
from pagoda.node_agent.engine.config import EngineConfig, PhaseFormats
from pagoda.node_agent.engine.llm_engine import LLMEngine
from pagoda.node_agent.models.loader import load_model
from pagoda.node_agent.models.tokenizer import Tokenizer

FORMATS = {"fp8 phases": PhaseFormats("fp8", "bf16", "fp8", "bf16"), "bf16 phases": PhaseFormats.reference()}


def _write(path: Path, layers: int, hidden: int, fp8: bool, tok_dir: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    inter, vocab = hidden * 11 // 4, 8192
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": hidden // 64,
        "num_key_value_heads": hidden // 256,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    kv = hidden // 4
    shapes = {"q_proj": (hidden, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden)}
    shapes |= {"o_proj": (hidden, hidden), "gate_proj": (inter, hidden), "up_proj": (inter, hidden)}
    shapes["down_proj"] = (hidden, inter)
    t: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(vocab, hidden, generator=gen).bfloat16(),
        "lm_head.weight": torch.randn(vocab, hidden, generator=gen).bfloat16(),
        "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            t[p + norm + ".weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        for name, shape in shapes.items():
            part = "mlp." if name.endswith(("gate_proj", "up_proj", "down_proj")) else "self_attn."
            w = torch.randn(*shape, generator=gen) * 0.02
            if fp8:
                q = quantize_fp8_block(w)
                t[p + part + name + ".weight"], t[p + part + name + ".weight_scale_inv"] = q.weight, q.scale
            else:
                t[p + part + name + ".weight"] = w.bfloat16()
    if fp8:
        cfg["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "weight_block_size": [128, 128],
            "activation_scheme": "dynamic",
        }
    path.mkdir()
    save_file({k: v.contiguous() for k, v in t.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg))
    for f in tok_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            (path / f.name).write_bytes(f.read_bytes())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp())
    builtin = load_model("builtin://smollm2-135m")
    tok = Tokenizer(builtin.tokenizer_dir, builtin.gguf_file)
    tok._tok.save_pretrained(root / "tok")
    srcs = {s: root / s for s in ("bf16", "fp8_block")}
    for s, p in srcs.items():
        _write(p, args.layers, args.hidden, s == "fp8_block", root / "tok")
    runs: dict[str, list[float]] = {}
    for rnd in range(args.repeats + 1):  # round 0 warms the page cache and is not kept
        timed: dict[str, float] = {}
        for s, p in srcs.items():
            t0 = time.perf_counter()
            load_model(str(p))
            timed[f"{s} load_model"] = time.perf_counter() - t0
        for fname, fmts in FORMATS.items():
            for s, p in srcs.items():
                t0 = time.perf_counter()
                LLMEngine(EngineConfig(model=str(p), dtype="float32", formats=fmts, kv_memory=8 << 20))
                timed[f"{s} engine, {fname}"] = time.perf_counter() - t0
        for k, v in timed.items():
            if rnd:
                runs.setdefault(k, []).append(v)
    out: dict = {"runs": runs, "median": {k: statistics.median(v) for k, v in runs.items()}}
    pairs = [("load_model", "load_model")] + [(f"engine, {f}", f"engine, {f}") for f in FORMATS]
    out["fp8_block_over_bf16"] = {
        a: [x / y for x, y in zip(runs[f"fp8_block {a}"], runs[f"bf16 {b}"], strict=True)] for a, b in pairs
    }
    sizes = {s: sum(f.stat().st_size for f in p.glob("*.safetensors")) for s, p in srcs.items()}
    out |= {"bytes": sizes, "args": vars(args), "threads": torch.get_num_threads()}
    out |= {"machine": f"{platform.machine()} {platform.processor()}", "date": datetime.now(UTC).isoformat()}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
