"""ctypes wrapper of ``cpu_fp8.c``: e4m3 weight codes to float32 ``value * 2**-120`` in one native pass.

``fp8_rows_scaled_down`` decodes into a per-thread scratch buffer that is reused across calls (so a
step's many weight blocks pay no allocation or page faults) and returns None when the native library
is unavailable (``cpu_int4_native.status``) or switched off, in which case the caller decodes with torch ops.
"""

from __future__ import annotations

import ctypes
import threading

import torch
from torch import Tensor

from .cpu_int4_native import library
from .switches import switch_on

_scratch = threading.local()


def _lib() -> ctypes.CDLL | None:
    lib = library()
    if lib is None or getattr(lib, "pagoda_fp8_ready", False):
        return lib
    lib.pagoda_fp8_to_f32_scaled_down.restype = None
    lib.pagoda_fp8_to_f32_scaled_down.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    lib.pagoda_fp8_ready = True
    return lib


def available() -> bool:
    """The library is built and ``PAGODA_NATIVE_FP8`` is not ``0`` (read per call)."""
    return switch_on("native_fp8") and _lib() is not None


def fp8_rows_scaled_down(raw: Tensor) -> Tensor | None:
    """Contiguous CPU uint8 codes ``[R, K]`` -> float32 ``[R, K]`` reading ``value * 2**-120``.

    The result is a view of this thread's scratch buffer: valid until the thread's next call.
    """
    lib = _lib() if switch_on("native_fp8") else None
    if lib is None or raw.dtype != torch.uint8 or not raw.is_cpu or not raw.is_contiguous():
        return None
    n = raw.numel()
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < n:
        buf = _scratch.buf = torch.empty(n, dtype=torch.float32)
    out = buf[:n].view(raw.shape)
    lib.pagoda_fp8_to_f32_scaled_down(raw.data_ptr(), n, out.data_ptr())
    return out
