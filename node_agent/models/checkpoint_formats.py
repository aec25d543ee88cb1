"""Released prequantized Hugging Face checkpoints, read straight into the kernels' weight objects.

Two ``quantization_config`` forms of config.json are understood:

  * DeepSeek-V3 / Kimi FP8 (``quant_method: fp8``, ``fmt: e4m3``, ``weight_block_size [bn, bk]``,
    dynamic activations): ``X.weight`` float8_e4m3fn [N, K] plus ``X.weight_scale_inv`` float32
    [ceil(N/bn), ceil(K/bk)], one scale per block (partial edge blocks included). Kept as stored
    (kernels.fp8_block's Fp8BlockWeight, routed experts as an ``fp8_block`` ExpertStack): an
    ``fp8`` phase computes with the block scales, any other format dequantizes the exact values.
  * compressed-tensors (llmcompressor's output): W4A16 symmetric or with zero points, act-ordered
    or not, and W8A16; see ``compressed_tensors_format``. INT4 group weights view the stored
    nibbles (Int4Weight); 8-bit weights and scattering act-order indices dequantize exactly.

  * GPTQ (``quant_method: gptq``) and AWQ (``quant_method: awq``, GEMM packing) W4A16: read into
    Int4Weight with integer arithmetic only; see ``gptq_awq``.

Everything else in such a checkpoint (norms, embeddings, unquantized layers) is read as float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from pagoda.kernels.fp8 import Fp8Weight
from pagoda.kernels.fp8_block import Fp8BlockWeight, concat_block_rows
from pagoda.kernels.fp8_format import FP8_DTYPE
from pagoda.kernels.int4 import Int4Weight
from pagoda.node_agent.models.compressed_tensors_format import (
    CtConfig,
    convert_compressed_tensors,
    parse_compressed_tensors,
)
from pagoda.node_agent.models.config import ModelLoadError
from pagoda.node_agent.models.gptq_awq import AWQ, GPTQ, convert_gptq_awq, parse_awq, parse_gptq

FP8_BLOCK = "fp8_block"
COMPRESSED = "compressed-tensors"
# Weights the model reads as plain tensors (embedding, LM head, MoE router, MLA's kv_b_proj whose
# weight is split into per-head views): dequantized if a checkpoint quantized them.
DENSE_ONLY_SUFFIXES = ("embed_tokens.weight", "lm_head.weight", "mlp.gate.weight", "kv_b_proj.weight")


@dataclass(frozen=True)
class CheckpointQuant:
    """What a checkpoint's ``quantization_config`` asks for, once validated."""

    method: str  # FP8_BLOCK | COMPRESSED | GPTQ | AWQ
    block: tuple[int, int] = (0, 0)  # FP8: weight_block_size [rows, cols]
    group_size: int = 0  # INT4
    symmetric: bool = True  # GPTQ's sym
    zero_offset: int = 0  # GPTQ v1 stores zero - 1: added back on load
    compressed: CtConfig | None = None  # compressed-tensors: the schemes and the ignore list


def parse_quantization_config(raw: dict) -> CheckpointQuant | None:
    """The checkpoint quantization of a config.json dict, None when it has none.

    Raises ModelLoadError naming the field for anything this loader cannot serve exactly."""
    qc = raw.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ModelLoadError("config.json quantization_config must be an object")
    method = qc.get("quant_method")
    if method == "fp8":
        return _parse_fp8(qc)
    if method == COMPRESSED:
        return CheckpointQuant(COMPRESSED, compressed=parse_compressed_tensors(qc))
    if method == GPTQ:
        g, sym, offset = parse_gptq(qc)
        return CheckpointQuant(GPTQ, group_size=g, symmetric=sym, zero_offset=offset)
    if method == AWQ:
        return CheckpointQuant(AWQ, group_size=parse_awq(qc), symmetric=False)
    raise ModelLoadError(
        f"unsupported quantization_config.quant_method {method!r}; supported: 'fp8' (block-scaled "
        "e4m3, DeepSeek-V3 style), 'compressed-tensors' (pack-quantized W4A16 and W8A16), "
        "'gptq' and 'awq' (4-bit W4A16)"
    )


