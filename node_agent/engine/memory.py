"""Will the model fit? Weight bytes estimated from a checkpoint's tensor sizes and the chosen formats
(before any weight reaches the device), the CUDA free-memory check on them, and the KV pool check
that a budget holds what the engine needs."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from pagoda.kernels.fp8_block import Fp8BlockWeight
from pagoda.kernels.linear import DEFAULT_INT4_COMPUTE
from pagoda.node_agent.engine.config import ConfigError, EngineConfig
from pagoda.node_agent.kv import formats as kv_formats
from pagoda.node_agent.models.config import ModelLoadError
from pagoda.node_agent.models.layers import PHASES, as_stored, prequantized_format
from pagoda.node_agent.models.lazy_tensor import LazyTensor
from pagoda.vocabulary import PHASE_DEFAULTS

log = logging.getLogger("pagoda.engine")

GiB = 1 << 30
INT4_DEFAULT_GROUP = 128
EMBEDDING = "model.embed_tokens.weight"
HEAD = "lm_head.weight"
DENSE_ALWAYS = ("self_attn.kv_b_proj.weight",)  # held in the compute dtype whatever the phase formats


def fmt_bytes(n: float) -> str:
    """``12.35 GiB (13262859264 bytes)``: readable and exact."""
    return f"{n / GiB:.2f} GiB ({int(n)} bytes)"


def phase_weight_formats(config: EngineConfig) -> dict[str, str]:
    """The weight format of each phase as the model is built (a single-phase worker holds only its own)."""
    formats = {"prefill": config.formats.prefill_weights, "decode": config.formats.decode_weights}
    return dict.fromkeys(formats, formats[config.role]) if config.role in formats else formats


def _shape(w: object) -> tuple[int, int, int]:
    """(numel, rows, columns) of a tensor ([E, N, K] stacks count E*N rows) or a prequantized weight."""
    if prequantized_format(w) is not None:
        n, k = w.out_features, w.in_features  # type: ignore[attr-defined]
        return n * k, n, k
    t: torch.Tensor = w  # type: ignore[assignment]
    return t.numel(), t.numel() // max(1, t.shape[-1]), t.shape[-1]


def linear_bytes(
    w: object,
    fmt: str,
    dtype: torch.dtype,
    group_size: int | None = None,
    int4_compute: str = DEFAULT_INT4_COMPUTE,
) -> int:
    """Resident bytes of one linear weight (or expert stack) held in ``fmt``: dense in the compute
    dtype, FP8 with a float32 scale per output row, INT4 packed two to a byte with per-group
    parameters: float32 scale, zero point and offset for float32 compute on a float32 CPU engine
    (the exact kernel's inputs), a 2-byte scale and zero otherwise. A prequantized weight served in
    its own format counts as the CPU will hold it (INT4) or as stored. Routed experts count alike:
    their stacks hold each expert as the INT4 linear layer does."""
    if prequantized_format(w) == fmt:
        if fmt == "int4" and dtype == torch.float32:
            return int(w.resident_nbytes(int4_compute))  # type: ignore[attr-defined]
        return int(w.nbytes)  # type: ignore[attr-defined]
    numel, rows, cols = _shape(w)
    if fmt == "fp32":
        return numel * 4
    if fmt == "int8":  # the decode LM head: int8 with a float16 scale per 32 (exact blocks; per row is less)
        return numel + (numel // 32) * 2
    if fmt == "fp8":
        return numel + rows * 4
    if fmt == "int4":
        g = group_size or INT4_DEFAULT_GROUP
        while g > 32 and cols % g:
            g //= 2
        per_group = 9 if (dtype == torch.float32 and int4_compute == "float32") else 4
        return numel // 2 + (numel // g) * per_group
    return numel * torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class WeightEstimate:
    total: int
    by_format: dict[str, int]


def estimate_weight_bytes(
    weights: Mapping[str, object],
    formats: Mapping[str, str],
    dtype: torch.dtype,
    group_size: int | None = None,
    head_format: str = "bf16",
    int4_compute: str = DEFAULT_INT4_COMPUTE,
    decode_head_format: str = "dense",
) -> WeightEstimate:
    """Bytes the built model will hold: every 2-D (or stacked 3-D) block weight once per distinct phase
    format, routers in float32, embeddings, the LM head and 1-D tensors (norms, biases) in ``dtype``;
    a packed decode LM head (``decode_head_format`` int8 or int4) beside the dense one."""
    by_format: dict[str, int] = {}
    elem = torch.empty((), dtype=dtype).element_size()
    dense = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, str(dtype))

    def add(fmt: str, n: int) -> None:
        by_format[fmt] = by_format.get(fmt, 0) + n

    def add_head(w: object) -> None:
        add(head_format, linear_bytes(w, head_format, dtype))
        if decode_head_format in ("int8", "int4"):
            add(decode_head_format, linear_bytes(w, decode_head_format, dtype, 32, int4_compute))

    held = sorted(set(formats[p] for p in PHASES))
    for name, w in weights.items():
        if name == EMBEDDING:
            add(dense, _shape(w)[0] * elem)
            if HEAD not in weights:  # tied: the head is built from the embeddings
                add_head(w)
        elif name == HEAD:
            add_head(w)
        elif name.endswith(DENSE_ALWAYS):  # MLA's kv_b_proj: dense in both phases (absorbed W_UK/W_UV)
            add("bf16", linear_bytes(w, "bf16", dtype))
        elif name.endswith("mlp.gate.weight") or name.endswith("e_score_correction_bias"):
            add("fp32", _shape(w)[0] * 4)  # routers are float32
        elif prequantized_format(w) is None and not isinstance(w, torch.Tensor | LazyTensor):
            add(dense, int(getattr(w, "nbytes", 0)))  # an object of unknown layout: as stored
        elif name.endswith(".bias") and name.removesuffix(".bias") + ".weight" in weights:
            for fmt in held:  # a linear layer's bias: compute dtype beside a dense weight, else float32
                fmt = as_stored(fmt, weights[name.removesuffix(".bias") + ".weight"])
                add(fmt, _shape(w)[0] * (elem if fmt == "bf16" else 4))
        elif prequantized_format(w) is None and w.dim() < 2:  # type: ignore[attr-defined]
            add(dense, _shape(w)[0] * elem)  # norms and biases
        else:
            for fmt in held:  # FP8 blocks serve the fp8 format as stored, counted as the model does
                fmt = as_stored(fmt, w)
                block = isinstance(w, Fp8BlockWeight) or (isinstance(w, LazyTensor) and w.fp8_block)
                label = "fp8_block" if fmt == "fp8" and block else fmt
                add(label, linear_bytes(w, fmt, dtype, group_size, int4_compute))
    return WeightEstimate(sum(by_format.values()), dict(sorted(by_format.items())))


def check_weights_fit(
    estimate: WeightEstimate,
    device: torch.device,
    free_bytes: Callable[[torch.device], int] | None = None,
) -> None:
    """On CUDA, ModelLoadError when the estimated weights exceed the device's free memory (no check on
    the CPU, whose memory the loaded checkpoint already occupies). ``free_bytes`` defaults to
    ``torch.cuda.mem_get_info``'s free figure (tests pass a stub)."""
    if device.type != "cuda":
        return
    free = free_bytes(device) if free_bytes else torch.cuda.mem_get_info(device)[0]
    if estimate.total > free:
        parts = ", ".join(f"{f} {fmt_bytes(n)}" for f, n in estimate.by_format.items())
        raise ModelLoadError(
            f"the model's weights need {fmt_bytes(estimate.total)} on {device} ({parts}) but only "
            f"{fmt_bytes(free)} is free: choose smaller weight formats (fp8, int4; one format for both "
            "phases holds one copy), a single-phase role, or a larger device"
        )


