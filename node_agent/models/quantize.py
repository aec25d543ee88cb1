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
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagoda.kernels.fp8 import Fp8Weight
from pagoda.kernels.int4 import Int4Weight
from pagoda.node_agent.models.config import LINEAR_NAMES, ModelConfig, config_from_hf
from pagoda.node_agent.models.int4_quant import clip_search, layer_group_size, quantize_rtn
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
    """Sizes of a quantization run (bytes) and how each weight was made."""

    out_dir: str
    weights: str
    group_size: int | str | None  # the forced INT4 group, "auto" (per layer) or None (fp8)
    num_tensors: int
    linear_params: int
    linear_bytes_bf16: int  # the blocks' linear weights as a dense 2-byte checkpoint
    linear_bytes_fp32: int
    linear_bytes_quant: int  # packed weights plus scales (and zero points)
    checkpoint_bytes: int  # every file written
    zero: str = "int"  # INT4 zero points: "int" or "float"
    group_sizes: dict[int, int] = field(default_factory=dict)  # INT4 group -> number of weights
    zero_forms: dict[str, int] = field(default_factory=dict)  # "int" / "float" / "symmetric" -> count
    passthrough: int = 0  # weights already in the target format in the source: written unchanged
    calibrated: bool = False
    calibration_tokens: int = 0
    calibration_error_rtn: float = 0.0  # summed output error on the calibration text, plain RTN
    calibration_error: float = 0.0  # ... with the searched clip ratios

    @property
    def linear_ratio_bf16(self) -> float:
        return self.linear_bytes_quant / self.linear_bytes_bf16

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["group_sizes"] = {str(g): c for g, c in self.group_sizes.items()}
        d["linear_ratio_vs_bf16"] = self.linear_ratio_bf16
        d["linear_ratio_vs_fp32"] = self.linear_bytes_quant / self.linear_bytes_fp32
        return d


def linear_weight_names(num_layers: int) -> list[str]:
    """HF names of the blocks' linear weights (what gets quantized)."""
    return [f"model.layers.{i}.{n}.weight" for i in range(num_layers) for n in LINEAR_NAMES]


def quantize_tensor(
    w: torch.Tensor, fmt: str, group_size: int | None = None, float_zero: bool = False, name: str = "weight"
) -> Int4Weight | Fp8Weight:
    """One dense weight [N, K] -> its packed form; INT4 ``group_size`` None picks per layer."""
    if fmt == "int4":
        return quantize_rtn(w, layer_group_size(w.shape[1], group_size, name), float_zero)
    if fmt == "fp8":
        return Fp8Weight.quantize(w)
    raise ValueError(f"quantize supports {', '.join(QUANT_FORMATS)}, got {fmt!r}")


def _in_features(w: object) -> int:
    return w.shape[1] if isinstance(w, torch.Tensor) else w.in_features


def _already(w: object, fmt: str) -> bool:
    """Whether a source weight is already in ``fmt`` (written through without requantization)."""
    return isinstance(w, Int4Weight) if fmt == "int4" else isinstance(w, Fp8Weight)


def _compact(part: str, t: torch.Tensor) -> torch.Tensor:
    """INT4 scales / mins as float16 on disk when that loses nothing (GGUF Q4_0/Q4_1 blocks and
    GPTQ/AWQ scales come from float16); the loader reads them back as float32."""
    if part in ("scales", "mins") and t.dtype == torch.float32:
        half = t.half()
        if torch.equal(half.float(), t):
            return half
    return t


def _dense(w: object) -> torch.Tensor:
    return w if isinstance(w, torch.Tensor) else w.dequantize()


