"""GGUF quantized blocks read straight into the engine's INT4 layout, without a float detour.

ggml's 32-weight blocks (``d`` and ``m`` are float16):

* Q4_0: ``d``, 16 bytes of nibbles; ``w = (q - 8) * d``: a symmetric INT4 group of 32;
* Q4_1: ``d``, ``m``, 16 bytes of nibbles; ``w = q * d + m``: INT4 group 32 with a float zero;

Inside a block, byte ``j`` holds weight ``j`` in its low nibble and weight ``j + 16`` in its high
one. Scales and mins widen exactly to float32. Every other type (Q8_0, K-quants, floats) is
dequantized by the ``gguf`` package as before; see :data:`EXACT_INT4_TYPES`.
"""

from __future__ import annotations

import numpy as np
import torch

from pagoda.kernels.int4 import Int4Weight, pack_nibbles

BLOCK = 32
EXACT_INT4_TYPES = ("Q4_0", "Q4_1")
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] ggml block bytes -> [..., 32] values 0..15 in weight order."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def int4_from_gguf(type_name: str, data: np.ndarray, rows: int, cols: int) -> Int4Weight:
    """One Q4_0 / Q4_1 tensor (raw block bytes [rows, cols // 32 * block bytes]) -> Int4Weight."""
    if type_name not in _BLOCK_BYTES:
        raise ValueError(f"{type_name} is not an INT4-exact GGUF type ({', '.join(EXACT_INT4_TYPES)})")
    if cols % BLOCK:
        raise ValueError(f"{type_name} rows of {cols} weights are not whole 32-weight blocks")
    groups = cols // BLOCK
    raw = np.ascontiguousarray(data, dtype=np.uint8).reshape(rows, groups, _BLOCK_BYTES[type_name])
    scales = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if type_name == "Q4_0":
        q = _nibbles(raw[..., 2:18]).reshape(rows, cols)
        packed = pack_nibbles(torch.from_numpy(q))
        return Int4Weight(rows, cols, BLOCK, True, packed, torch.from_numpy(scales), None)
    mins = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    q = _nibbles(raw[..., 4:20]).reshape(rows, cols)
    packed = pack_nibbles(torch.from_numpy(q))
    return Int4Weight(
        rows, cols, BLOCK, False, packed, torch.from_numpy(scales), None, torch.from_numpy(mins)
    )


def permute_rows(w: Int4Weight, order: torch.Tensor) -> Int4Weight:
    """The same weight with its output rows reordered (``order[i]`` = source row of row ``i``)."""
    return Int4Weight(
        w.out_features,
        w.in_features,
        w.group_size,
        w.symmetric,
        w.packed[order].contiguous(),
        w.scales[order].contiguous(),
        None if w.zeros is None else w.zeros[order].contiguous(),
        None if w.mins is None else w.mins[order].contiguous(),
    )


def unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaved-RoPE row permutation of q/k weights (back to HF layout)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
