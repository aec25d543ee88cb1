"""GPTQ and AWQ W4A16 checkpoints (Hugging Face directories) read straight into ``Int4Weight``.

On-disk layouts (per linear ``X`` with weight ``[N, K]``, groups of ``g`` input channels, ``G = K/g``):

  * GPTQ (AutoGPTQ / GPTQModel, ``checkpoint_format`` ``gptq`` or ``gptq_v2``): ``X.qweight`` int32
    ``[K/8, N]`` with input channel ``8r+i`` of column ``n`` in bits ``4i..4i+3`` of word ``[r, n]``;
    ``X.qzeros`` int32 ``[G, N/8]`` with the zero of output ``8c+i`` in bits ``4i..`` of word
    ``[G, c]``; ``X.scales`` float16 ``[G, N]``; ``X.g_idx`` int32 ``[K]`` (the group of each input
    channel). ``gptq`` (v1, the historical default) stores ``zero - 1``; ``gptq_v2`` stores the zero.
  * AWQ (AutoAWQ ``gemm``): ``X.qweight`` int32 ``[K, N/8]`` and ``X.qzeros`` int32 ``[G, N/8]``,
    both packed along N in AWQ's interleaved order (bits ``4i..`` of word ``c`` hold output
    ``8c + AWQ_ORDER[i]``); ``X.scales`` float16 ``[G, N]``; no offset on the zeros.

Dequantized weight: ``(q - zero) * scale``. Both become ``Int4Weight`` with integer arithmetic only:
GPTQ's ``qweight`` transposed and read as bytes (little-endian) is already the canonical nibble
packing (channel 2j in the low nibble of byte j); AWQ's nibbles are reordered and repacked.
A GPTQ v1 zero of 16 (stored nibble 15, an asymmetric group whose minimum sat at the grid's top)
does not fit a 0..15 zero point: such a weight keeps float offsets ``min = -16 * scale``, which is
exact for float16 scales. ``sym: true`` weights (every zero 8) load symmetric.

Act-order (``desc_act``): the kernels need contiguous groups. A ``g_idx`` whose every run of ``g``
consecutive channels shares one group loads exactly (the groups' scales and zeros are reordered);
any other assignment (a real act-order permutation) is refused with a clear error.
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor

from pagoda.kernels.int4 import SUPPORTED_GROUPS, Int4Weight, pack_nibbles
from pagoda.node_agent.models.config import ModelLoadError

GPTQ = "gptq"
AWQ = "awq"
# AutoAWQ's pack order: nibble i of a word holds output column 8c + AWQ_ORDER[i].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def _field(qc: dict, *names: str, default=None):
    for n in names:
        if n in qc:
            return qc[n]
    return default


def check_bits_and_group(qc: dict, method: str) -> int:
    """The validated group size of a GPTQ / AWQ ``quantization_config`` (4 bits only)."""
    bits = _field(qc, "bits", "w_bit")
    if bits != 4 or isinstance(bits, bool):
        raise ModelLoadError(
            f"{method} quantization_config.bits is {bits!r}; only 4-bit {method.upper()} is supported"
        )
    g = _field(qc, "group_size", "q_group_size")
    if g not in SUPPORTED_GROUPS or isinstance(g, bool):
        raise ModelLoadError(
            f"{method} quantization_config.group_size is {g!r}; supported: "
            f"{', '.join(map(str, SUPPORTED_GROUPS))} (per-channel -1 is not)"
        )
    return g


def parse_gptq(qc: dict) -> tuple[int, bool, int]:
    """(group size, symmetric, zero offset) of a GPTQ config; offset 1 for the v1 ``zero - 1``."""
    g = check_bits_and_group(qc, GPTQ)
    if qc.get("is_marlin_format"):
        raise ModelLoadError(
            "gptq quantization_config.is_marlin_format is true: Marlin repacking is not read"
        )
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ModelLoadError(
            f"gptq quantization_config.checkpoint_format is {fmt!r}; supported: 'gptq' (v1, zero - 1 "
            "stored) and 'gptq_v2'"
        )
    sym = qc.get("sym", True)
    if not isinstance(sym, bool):
        raise ModelLoadError(f"gptq quantization_config.sym must be true or false, got {sym!r}")
    desc = qc.get("desc_act", False)
    if not isinstance(desc, bool):
        raise ModelLoadError(f"gptq quantization_config.desc_act must be true or false, got {desc!r}")
    return g, sym, 1 if fmt == "gptq" else 0


def parse_awq(qc: dict) -> int:
    """The group size of an AWQ config (GEMM packing, zero points, AutoAWQ's layout)."""
    g = check_bits_and_group(qc, AWQ)
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ModelLoadError(
            f"awq quantization_config.version is {qc.get('version')!r}; only 'gemm' packing is supported"
        )
    if qc.get("zero_point", True) is not True:
        raise ModelLoadError(
            f"awq quantization_config.zero_point is {qc.get('zero_point')!r}; only zero-point AWQ is supported"
        )
    backend = qc.get("backend", "autoawq")
    if backend not in ("autoawq", None):
        raise ModelLoadError(
            f"awq quantization_config.backend is {backend!r}; only AutoAWQ's layout ('autoawq') is supported"
        )
    return g


def _unpack_words(words: Tensor) -> Tensor:
    """int32 [..., C] -> int32 [..., C, 8]: nibble i of each word (bits 4i..4i+3)."""
    return (words.unsqueeze(-1) >> _SHIFTS) & 0xF


def _need(weights: dict[str, Tensor], base: str, part: str) -> Tensor:
    t = weights.get(f"{base}.{part}")
    if t is None:
        raise ValueError(f"checkpoint has {base}.qweight but no {base}.{part}")
    return t


def _check_int32(name: str, t: Tensor, shape: tuple[int, int]) -> None:
    if t.dtype != torch.int32 or tuple(t.shape) != shape:
        raise ValueError(f"{name} must be int32 {shape}, got {t.dtype} {tuple(t.shape)}")


def _scales(name: str, s: Tensor, g_count: int, n: int) -> Tensor:
    if not s.is_floating_point() or tuple(s.shape) != (g_count, n):
        raise ValueError(f"{name} must be floating point {(g_count, n)}, got {s.dtype} {tuple(s.shape)}")
    return s.t().float().contiguous()  # [N, G]


def _group_order(name: str, g_idx: Tensor, k: int, g: int) -> Tensor | None:
    """None for the trivial ``g_idx`` (channel k in group k // g); else, when every run of g channels
    shares one group, the group of each run (scales/zeros are reordered by it)."""
    if g_idx.dim() != 1 or g_idx.numel() != k or g_idx.is_floating_point():
        raise ValueError(
            f"{name} must be an integer vector of {k} entries, got {g_idx.dtype} {tuple(g_idx.shape)}"
        )
    runs = g_idx.long().reshape(k // g, g)
    if bool((runs == (torch.arange(k) // g).reshape(k // g, g)).all()):
        return None
    if not bool((runs == runs[:, :1]).all()):
        raise ValueError(
            f"{name} is a real act-order (desc_act) permutation: input channels are not in contiguous "
            f"groups of {g}, which the INT4 kernels need; requantize with desc_act=false or static_groups=true"
        )
    order = runs[:, 0]
    if bool(((order < 0) | (order >= k // g)).any()):
        raise ValueError(f"{name} holds group indices outside 0..{k // g - 1}")
    return order


def _int4_from_zeros(
    name: str, n: int, k: int, g: int, packed: Tensor, scales: Tensor, zeros: Tensor, sym: bool
) -> Int4Weight:
    """Integer zeros [N, G] (0..16) -> Int4Weight: symmetric when told, float mins for a zero of 16."""
    if sym:
        if not bool((zeros == 8).all()):
            bad = sorted(set(zeros.unique().tolist()) - {8})[:4]
            raise ValueError(
                f"{name}.qzeros: sym is true but zero points {bad} are not 8; does the config's "
                "checkpoint_format (v1 stores zero - 1) match the file?"
            )
        return Int4Weight(n, k, g, True, packed, scales, None)
    if int(zeros.max()) <= 15:
        return Int4Weight(n, k, g, False, packed, scales, zeros.to(torch.uint8).contiguous())
    return Int4Weight(n, k, g, False, packed, scales, None, mins=(-zeros.float() * scales).contiguous())


def gptq_to_int4(
    weights: dict[str, Tensor], base: str, g: int, sym: bool, zero_offset: int
) -> tuple[Int4Weight, set[str]]:
    """One GPTQ linear ``base`` -> (Int4Weight, the stored tensor names it consumed)."""
    if sys.byteorder != "little":
        raise ValueError("GPTQ checkpoints are read on little-endian hosts only")
    qweight, qzeros, scales = (_need(weights, base, p) for p in ("qweight", "qzeros", "scales"))
    if scales.dim() != 2 or qweight.dim() != 2:
        raise ValueError(
            f"{base}: qweight and scales must be 2-D, got {tuple(qweight.shape)} {tuple(scales.shape)}"
        )
    n, k = scales.shape[1], qweight.shape[0] * 8
    if k % g or n % 8:
        raise ValueError(f"{base}: K={k} must be a multiple of group {g} and N={n} of 8")
    _check_int32(f"{base}.qweight", qweight, (k // 8, n))
    _check_int32(f"{base}.qzeros", qzeros, (k // g, n // 8))
    s = _scales(f"{base}.scales", scales, k // g, n)
    packed = qweight.t().contiguous().view(torch.uint8)  # [N, K/2]: channel 2j low nibble of byte j
    zeros = (_unpack_words(qzeros).reshape(k // g, n) + zero_offset).t().contiguous()  # [N, G]
    used = {f"{base}.{p}" for p in ("qweight", "qzeros", "scales")}
    if f"{base}.g_idx" in weights:
        used.add(f"{base}.g_idx")
        order = _group_order(f"{base}.g_idx", weights[f"{base}.g_idx"], k, g)
        if order is not None:
            s, zeros = s[:, order].contiguous(), zeros[:, order].contiguous()
    return _int4_from_zeros(base, n, k, g, packed, s, zeros, sym), used


def _awq_columns(words: Tensor) -> Tensor:
    """AWQ-packed int32 [R, N/8] -> int32 [R, N] values in output-column order."""
    nib = _unpack_words(words)  # [R, N/8, 8], nibble i = column 8c + AWQ_ORDER[i]
    cols = torch.empty_like(nib)
    cols[..., list(AWQ_ORDER)] = nib
    return cols.reshape(words.shape[0], -1)


def awq_to_int4(weights: dict[str, Tensor], base: str, g: int) -> tuple[Int4Weight, set[str]]:
    """One AWQ (GEMM) linear ``base`` -> (Int4Weight, the stored tensor names it consumed)."""
    qweight, qzeros, scales = (_need(weights, base, p) for p in ("qweight", "qzeros", "scales"))
    if scales.dim() != 2 or qweight.dim() != 2:
        raise ValueError(
            f"{base}: qweight and scales must be 2-D, got {tuple(qweight.shape)} {tuple(scales.shape)}"
        )
    n, k = scales.shape[1], qweight.shape[0]
    if k % g or n % 8:
        raise ValueError(f"{base}: K={k} must be a multiple of group {g} and N={n} of 8")
    _check_int32(f"{base}.qweight", qweight, (k, n // 8))
    _check_int32(f"{base}.qzeros", qzeros, (k // g, n // 8))
    s = _scales(f"{base}.scales", scales, k // g, n)
    packed = pack_nibbles(_awq_columns(qweight).t())  # [N, K] values -> canonical [N, K/2]
    zeros = _awq_columns(qzeros).t().contiguous()
    used = {f"{base}.{p}" for p in ("qweight", "qzeros", "scales")}
    return _int4_from_zeros(base, n, k, g, packed.contiguous(), s, zeros, False), used


def convert_gptq_awq(
    weights: dict[str, Tensor], method: str, g: int, sym: bool = True, zero_offset: int = 0
) -> tuple[dict[str, Int4Weight], set[str]]:
    """Every ``X.qweight`` of a checkpoint -> ``X.weight`` Int4Weight; also the consumed names."""
    out: dict[str, Int4Weight] = {}
    claimed: set[str] = set()
    for key in weights:
        if not key.endswith(".qweight"):
            continue
        base = key.removesuffix(".qweight")
        if method == GPTQ:
            w, used = gptq_to_int4(weights, base, g, sym, zero_offset)
        else:
            w, used = awq_to_int4(weights, base, g)
        out[base + ".weight"] = w
        claimed |= used
    for key in weights:
        if key.endswith((".qzeros", ".scales", ".g_idx")) and key not in claimed:
            raise ValueError(f"checkpoint has {key} but no {key.rsplit('.', 1)[0]}.qweight")
    return out, claimed