def _parse_fp8(qc: dict) -> CheckpointQuant:
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ModelLoadError(f"unsupported fp8 quantization_config.fmt {fmt!r}; only 'e4m3' is supported")
    act = qc.get("activation_scheme", "dynamic")
    if act != "dynamic":
        raise ModelLoadError(
            f"unsupported fp8 quantization_config.activation_scheme {act!r}; only 'dynamic' is supported "
            "(static activation scales are not read)"
        )
    block = qc.get("weight_block_size")
    if (
        not isinstance(block, list)
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ModelLoadError(
            f"fp8 quantization_config.weight_block_size must be two positive integers, got {block!r}"
        )
    return CheckpointQuant(FP8_BLOCK, block=(block[0], block[1]))


def convert_checkpoint(weights: dict[str, Tensor], q: CheckpointQuant) -> dict[str, object]:
    """Stored tensors -> weight name -> Int4Weight / Fp8BlockWeight for quantized linears, float32
    else."""
    try:
        if q.method == FP8_BLOCK:
            out = _convert_fp8_block(weights, q.block)
        elif q.method in (GPTQ, AWQ):
            quantized, claimed = convert_gptq_awq(weights, q.method, q.group_size, q.symmetric, q.zero_offset)
            out = _plain(weights, claimed)
            out.update(quantized)
        else:
            quantized, claimed = convert_compressed_tensors(weights, q.compressed)
            out = _plain(weights, claimed)
            out.update(quantized)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc
    for name in [n for n in out if n.endswith(DENSE_ONLY_SUFFIXES)]:
        if isinstance(out[name], Int4Weight | Fp8Weight | Fp8BlockWeight):
            out[name] = out[name].dequantize()
    return out


def _plain(weights: dict[str, Tensor], claimed: set[str]) -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in weights.items():
        if k in claimed:
            continue
        if v.dtype in (FP8_DTYPE, torch.int32) and k.endswith(".weight"):
            raise ValueError(f"{k} is {v.dtype} but has no quantization scale in the checkpoint")
        out[k] = v.float()
    return out


def _convert_fp8_block(weights: dict[str, Tensor], block: tuple[int, int]) -> dict[str, object]:
    claimed: set[str] = set()
    quantized: dict[str, Fp8BlockWeight] = {}
    for key in weights:
        if not key.endswith(".weight_scale_inv"):
            continue
        name = key.removesuffix("_scale_inv")
        if name not in weights:
            raise ValueError(f"checkpoint has {key} but no {name}")
        quantized[name] = Fp8BlockWeight.from_checkpoint(weights[name], weights[key], block, name)
        claimed |= {key, name}
    out = _plain(weights, claimed)
    out.update(quantized)
    return out


def prequantized_expert_stack(w: dict[str, object], prefix: str, num_experts: int):
    """An ExpertStack in the stored format when ``<prefix>experts.{e}.*_proj.weight`` are all
    Int4Weight (one group size, symmetric or not alike), all Fp8Weight or all Fp8BlockWeight; None
    for float tensors."""
    from pagoda.kernels.moe import ExpertStack

    first = w.get(f"{prefix}experts.0.gate_proj.weight")
    if not isinstance(first, Int4Weight | Fp8Weight | Fp8BlockWeight):
        return None
    kind = type(first)
    names = ("gate_proj", "up_proj", "down_proj")
    per = {n: [w.get(f"{prefix}experts.{e}.{n}.weight") for e in range(num_experts)] for n in names}
    for n, ws in per.items():
        for e, x in enumerate(ws):
            if not isinstance(x, kind):
                raise ModelLoadError(
                    f"{prefix}experts.{e}.{n}.weight is {type(x).__name__}, expected {kind.__name__} like "
                    "the other experts"
                )
    gate, up, down = per["gate_proj"], per["up_proj"], per["down_proj"]
    i, h = first.out_features, first.in_features
    for e in range(num_experts):
        dims = [(x.out_features, x.in_features) for x in (gate[e], up[e], down[e])]
        if dims != [(i, h), (i, h), (h, i)]:
            raise ModelLoadError(f"{prefix}experts.{e}: projection shapes {dims} do not agree")
    try:
        if kind is Fp8BlockWeight:
            return _block_stack(gate, up, down, h, i)
        if kind is Fp8Weight:
            gu = torch.stack([torch.cat([g.weight, u.weight]) for g, u in zip(gate, up, strict=True)])
            gus = torch.stack([torch.cat([g.scale, u.scale]) for g, u in zip(gate, up, strict=True)])
            return ExpertStack(
                "fp8",
                num_experts,
                h,
                i,
                gu,
                torch.stack([d.weight for d in down]),
                gate_up_scales=gus,
                down_scales=torch.stack([d.scale for d in down]),
            )
        every = gate + up + down
        if any(x.mins is not None for x in every):
            raise ModelLoadError(
                f"{prefix}experts: INT4 experts with float offsets (a GPTQ v1 zero point of 16) are not "
                "supported in expert stacks"
            )
        gs, syms = {x.group_size for x in every}, {x.symmetric for x in every}
        if len(gs) != 1 or len(syms) != 1:
            raise ModelLoadError(f"{prefix}experts: INT4 experts mix group sizes {gs} or symmetry {syms}")

        def cat(a: str) -> Tensor | None:
            if getattr(first, a) is None:
                return None
            return torch.stack(
                [torch.cat([getattr(g, a), getattr(u, a)]) for g, u in zip(gate, up, strict=True)]
            )

        def stk(a: str) -> Tensor | None:
            return None if getattr(first, a) is None else torch.stack([getattr(d, a) for d in down])

        return ExpertStack(
            "int4",
            num_experts,
            h,
            i,
            cat("packed"),
            stk("packed"),
            gate_up_scales=cat("scales"),
            gate_up_zeros=cat("zeros"),
            down_scales=stk("scales"),
            down_zeros=stk("zeros"),
            group_size=gs.pop(),
        )
    except ValueError as exc:
        raise ModelLoadError(f"{prefix}experts: {exc}") from exc


def _block_stack(gate: list, up: list, down: list, h: int, i: int):
    """The ``fp8_block`` ExpertStack of per-expert block-scaled projections (gate and up stacked
    by rows with their own scale rows: no value re-rounded)."""
    from pagoda.kernels.moe import ExpertStack

    gus = [concat_block_rows([g, u]) for g, u in zip(gate, up, strict=True)]
    blocks = {x.block for x in gate + up + down}
    if any(g is None for g in gus) or len(blocks) != 1:
        raise ValueError(f"experts mix FP8 block sizes {sorted(blocks)}")
    shapes = {(g.scale.shape, d.scale.shape) for g, d in zip(gus, down, strict=True)}
    if len(shapes) != 1:
        raise ValueError(f"experts have block scales of different shapes {sorted(shapes)}")
    return ExpertStack(
        "fp8_block",
        len(gus),
        h,
        i,
        torch.stack([g.weight for g in gus]),
        torch.stack([d.weight for d in down]),
        gate_up_scales=torch.stack([g.scale for g in gus]),
        down_scales=torch.stack([d.scale for d in down]),
        block=blocks.pop(),
        gate_up_rows=torch.stack([g.row_block for g in gus]),
        down_rows=torch.stack([d.row_block for d in down]),
    )


def dense_experts(stack) -> tuple[Tensor, Tensor, Tensor]:
    """(gate [E, I, H], up [E, I, H], down [E, H, I]) float32, dequantized from an ExpertStack."""
    i = stack.intermediate
    gus, downs = zip(*(stack.dequantize(e) for e in range(stack.num_experts)), strict=True)
    gu = torch.stack(gus)
    return gu[:, :i], gu[:, i:], torch.stack(downs)
