"""Offline weight quantization (``pagoda quantize``) and loading of the checkpoints it writes.

A checkpoint is a Hugging Face style directory: ``config.json`` (the source architecture),
the tokenizer files, ``model.safetensors`` and ``pagoda_quant.json``. The blocks' linear weights
are stored packed: ``<name>.weight.packed|scales|zeros`` (int4) or ``<name>.weight.fp8|scale``
(fp8); everything else (embeddings, norms, biases, an untied head) stays dense in float32.

Loading rule: a phase whose weight format equals the checkpoint's format uses the packed weights
as stored (no requantization, so an int4 checkpoint serves decode exactly as the engine's own
int4 quantization of the source would); a phase with another format is built from the
dequantized checkpoint weights (e.g. bf16 or fp8 prefill from an int4 checkpoint).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from pagoda.kernels.fp8 import Fp8Weight
from pagoda.kernels.int4 import Int4Weight, pick_group_size, quantize_int4
from pagoda.node_agent.models.config import LINEAR_NAMES, ModelConfig, config_from_hf
from pagoda.node_agent.models.loader import LoadedModel, load_model, resolve_source
from pagoda.node_agent.models.quant_format import MANIFEST, meta_of, state_of
from pagoda.node_agent.models.tokenizer import Tokenizer

QUANT_FORMATS = ("int4", "fp8")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "generation_config.json",
)
BF16_BYTES = 2  # a dense checkpoint's usual element size, the "before" of the shrink figure


@dataclass
class QuantizeReport:
    """Sizes of a quantization run (bytes)."""

    out_dir: str
    weights: str
    group_size: int | None
    num_tensors: int
    linear_params: int
    linear_bytes_bf16: int  # the blocks' linear weights as a dense 2-byte checkpoint
    linear_bytes_fp32: int
    linear_bytes_quant: int  # packed weights plus scales (and zero points)
    checkpoint_bytes: int  # every file written

    @property
    def linear_ratio_bf16(self) -> float:
        return self.linear_bytes_quant / self.linear_bytes_bf16

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["linear_ratio_vs_bf16"] = self.linear_ratio_bf16
        d["linear_ratio_vs_fp32"] = self.linear_bytes_quant / self.linear_bytes_fp32
        return d


def linear_weight_names(num_layers: int) -> list[str]:
    """HF names of the blocks' linear weights (what gets quantized)."""
    return [f"model.layers.{i}.{n}.weight" for i in range(num_layers) for n in LINEAR_NAMES]


def quantize_tensor(w: torch.Tensor, fmt: str, group_size: int) -> Int4Weight | Fp8Weight:
    """One weight [N, K] -> its packed form (int4 group size as the engine picks it for K)."""
    if fmt == "int4":
        return quantize_int4(w, pick_group_size(w.shape[1], group_size))
    if fmt == "fp8":
        return Fp8Weight.quantize(w)
    raise ValueError(f"quantize supports {', '.join(QUANT_FORMATS)}, got {fmt!r}")


def quantize_checkpoint(
    source: str,
    weights: str,
    out_dir: str | Path,
    group_size: int = 128,
    progress: bool = True,
    loaded: LoadedModel | None = None,
    tokenizer: Tokenizer | None = None,
) -> QuantizeReport:
    """Quantize ``source``'s block linear weights to ``weights`` and write a loadable checkpoint.

    ``loaded`` / ``tokenizer`` reuse an already loaded source (its weights are only read)."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    if weights not in QUANT_FORMATS:
        raise ValueError(f"--weights must be one of {', '.join(QUANT_FORMATS)}, got {weights!r}")
    if weights == "int4":
        pick_group_size(128, group_size)  # validates the value before any work
    out = Path(out_dir)
    if loaded is None:
        _refuse_moe(source, _source_config(source))  # before reading any weights
    loaded = loaded or load_model(source)
    _refuse_moe(source, loaded.config)
    if loaded.manifest is not None:
        raise ValueError(f"{source} is already a quantized checkpoint; quantize the original weights")
    cfg = loaded.config
    names = linear_weight_names(cfg.num_layers)
    tensors: dict[str, torch.Tensor] = {}
    entries: dict[str, dict] = {}
    stored: dict[str, str] = {}
    n_params = quant_bytes = 0
    for name in tqdm(names, desc=f"quantize {weights}", unit="tensor", disable=not progress):
        w = loaded.weights[name]
        q = quantize_tensor(w, weights, group_size)
        n_params += w.numel()
        for part, t in state_of(q).items():
            key = f"{name}.{part}"
            tensors[key] = t.contiguous()
            stored[key] = name
            quant_bytes += t.nbytes
        entries[name] = meta_of(q)
    for name, t in loaded.weights.items():
        if name not in entries:
            tensors[name] = t.float().contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    kind, path = resolve_source(source)
    _write_config_and_tokenizer(kind, path, out, tokenizer)
    manifest = {
        "version": 1,
        "weights": weights,
        "group_size": group_size if weights == "int4" else None,
        "source": source,
        "quantized": entries,  # original weight name -> format metadata
        "tensors": stored,  # stored tensor name -> original weight name
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    total = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    return QuantizeReport(
        str(out),
        weights,
        manifest["group_size"],
        len(names),
        n_params,
        n_params * BF16_BYTES,
        n_params * 4,
        quant_bytes,
        total,
    )


def _source_config(source: str) -> ModelConfig | None:
    """The architecture of an HF-directory source from its config.json alone (None otherwise)."""
    kind, path = resolve_source(source)
    cfg_file = path / "config.json"
    if kind != "hf-dir" or not cfg_file.exists():
        return None  # load_model reports what is wrong with it
    try:
        return config_from_hf(json.loads(cfg_file.read_text()))
    except json.JSONDecodeError:
        return None


def _refuse_moe(source: str, cfg: ModelConfig | None) -> None:
    """`pagoda quantize` packs the dense blocks' linear weights only: MoE models are refused."""
    if cfg is not None and cfg.moe is not None:
        raise ValueError(
            f"{source}: pagoda quantize does not support mixture-of-experts models ({cfg.arch}); serve "
            "the original checkpoint, the engine quantizes the experts when it loads them "
            "(--decode-weights int4 / fp8)"
        )


def _write_config_and_tokenizer(kind: str, path: Path, out: Path, tokenizer: Tokenizer | None) -> None:
    """config.json (the source architecture) and the tokenizer files beside the weights."""
    if kind == "gguf":
        from transformers import AutoConfig, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(str(out))
        if tokenizer is None:
            AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(str(out))
        else:
            tokenizer._tok.save_pretrained(str(out))  # the wrapped transformers tokenizer
        return
    shutil.copyfile(path / "config.json", out / "config.json")
    for name in TOKENIZER_FILES:
        if (path / name).exists():
            shutil.copyfile(path / name, out / name)


def format_report(r: QuantizeReport) -> str:
    """Human-readable shrink figures."""
    mib = 2**20
    return (
        f"quantized {r.num_tensors} linear weights ({r.linear_params / 1e6:.1f}M params) to {r.weights}"
        + (f" (group {r.group_size})" if r.group_size else "")
        + f"\nlinear layers: {r.linear_bytes_bf16 / mib:.1f} MiB as bf16 ({r.linear_bytes_fp32 / mib:.1f} MiB"
        f" fp32) -> {r.linear_bytes_quant / mib:.1f} MiB ({r.linear_ratio_bf16:.3f}x of bf16)"
        f"\ncheckpoint written: {r.checkpoint_bytes / mib:.1f} MiB in {r.out_dir}"
    )
