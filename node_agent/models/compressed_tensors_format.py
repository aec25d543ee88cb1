"""compressed-tensors checkpoints (llmcompressor's output): the config's schemes and the tensors.

``quantization_config`` (``quant_method: compressed-tensors``): ``config_groups`` of schemes, each
with ``targets`` (exact module names, ``re:`` regexes matched from the start of the name, or class
names such as ``Linear``) and ``weights`` arguments; ``ignore`` (the same kinds of entries) lists the
modules left dense. A module takes the most specific target that matches it: exact name, then regex,
then class name (compressed-tensors' own order).

Stored per quantized module ``X`` (``weight [N, K]``, ``G`` groups of ``g`` input channels, or one
per row for ``strategy: channel``):

  * ``pack-quantized``: ``X.weight_packed`` int32 ``[N, ceil(K * b / 32)]``, value ``k`` of a row in
    bits ``b*k .. b*k+b-1`` of the row's words read as one little-endian bit string, stored as
    ``q + 2^(b-1)``; ``X.weight_shape`` ``[N, K]``; ``X.weight_scale`` ``[N, G]``; asymmetric schemes
    add ``X.weight_zero_point``, the signed zero points packed the same way along N (int32
    ``[ceil(N * b / 32), G]``; older releases store them unpacked, int8 ``[N, G]``);
  * ``naive-quantized`` / ``int-quantized``: ``X.weight`` int8 ``[N, K]`` signed values and the same
    scales and zero points (unpacked);
  * act-ordered ``group`` schemes (``actorder: group``) add ``X.weight_g_idx`` ``[K]``, the group of
    each input channel; ``static`` (alias ``weight``) orders columns during calibration only and
    stores plain contiguous groups (no ``g_idx``).

Dequantized weight: ``(q - zero) * scale`` with the signed values (the +2^(b-1) offsets cancel).

What loads as what:
  * 4-bit group schemes (symmetric or with zero points): ``Int4Weight`` viewing the stored nibbles
    (on a little-endian host the int32 words are the canonical nibble bytes); a ``g_idx`` whose runs
    of ``g`` channels each share one group only reorders the groups' scales and zeros;
  * a ``g_idx`` that scatters channels over groups (a real act-order permutation), and every 8-bit
    scheme (W8A16): dequantized exactly in float32 (an 8-bit value times a bf16 / fp16 scale is exact
    there). No phase weight format holds INT8 linears (``int8`` serves the decode LM head only), so
    such layers run in their phase's format from the exact values.

Refused at load, naming the field and its value: activation or KV-cache quantization, float types,
bit widths other than 4 and 8, strategies other than group and channel (4-bit: group only, of 32,
64, 128 or 256), asymmetric 8-bit, dynamic weights, a ``quantization_status`` other than compressed,
and a quantized tensor of a module that the ``ignore`` list names or that no target matches.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass

import torch
from torch import Tensor

from pagoda.kernels.int4 import SUPPORTED_GROUPS, Int4Weight, pack_nibbles
from pagoda.node_agent.models.config import ModelLoadError

FORMATS = ("pack-quantized", "naive-quantized", "int-quantized")
_ACTORDER = {
    None: None,
    False: None,
    "static": "static",
    "weight": "static",
    "group": "group",
    "dynamic": "group",
}
_EXPERT = re.compile(r"^(.*\.experts\.)\d+\.(?:gate|up|down)_proj\.weight$")


@dataclass(frozen=True)
class Scheme:
    """One config group's weight arguments, validated."""

    name: str
    fmt: str  # one of FORMATS
    bits: int  # 4 | 8
    symmetric: bool
    group_size: int  # 0 for strategy "channel"
    actorder: str | None  # None | "static" | "group"
    targets: tuple[str, ...]


@dataclass(frozen=True)
class CtConfig:
    schemes: tuple[Scheme, ...]
    ignore: tuple[str, ...]


def _refuse(where: str, field: str, value, why: str) -> ModelLoadError:
    return ModelLoadError(f"compressed-tensors {where}.{field} is {value!r}: {why}")


