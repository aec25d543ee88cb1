"""The environment switches that turn kernel paths off, read in this one place.

Each is read when asked (tests flip them); every one defaults to on. kernels/selector.py reports
them in its table; the ops ask ``switch_on`` instead of reading the environment themselves.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

SWITCHES = {
    "native_int4": "PAGODA_NATIVE_INT4",  # the native CPU library (every C kernel): 0 = do not build it
    "vnni": "PAGODA_NATIVE_VNNI",  # the AVX-512 VNNI INT4 / INT8 GEMMs (else the float32 C ones)
    "native_attention": "PAGODA_NATIVE_ATTENTION",  # native paged KV write and decode attention
    "native_decode": "PAGODA_NATIVE_DECODE",  # a decode step's whole layers as one native call each
    "native_fp8": "PAGODA_NATIVE_FP8",  # the native e4m3 -> float32 weight decode of the CPU FP8 GEMM
    "onednn": "PAGODA_ONEDNN",  # oneDNN prepacked float32 dense GEMMs on the CPU
}
FALLBACK_ENV = "PAGODA_ALLOW_KERNEL_FALLBACK"  # =1: a failed native build falls back instead of failing


def switch_on(name: str) -> bool:
    """False when the switch's environment variable is ``0``."""
    return os.environ.get(SWITCHES[name], "1") != "0"


def fallback_allowed_by_env() -> bool:
    return os.environ.get(FALLBACK_ENV, "0") not in ("", "0")


@contextmanager
def switched_off(name: str) -> Iterator[None]:
    """Turn one switch off for the block (benchmarks timing the path a kernel replaced)."""
    env = SWITCHES[name]
    old = os.environ.get(env)
    os.environ[env] = "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ[env]
        else:
            os.environ[env] = old
