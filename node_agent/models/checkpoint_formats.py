"""Released prequantized Hugging Face checkpoints, read straight into the kernels' weight objects.

Two ``quantization_config`` forms of config.json are understood:

  * DeepSeek-V3 / Kimi FP8 (``quant_method: fp8``, ``fmt: e4m3``, ``weight_block_size [bn, bk]``,
    dynamic activations): ``X.weight`` float8_e4m3fn [N, K] plus ``X.weight_scale_inv`` float32
    [ceil(N/bn), ceil(K/bk)], one scale per block. Kernels' FP8 weights carry one scale per output
    row, so each tensor is requantized per row in float32, ``bn`` rows at a time (never the whole
    model in a wider dtype).
  * compressed-tensors ``pack-quantized`` W4A16 (Kimi K2's INT4 release; symmetric, group-wise):
    ``X.weight_packed`` int32 [N, K/8] (value 8c+i of a row in bits 4i..4i+3 of int32 c, stored
    +8; as compressed-tensors' ``pack_to_int32`` / ``unpack_from_int32`` in
    compressors/quantized_compressors/pack_quantized.py write and read it), ``X.weight_scale``
    [N, K/g], ``X.weight_shape`` [2]. On a little-endian host the int32
    words read as bytes are exactly kernels.int4's canonical packing (value 2j in the low nibble
    of byte j), so the packed tensor is used as is: no unpacking, no float detour.

  * GPTQ (``quant_method: gptq``) and AWQ (``quant_method: awq``, GEMM packing) W4A16: read into
    Int4Weight with integer arithmetic only; see ``gptq_awq``.

Everything else in such a checkpoint (norms, embeddings, unquantized layers) is read as float32.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch import Tensor

from pagoda.kernels.fp8 import Fp8Weight
from pagoda.kernels.fp8_format import FP8_DTYPE, quantize_fp8_weight
from pagoda.kernels.int4 import SUPPORTED_GROUPS, Int4Weight
from pagoda.node_agent.models.config import ModelLoadError
from pagoda.node_agent.models.gptq_awq import AWQ, GPTQ, convert_gptq_awq, parse_awq, parse_gptq

FP8_BLOCK = "fp8_block"
PACK_INT4 = "pack_int4"
# Weights the model reads as plain tensors (embedding, LM head, MoE router, MLA's kv_b_proj whose
# weight is split into per-head views): dequantized if a checkpoint quantized them.
_DENSE_ONLY_SUFFIXES = ("embed_tokens.weight", "lm_head.weight", "mlp.gate.weight", "kv_b_proj.weight")


@dataclass(frozen=True)
class CheckpointQuant:
    """What a checkpoint's ``quantization_config`` asks for, once validated."""

    method: str  # FP8_BLOCK | PACK_INT4 | GPTQ | AWQ
    block: tuple[int, int] = (0, 0)  # FP8: weight_block_size [rows, cols]
    group_size: int = 0  # INT4
    symmetric: bool = True  # GPTQ's sym
    zero_offset: int = 0  # GPTQ v1 stores zero - 1: added back on load


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
    if method == "compressed-tensors":
        return _parse_compressed_tensors(qc)
    if method == GPTQ:
        g, sym, offset = parse_gptq(qc)
        return CheckpointQuant(GPTQ, group_size=g, symmetric=sym, zero_offset=offset)
    if method == AWQ:
        return CheckpointQuant(AWQ, group_size=parse_awq(qc), symmetric=False)
    raise ModelLoadError(
        f"unsupported quantization_config.quant_method {method!r}; supported: 'fp8' (block-scaled "
        "e4m3, DeepSeek-V3 style), 'compressed-tensors' (pack-quantized symmetric INT4 W4A16), "
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


def _parse_compressed_tensors(qc: dict) -> CheckpointQuant:
    fmt = qc.get("format")
    if fmt != "pack-quantized":
        raise ModelLoadError(
            f"unsupported compressed-tensors format {fmt!r}; only 'pack-quantized' (INT4 W4A16) is supported"
        )
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ModelLoadError("compressed-tensors quantization_config has no config_groups")
    sizes = set()
    for name, grp in groups.items():
        if not isinstance(grp, dict):
            raise ModelLoadError(f"compressed-tensors config_groups.{name} must be an object")
        for act in ("input_activations", "output_activations"):
            if grp.get(act) is not None:
                raise ModelLoadError(
                    f"compressed-tensors config_groups.{name}.{act} is set: activation quantization is not "
                    "supported (weight-only W4A16 only)"
                )
        w = grp.get("weights")
        if not isinstance(w, dict):
            raise ModelLoadError(f"compressed-tensors config_groups.{name}.weights must be an object")
        where = f"compressed-tensors config_groups.{name}.weights"
        if w.get("num_bits") != 4:
            raise ModelLoadError(
                f"{where}.num_bits is {w.get('num_bits')!r}; only 4-bit weights are supported"
            )
        if w.get("type", "int") != "int":
            raise ModelLoadError(f"{where}.type is {w.get('type')!r}; only 'int' is supported")
        if w.get("symmetric") is not True:
            raise ModelLoadError(
                f"{where}.symmetric is {w.get('symmetric')!r}; only symmetric INT4 is supported"
            )
        if w.get("strategy") != "group":
            raise ModelLoadError(f"{where}.strategy is {w.get('strategy')!r}; only 'group' is supported")
        if w.get("actorder") not in (None, False):
            raise ModelLoadError(
                f"{where}.actorder is {w.get('actorder')!r}; activation ordering is not supported"
            )
        g = w.get("group_size")
        if g not in SUPPORTED_GROUPS:
            raise ModelLoadError(
                f"{where}.group_size is {g!r}; supported: {', '.join(map(str, SUPPORTED_GROUPS))}"
            )
        sizes.add(g)
    if len(sizes) != 1:
        raise ModelLoadError(f"compressed-tensors config_groups use several group sizes {sorted(sizes)}")
    return CheckpointQuant(PACK_INT4, group_size=sizes.pop())


def convert_checkpoint(weights: dict[str, Tensor], q: CheckpointQuant) -> dict[str, object]:
    """Stored tensors -> weight name -> Int4Weight / Fp8Weight for quantized linears, float32 else."""
    try:
        if q.method == FP8_BLOCK:
            out = _convert_fp8_block(weights, q.block)
        elif q.method in (GPTQ, AWQ):
            quantized, claimed = convert_gptq_awq(weights, q.method, q.group_size, q.symmetric, q.zero_offset)
            out = _plain(weights, claimed)
            out.update(quantized)
        else:
            out = _convert_pack_int4(weights, q.group_size)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc
    for name in [n for n in out if n.endswith(_DENSE_ONLY_SUFFIXES)]:
        if isinstance(out[name], Int4Weight | Fp8Weight):
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
    quantized: dict[str, Fp8Weight] = {}
    for key in weights:
        if not key.endswith(".weight_scale_inv"):
            continue
        name = key.removesuffix("_scale_inv")
        if name not in weights:
            raise ValueError(f"checkpoint has {key} but no {name}")
        quantized[name] = fp8_block_to_fp8_weight(weights[name], weights[key], block, name)
        claimed |= {key, name}
    out = _plain(weights, claimed)
    out.update(quantized)
    return out


def fp8_block_to_fp8_weight(
    w: Tensor, scale_inv: Tensor, block: tuple[int, int], name: str = "weight"
) -> Fp8Weight:
    """A block-scaled e4m3 weight -> per-row-scaled Fp8Weight, requantized in float32 ``bn`` rows at a
    time (each row's scale maps its dequantized amax to 448)."""
    if w.dtype != FP8_DTYPE or w.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D {FP8_DTYPE} weight, got {w.dtype} {tuple(w.shape)}")
    n, k = w.shape
    bn, bk = block
    want = (-(-n // bn), -(-k // bk))
    if tuple(scale_inv.shape) != want:
        raise ValueError(
            f"{name}_scale_inv must be {want} for a {(n, k)} weight in {bn}x{bk} blocks, "
            f"got {tuple(scale_inv.shape)}"
        )
    if not scale_inv.is_floating_point():
        raise ValueError(f"{name}_scale_inv must be floating point, got {scale_inv.dtype}")
    s = scale_inv.float()
    q = torch.empty_like(w)
    rs = torch.empty(n, dtype=torch.float32, device=w.device)
    for b, r0 in enumerate(range(0, n, bn)):
        cols = s[b].repeat_interleave(bk)[:k]
        q[r0 : r0 + bn], rs[r0 : r0 + bn] = quantize_fp8_weight(w[r0 : r0 + bn].float() * cols)
    return Fp8Weight(q, rs)


def _convert_pack_int4(weights: dict[str, Tensor], group_size: int) -> dict[str, object]:
    claimed: set[str] = set()
    quantized: dict[str, Int4Weight] = {}
    for key in weights:
        if not key.endswith(".weight_packed"):
            continue
        base = key.removesuffix(".weight_packed")
        for extra in ("weight_zero_point", "weight_g_idx"):
            if f"{base}.{extra}" in weights:
                raise ValueError(f"{base}.{extra} present: asymmetric / act-ordered INT4 is not supported")
        parts = {p: weights.get(f"{base}.{p}") for p in ("weight_scale", "weight_shape")}
        for p, t in parts.items():
            if t is None:
                raise ValueError(f"checkpoint has {key} but no {base}.{p}")
        quantized[base + ".weight"] = pack_quantized_to_int4(
            weights[key], parts["weight_scale"], parts["weight_shape"], group_size, base
        )
        claimed |= {key, f"{base}.weight_scale", f"{base}.weight_shape"}
    out = _plain(weights, claimed)
    out.update(quantized)
    return out


def pack_quantized_to_int4(
    packed: Tensor, scale: Tensor, shape: Tensor, group_size: int, name: str = "weight"
) -> Int4Weight:
    """compressed-tensors int32 words -> a symmetric Int4Weight viewing the same bytes."""
    if sys.byteorder != "little":
        raise ValueError("pack-quantized INT4 checkpoints are read on little-endian hosts only")
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise ValueError(f"{name}.weight_packed must be 2-D int32, got {packed.dtype} {tuple(packed.shape)}")
    dims = [int(d) for d in shape.reshape(-1).tolist()]
    if len(dims) != 2:
        raise ValueError(f"{name}.weight_shape must hold 2 integers, got {dims}")
    n, k = dims
    if (n, -(-k // 8)) != tuple(packed.shape) or k % 8:
        raise ValueError(
            f"{name}.weight_packed {tuple(packed.shape)} does not hold a {(n, k)} weight (K must be a "
            "multiple of 8, eight values per int32)"
        )
    if k % group_size:
        raise ValueError(f"{name}: group size {group_size} does not divide K={k}")
    if tuple(scale.shape) != (n, k // group_size) or not scale.is_floating_point():
        raise ValueError(
            f"{name}.weight_scale must be floating point {(n, k // group_size)}, got {scale.dtype} "
            f"{tuple(scale.shape)}"
        )
    nibbles = packed.contiguous().view(torch.uint8)  # [N, K/2]: byte j = values 2j (low), 2j+1 (high)
    return Int4Weight(n, k, group_size, True, nibbles, scale.float(), None)


def prequantized_expert_stack(w: dict[str, object], prefix: str, num_experts: int):
    """An ExpertStack in the stored format when ``<prefix>experts.{e}.*_proj.weight`` are all
    Int4Weight (one group size, symmetric or not alike) or all Fp8Weight; None for float tensors."""
    from pagoda.kernels.moe import ExpertStack

    first = w.get(f"{prefix}experts.0.gate_proj.weight")
    if not isinstance(first, Int4Weight | Fp8Weight):
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


def dense_experts(stack) -> tuple[Tensor, Tensor, Tensor]:
    """(gate [E, I, H], up [E, I, H], down [E, H, I]) float32, dequantized from an ExpertStack."""
    i = stack.intermediate
    gus, downs = zip(*(stack.dequantize(e) for e in range(stack.num_experts)), strict=True)
    gu = torch.stack(gus)
    return gu[:, :i], gu[:, i:], torch.stack(downs)