def parse_compressed_tensors(qc: dict) -> CtConfig:
    """The validated schemes and ignore list of a compressed-tensors ``quantization_config``."""
    top = qc.get("format")
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise _refuse("quantization_config", "quantization_status", status, "only 'compressed' is read")
    if qc.get("kv_cache_scheme") is not None:
        raise _refuse(
            "quantization_config", "kv_cache_scheme", qc["kv_cache_scheme"], "KV-cache scales are not read"
        )
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ModelLoadError("compressed-tensors quantization_config has no config_groups")
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
        raise ModelLoadError(
            f"compressed-tensors quantization_config.ignore must be a list of strings, got {ignore!r}"
        )
    schemes = tuple(_parse_group(name, grp, top) for name, grp in groups.items())
    return CtConfig(schemes, tuple(ignore))


def _parse_group(name: str, grp, top) -> Scheme:
    where = f"config_groups.{name}"
    if not isinstance(grp, dict):
        raise ModelLoadError(f"compressed-tensors {where} must be an object")
    fmt = grp.get("format") or top
    if fmt not in FORMATS:
        raise _refuse(
            where if grp.get("format") else "quantization_config",
            "format",
            fmt,
            "only 'pack-quantized' (and the unpacked 'naive-quantized') integer weights are supported",
        )
    for act in ("input_activations", "output_activations"):
        if grp.get(act) is not None:
            raise _refuse(where, act, grp[act], "activation quantization is not supported (weight-only only)")
    targets = grp.get("targets")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise ModelLoadError(f"compressed-tensors {where}.targets must be a non-empty list of strings")
    w = grp.get("weights")
    if not isinstance(w, dict):
        raise ModelLoadError(f"compressed-tensors {where}.weights must be an object")
    where += ".weights"
    bits, sym = w.get("num_bits"), w.get("symmetric", True)
    if bits not in (4, 8) or isinstance(bits, bool):
        raise _refuse(where, "num_bits", bits, "only 4-bit (W4A16) and 8-bit (W8A16) weights are supported")
    if w.get("type", "int") != "int":
        raise _refuse(where, "type", w.get("type"), "only 'int' is supported")
    if not isinstance(sym, bool):
        raise _refuse(where, "symmetric", sym, "must be true or false")
    if bits == 8 and not sym:
        raise _refuse(where, "symmetric", sym, "asymmetric 8-bit weights are not supported")
    if w.get("dynamic", False) is not False:
        raise _refuse(where, "dynamic", w.get("dynamic"), "weights must be static")
    strategy = w.get("strategy") or ("group" if (w.get("group_size") or 0) > 0 else None)
    g = w.get("group_size")
    if strategy == "channel" and bits == 8:
        g = 0
    elif strategy != "group":
        why = "4-bit weights need 'group'" if strategy == "channel" else "only 'group' (and 8-bit 'channel')"
        raise _refuse(where, "strategy", strategy, why + " is supported")
    elif bits == 4 and g not in SUPPORTED_GROUPS:
        raise _refuse(where, "group_size", g, f"supported: {', '.join(map(str, SUPPORTED_GROUPS))}")
    elif not isinstance(g, int) or isinstance(g, bool) or g <= 0:
        raise _refuse(where, "group_size", g, "must be a positive integer")
    raw = w.get("actorder")
    order = "group" if raw is True else raw  # true meant group in older releases
    if not (order is None or order is False or (isinstance(order, str) and order in _ACTORDER)):
        raise _refuse(where, "actorder", raw, "supported: null, 'static' (alias 'weight'), 'group'")
    return Scheme(name, fmt, bits, sym, g, _ACTORDER[order], tuple(targets))


# ---------------------------------------------------------------- which scheme a module has


def _is_class(target: str) -> bool:
    return not target.startswith("re:") and "." not in target and target[:1].isupper()