def quantize_checkpoint(
    source: str,
    weights: str,
    out_dir: str | Path,
    group_size: int | None = None,
    progress: bool = True,
    loaded: LoadedModel | None = None,
    tokenizer: Tokenizer | None = None,
    float_zero: bool = False,
    calibration: dict[str, torch.Tensor] | None = None,
    calibration_tokens: int = 0,
    requantize: bool = False,
) -> QuantizeReport:
    """Quantize ``source``'s block linear weights to ``weights`` and write a loadable checkpoint.

    INT4: ``group_size`` None picks each layer's group from its K (``int4_quant.layer_group_size``),
    a number forces it on every layer; ``float_zero`` stores float offsets instead of integer zero
    points; ``calibration`` (weight name -> Gram matrix of its inputs) turns on the clip search.
    Weights the source already holds in the target format are written through unchanged, unless
    ``requantize`` (then they are quantized again from their dequantized values, like dense ones).
    ``loaded`` / ``tokenizer`` reuse an already loaded source (its weights are only read)."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    if weights not in QUANT_FORMATS:
        raise ValueError(f"--weights must be one of {', '.join(QUANT_FORMATS)}, got {weights!r}")
    if weights == "int4" and group_size is not None:
        layer_group_size(group_size * 2, group_size)  # validates the value before any work
    out = Path(out_dir)
    if loaded is None:
        _refuse_moe(source, _source_config(source))  # before reading any weights
    loaded = loaded or load_model(source)
    _refuse_moe(source, loaded.config)
    if loaded.manifest is not None:
        raise ValueError(f"{source} is already a quantized checkpoint; quantize the original weights")
    cfg = loaded.config
    names = linear_weight_names(cfg.num_layers)
    missing = [n for n in names if n not in loaded.weights]
    if missing:
        raise ValueError(
            f"{source}: pagoda quantize needs the dense decoder's linear weights; missing {missing[0]}"
        )
    todo = [n for n in names if requantize or not _already(loaded.weights[n], weights)]
    if weights == "int4":  # a forced group that misses a layer's K fails before any work
        for n in todo:
            layer_group_size(_in_features(loaded.weights[n]), group_size, n)
    if calibration is not None:
        absent = [n for n in todo if n not in calibration]
        if weights != "int4" or absent:
            raise ValueError(
                f"calibration covers INT4 only and every quantized weight (missing {absent[:1]})"
            )
    report = QuantizeReport(
        str(out), weights, (group_size or "auto") if weights == "int4" else None, len(names), 0, 0, 0, 0, 0
    )
    report.zero = "float" if float_zero else "int"
    report.calibrated, report.calibration_tokens = calibration is not None, calibration_tokens
    tensors: dict[str, torch.Tensor] = {}
    entries: dict[str, dict] = {}
    stored: dict[str, str] = {}
    desc = f"quantize {weights}" + (" (clip search)" if calibration is not None else "")
    for name in tqdm(names, desc=desc, unit="tensor", disable=not progress):
        src = loaded.weights[name]
        if name not in todo:
            q = src
            report.passthrough += 1
        elif calibration is not None:
            w = _dense(src)
            g = layer_group_size(w.shape[1], group_size, name)
            q, stats = clip_search(w, calibration[name], g, float_zero)
            report.calibration_error_rtn += stats["rtn_error"]
            report.calibration_error += stats["error"]
        else:
            q = quantize_tensor(_dense(src), weights, group_size, float_zero, name)
        if isinstance(q, Int4Weight):
            report.group_sizes[q.group_size] = report.group_sizes.get(q.group_size, 0) + 1
            form = "float" if q.mins is not None else "symmetric" if q.symmetric else "int"
            report.zero_forms[form] = report.zero_forms.get(form, 0) + 1
        report.linear_params += q.out_features * q.in_features
        for part, t in state_of(q).items():
            key = f"{name}.{part}"
            tensors[key] = _compact(part, t).contiguous()
            stored[key] = name
            report.linear_bytes_quant += tensors[key].nbytes
        entries[name] = meta_of(q)
    for name, t in loaded.weights.items():
        if name not in entries:
            tensors[name] = _dense(t).float().contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    kind, path = resolve_source(source)
    _write_config_and_tokenizer(kind, path, out, tokenizer)
    manifest = {
        "version": 1,
        "weights": weights,
        "group_size": report.group_size,
        "zero": report.zero if weights == "int4" else None,
        "calibrated": report.calibrated,
        "passthrough": [n for n in names if n not in todo],
        "source": source,
        "quantized": entries,  # original weight name -> format metadata
        "tensors": stored,  # stored tensor name -> original weight name
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    report.linear_bytes_bf16 = report.linear_params * BF16_BYTES
    report.linear_bytes_fp32 = report.linear_params * 4
    report.checkpoint_bytes = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    return report


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
    raw = json.loads((path / "config.json").read_text())
    raw.pop("quantization_config", None)  # the source's (GPTQ/AWQ/...) layout no longer applies
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    for name in TOKENIZER_FILES:
        if (path / name).exists():
            shutil.copyfile(path / name, out / name)


def format_report(r: QuantizeReport) -> str:
    """Human-readable shrink figures and how the weights were made."""
    mib = 2**20
    lines = [f"quantized {r.num_tensors} linear weights ({r.linear_params / 1e6:.1f}M params) to {r.weights}"]
    if r.weights == "int4":
        groups = ", ".join(f"group {g}: {c}" for g, c in sorted(r.group_sizes.items()))
        zeros = ", ".join(f"{form}: {c}" for form, c in sorted(r.zero_forms.items()))
        lines[0] += f" ({groups}; zero points {zeros})"
    if r.passthrough:
        lines.append(
            f"{r.passthrough} of them were already {r.weights} in the source: written through unchanged "
            "(no requantization; group and zero options do not apply to them)"
        )
    if r.calibrated:
        gain = r.calibration_error / r.calibration_error_rtn if r.calibration_error_rtn else 1.0
        lines.append(
            f"clip search on {r.calibration_tokens} calibration tokens: output error {gain:.3f}x of "
            "round to nearest"
        )
    lines.append(
        f"linear layers: {r.linear_bytes_bf16 / mib:.1f} MiB as bf16 ({r.linear_bytes_fp32 / mib:.1f} MiB"
        f" fp32) -> {r.linear_bytes_quant / mib:.1f} MiB ({r.linear_ratio_bf16:.3f}x of bf16)"
    )
    lines.append(f"checkpoint written: {r.checkpoint_bytes / mib:.1f} MiB in {r.out_dir}")
    return "\n".join(lines)