def _one_byte_kv_formats() -> list[str]:
    """The registered KV formats with 1-byte elements, the decode default first."""
    one = [n for n in kv_formats.names(wire=True) if kv_formats.get(n).dtype is not None]
    one = [n for n in one if kv_formats.get(n).element_bytes(torch.float32) == 1]
    return sorted(one, key=lambda n: n != PHASE_DEFAULTS["decode"]["kv"])


def check_pool_fits(
    *,
    name: str,
    kv_format: str,
    budget: int,
    pages: int,
    page_size: int,
    bytes_per_page: int,
    num_layers: int,
    max_model_len: int,
    must_hold_sequence: bool,
) -> None:
    """ConfigError when a KV pool of ``pages`` cannot serve: no page at all, or (``must_hold_sequence``)
    not one ``max_model_len`` sequence. Otherwise a pool shorter than one such sequence is logged."""
    per_token = bytes_per_page / page_size
    per_layer = per_token / num_layers
    tokens = pages * page_size
    seq_pages = -(-max_model_len // page_size)
    need = seq_pages * bytes_per_page
    what = (
        f"KV pool {name!r} ({kv_format}): {per_layer:.0f} bytes per token per layer, {per_token:.0f} bytes "
        f"per token over {num_layers} layers ({bytes_per_page} bytes per page of {page_size} tokens)"
    )
    if pages < 1:
        raise ConfigError(
            f"{what}; its budget of {fmt_bytes(budget)} is below one page: give it at least "
            f"{fmt_bytes(bytes_per_page)} (one page), {fmt_bytes(need)} for one {max_model_len}-token sequence"
        )
    if tokens >= max_model_len:
        return
    msg = (
        f"{what}; its budget of {fmt_bytes(budget)} holds {tokens} tokens, less than one {max_model_len}-token "
        f"sequence ({fmt_bytes(need)})"
    )
    if must_hold_sequence:
        raise ConfigError(
            f"{msg}: raise the KV budget (--kv-memory / --kv-memory-fraction), lower --max-model-len to "
            f"at most {tokens}, or use 1-byte KV ({' or '.join(_one_byte_kv_formats())})"
        )
    log.warning("%s: a request needing more than %d tokens is refused", msg, tokens)