def _matches(name: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


def match_rank(name: str, targets: tuple[str, ...]) -> int | None:
    """0 exact name, 1 regex, 2 class name (any linear layer here); None when nothing matches."""
    ranks = [0 if t == name else 1 for t in targets if not _is_class(t) and _matches(name, t)]
    if ranks:
        return min(ranks)
    return 2 if any(_is_class(t) for t in targets) else None


def ignored_by(name: str, ignore: tuple[str, ...]) -> str | None:
    """The ``ignore`` entry naming module ``name`` (class-name entries never match a name here)."""
    return next((i for i in ignore if not _is_class(i) and _matches(name, i)), None)


def scheme_of(base: str, cfg: CtConfig) -> Scheme:
    entry = ignored_by(base, cfg.ignore)
    if entry is not None:
        raise ValueError(
            f"{base} is stored quantized but quantization_config.ignore lists it ({entry!r}): the "
            "checkpoint and its config disagree"
        )
    ranked = [(r, i) for i, s in enumerate(cfg.schemes) if (r := match_rank(base, s.targets)) is not None]
    if not ranked:
        raise ValueError(f"{base} is stored quantized but matches no compressed-tensors config_groups target")
    return cfg.schemes[min(ranked)[1]]


# ---------------------------------------------------------------- tensors


def _get(weights: dict[str, Tensor], base: str, part: str) -> Tensor:
    t = weights.get(f"{base}.{part}")
    if t is None:
        raise ValueError(f"{base}: the checkpoint has no {base}.{part}")
    return t


def unpack_rows(words: Tensor, bits: int, cols: int) -> Tensor:
    """int32 ``[R, W]`` packed ``bits``-bit values (offset by 2^(bits-1)) -> signed int16 ``[R, cols]``."""
    if sys.byteorder != "little":
        raise ValueError("compressed-tensors checkpoints are read on little-endian hosts only")
    raw = words.contiguous().view(torch.uint8)
    if bits == 8:
        vals = raw[:, :cols].to(torch.int16)
    else:
        vals = torch.stack([raw & 0xF, raw >> 4], dim=-1).reshape(raw.shape[0], -1)[:, :cols].to(torch.int16)
    return vals - (1 << (bits - 1))


def _values(
    weights: dict[str, Tensor], base: str, s: Scheme
) -> tuple[Tensor | None, Tensor, int, int, set[str]]:
    """(the stored nibble bytes when usable as is, signed values int16 [N, K], N, K, names used)."""
    if s.fmt == "pack-quantized":
        packed, shape = _get(weights, base, "weight_packed"), _get(weights, base, "weight_shape")
        dims = [int(d) for d in shape.reshape(-1).tolist()]
        if len(dims) != 2:
            raise ValueError(f"{base}.weight_shape must hold 2 integers, got {dims}")
        n, k = dims
        want = (n, -(-k * s.bits // 32))
        if packed.dtype != torch.int32 or tuple(packed.shape) != want:
            raise ValueError(
                f"{base}.weight_packed must be int32 {want} for a {(n, k)} weight of {s.bits}-bit values, "
                f"got {packed.dtype} {tuple(packed.shape)}"
            )
        nibbles = packed.contiguous().view(torch.uint8) if s.bits == 4 and k % 8 == 0 else None
        return (
            nibbles,
            unpack_rows(packed, s.bits, k),
            n,
            k,
            {f"{base}.{p}" for p in ("weight_packed", "weight_shape")},
        )
    q = _get(weights, base, "weight")
    if q.dtype != torch.int8 or q.dim() != 2:
        raise ValueError(f"{base}.weight must be a 2-D int8 tensor ({s.fmt}), got {q.dtype} {tuple(q.shape)}")
    lim = 1 << (s.bits - 1)
    if bool(((q < -lim) | (q >= lim)).any()):
        raise ValueError(f"{base}.weight holds values outside the {s.bits}-bit range")
    return None, q.to(torch.int16), q.shape[0], q.shape[1], {f"{base}.weight"}


def _zeros(
    weights: dict[str, Tensor], base: str, s: Scheme, n: int, groups: int
) -> tuple[Tensor | None, set[str]]:
    """Signed zero points int16 [N, G] (None for symmetric schemes) and the names used."""
    key = f"{base}.weight_zero_point"
    zp = weights.get(key)
    if s.symmetric:
        if zp is not None and bool((zp != 0).any()):
            raise ValueError(f"{key}: the scheme is symmetric but zero points are not 0")
        return None, {key} if zp is not None else set()
    if zp is None:
        raise ValueError(f"{base}: the scheme is asymmetric but the checkpoint has no {key}")
    if zp.dtype == torch.int32 and tuple(zp.shape) == (-(-n * s.bits // 32), groups):
        return unpack_rows(zp.t(), s.bits, n).t(), {key}  # packed along N
    if not zp.is_floating_point() and tuple(zp.shape) == (n, groups):
        return zp.to(torch.int16), {key}
    raise ValueError(
        f"{key} must be int32 {(-(-n * s.bits // 32), groups)} (packed) or int8 {(n, groups)}, got "
        f"{zp.dtype} {tuple(zp.shape)}"
    )


def group_runs(name: str, g_idx: Tensor, k: int, g: int) -> tuple[str, Tensor | None]:
    """How a ``g_idx`` maps channels to groups: ("trivial", None), ("runs", the group of each run of
    g channels) or ("scatter", g_idx as int64)."""
    if g_idx.dim() != 1 or g_idx.numel() != k or g_idx.is_floating_point():
        raise ValueError(
            f"{name} must be an integer vector of {k} entries, got {g_idx.dtype} {tuple(g_idx.shape)}"
        )
    idx = g_idx.long()
    if bool(((idx < 0) | (idx >= k // g)).any()):
        raise ValueError(f"{name} holds group indices outside 0..{k // g - 1}")
    runs = idx.reshape(k // g, g)
    if torch.equal(idx, torch.arange(k) // g):
        return "trivial", None
    if bool((runs == runs[:, :1]).all()):
        return "runs", runs[:, 0].contiguous()
    return "scatter", idx


def convert_module(weights: dict[str, Tensor], base: str, s: Scheme) -> tuple[Int4Weight | Tensor, set[str]]:
    """One quantized module -> (Int4Weight, or the exact float32 dequantization), names consumed."""
    nibbles, q, n, k, used = _values(weights, base, s)
    g = s.group_size or k
    if k % g:
        raise ValueError(f"{base}: group size {g} does not divide K={k}")
    scale = _get(weights, base, "weight_scale")
    if not scale.is_floating_point() or tuple(scale.shape) != (n, k // g):
        raise ValueError(
            f"{base}.weight_scale must be floating point {(n, k // g)}, got {scale.dtype} {tuple(scale.shape)}"
        )
    used.add(f"{base}.weight_scale")
    zeros, zused = _zeros(weights, base, s, n, k // g)
    used |= zused
    scale = scale.float()
    kind, order = "trivial", None
    gkey = f"{base}.weight_g_idx"
    if gkey in weights:
        used.add(gkey)
        kind, order = group_runs(gkey, weights[gkey], k, g)
    elif s.actorder == "group":
        raise ValueError(f"{base}: actorder is 'group' but the checkpoint has no {gkey}")
    if kind == "runs":
        scale = scale[:, order].contiguous()
        zeros = None if zeros is None else zeros[:, order].contiguous()
    if s.bits == 4 and kind != "scatter":
        if nibbles is None:
            nibbles = pack_nibbles((q + 8).to(torch.uint8)).contiguous()
        z = None if zeros is None else (zeros + 8).to(torch.uint8).contiguous()
        return Int4Weight(n, k, g, s.symmetric, nibbles, scale.contiguous(), z), used
    idx = order if kind == "scatter" else torch.arange(k) // g
    zq = 0 if zeros is None else zeros.float()[:, idx]
    return (q.float() - zq) * scale[:, idx], used


def convert_compressed_tensors(
    weights: dict[str, Tensor], cfg: CtConfig
) -> tuple[dict[str, object], set[str]]:
    """Every quantized module of a checkpoint -> ``X.weight``; also the stored names consumed."""
    out: dict[str, object] = {}
    claimed: set[str] = set()
    bases = [k.removesuffix(".weight_packed") for k in weights if k.endswith(".weight_packed")]
    bases += [
        k.removesuffix(".weight") for k in weights if k.endswith(".weight") and weights[k].dtype == torch.int8
    ]
    for base in bases:
        w, used = convert_module(weights, base, scheme_of(base, cfg))
        out[base + ".weight"] = w
        claimed |= used
    for key in weights:
        if key.endswith((".weight_scale", ".weight_zero_point", ".weight_g_idx")) and key not in claimed:
            raise ValueError(f"checkpoint has {key} but no quantized {key.rsplit('.', 1)[0]}")
    _uniform_experts(out)
    return out, claimed


def _uniform_experts(out: dict[str, object]) -> None:
    """Experts of one layer load in one kind: where some came back dense (a scattering g_idx), the
    layer's INT4 experts are dequantized too (exactly)."""
    layers: dict[str, list[str]] = {}
    for name in out:
        m = _EXPERT.match(name)
        if m:
            layers.setdefault(m.group(1), []).append(name)
    for names in layers.values():
        kinds = {isinstance(out[n], Int4Weight) for n in names}
        if len(kinds) > 1:
            for n in names:
                if isinstance(out[n], Int4Weight):
                    out[n] = out[n].dequantize()
