"""ctypes wrappers of ``cpu_fp8.c``: the fused FP8 GEMM for few activation rows, and e4m3 weight codes to
their float32 values in one native pass for the rest.

``available`` is the gate (the library built, ``PAGODA_NATIVE_FP8`` not ``0``), asked once per GEMM by
kernels/fp8.py. ``fp8_gemm_f32`` multiplies float32 activations by the codes decoded in registers and
returns None when the kernel cannot run (no library, a shape it does not take, built without AVX-512 F:
probed once when the library is typed). ``fp8_rows_f32`` decodes into a per-thread scratch buffer that
is reused across calls (so a step's many weight blocks pay no allocation or page faults) and returns
None without the library (``cpu_int4_native.status``); the caller then decodes with torch ops.
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
    lib.pagoda_fp8_to_f32.restype = None
    lib.pagoda_fp8_to_f32.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    lib.pagoda_fp8_gemm_f32.restype = ctypes.c_int
    lib.pagoda_fp8_gemm_f32.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.pagoda_fp8_gemm_f32.argtypes += [ctypes.c_int64, ctypes.c_void_p]
    x, y = torch.zeros(1, 16), torch.empty(1, 1)  # rc 5: built without AVX-512 F
    lib.pagoda_fp8_fused = lib.pagoda_fp8_gemm_f32(x.data_ptr(), 1, 16, bytes(16), 1, y.data_ptr()) == 0
    lib.pagoda_fp8_ready = True
    return lib


def available() -> bool:
    """The library is built and ``PAGODA_NATIVE_FP8`` is not ``0`` (read per call)."""
    return switch_on("native_fp8") and _lib() is not None


def fp8_rows_f32(raw: Tensor) -> Tensor | None:
    """Contiguous CPU uint8 e4m3 codes ``[R, K]`` -> their float32 values ``[R, K]``.

    The result is a view of this thread's scratch buffer: valid until the thread's next call.
    """
    lib = _lib()
    if lib is None or raw.dtype != torch.uint8 or not raw.is_cpu or not raw.is_contiguous():
        return None
    n = raw.numel()
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < n:
        buf = _scratch.buf = torch.empty(n, dtype=torch.float32)
    out = buf[:n].view(raw.shape)
    lib.pagoda_fp8_to_f32(raw.data_ptr(), n, out.data_ptr())
    return out


def fp8_gemm_f32(x: Tensor, raw: Tensor) -> Tensor | None:
    """float32 ``x [M, K]`` @ the values of the e4m3 codes ``raw [N, K]``, transposed -> float32 ``[M, N]``."""
    lib = _lib()
    if lib is None or not lib.pagoda_fp8_fused:
        return None
    ok = x.dtype == torch.float32 and x.dim() == 2 and x.is_cpu and x.is_contiguous()
    ok = ok and raw.dtype == torch.uint8 and raw.is_cpu and raw.is_contiguous() and raw.shape[1] == x.shape[1]
    if not ok or x.shape[1] % 16 or x.shape[0] < 1:
        return None
    m, k = x.shape
    n = raw.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    rc = lib.pagoda_fp8_gemm_f32(x.data_ptr(), m, k, raw.data_ptr(), n, y.data_ptr())
    return y if rc == 0 else None


def fused_available() -> bool:
    """The fused kernel runs here (the library is built with AVX-512 F)."""
    lib = _lib()
    return lib is not None and lib.pagoda_fp8_fused
