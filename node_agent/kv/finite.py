"""The value check of KV pages that arrive from another process: finite, and within a format's range.

A handoff's pages are model state another process computed; a NaN, an infinity or an absurd
magnitude in them poisons every attention step that reads them. ``bad_values`` checks a whole
buffer of pages at once (a few vectorized passes over bounded chunks, no per-page loop):

* floating pages (float32, bfloat16, float16): every value finite and ``|x| <= max_abs``;
* float8 pages: no NaN encoding (their finite values are bounded by the format itself, and their
  scales are checked on their own);
* integer pages (int8): every byte pattern is a value; the scales carry the range.
"""

from __future__ import annotations

import torch

DEFAULT_MAX_ABS = 65504.0  # the largest float16 value: no model that runs in float16 holds more
CHUNK_BYTES = 16 << 20  # bounded scratch memory per pass
NON_FINITE, OUT_OF_RANGE = "non_finite", "out_of_range"

# float8 encodings that are NaN (or infinity): (mask, pattern) on the byte
_FP8_SPECIAL = {
    torch.float8_e4m3fn: (0x7F, 0x7F),  # S.1111.111 is NaN; e4m3fn has no infinity
    torch.float8_e5m2: (0x7C, 0x7C),  # exponent all ones: infinity or NaN
}


def bad_values(values: torch.Tensor, max_abs: float = DEFAULT_MAX_ABS) -> str | None:
    """None when every value of ``values`` is acceptable KV state, else ``NON_FINITE`` or
    ``OUT_OF_RANGE`` (NaN and infinities count as non-finite)."""
    flat = values.reshape(-1)
    if flat.numel() == 0:
        return None
    step = max(1, CHUNK_BYTES // flat.element_size())
    for start in range(0, flat.numel(), step):
        why = _bad_chunk(flat[start : start + step], max_abs)
        if why is not None:
            return why
    return None


def _bad_chunk(x: torch.Tensor, max_abs: float) -> str | None:
    if x.dtype in _FP8_SPECIAL:
        mask, pattern = _FP8_SPECIAL[x.dtype]
        return NON_FINITE if bool(((x.view(torch.uint8) & mask) == pattern).any()) else None
    if not x.dtype.is_floating_point:
        return None
    if bool((x.abs() <= max_abs).all()):  # one pass: NaN compares false, so it fails here too
        return None
    return NON_FINITE if not bool(torch.isfinite(x).all()) else OUT_OF_RANGE
