"""The environment switches that turn kernel paths off, read in this one place.

Each is read when asked (tests flip them); every one defaults to on. kernels/selector.py reports
them in its table; the ops ask ``switch_on`` instead of reading the environment themselves.
"""

from __future__ import annotations

import os

SWITCHES = {
    "native_int4": "PAGODA_NATIVE_INT4",  # the native CPU library (every C kernel): 0 = do not build it
    "vnni": "PAGODA_NATIVE_VNNI",  # the AVX-512 VNNI INT4 / INT8 GEMMs (else the float32 C ones)
    "native_attention": "PAGODA_NATIVE_ATTENTION",  # native paged KV write and decode attention
    "native_decode": "PAGODA_NATIVE_DECODE",  # a decode step's whole layers as one native call each
    "onednn": "PAGODA_ONEDNN",  # oneDNN prepacked float32 dense GEMMs on the CPU
}
FALLBACK_ENV = "PAGODA_ALLOW_KERNEL_FALLBACK"  # =1: a failed native build falls back instead of failing


def switch_on(name: str) -> bool:
    """False when the switch's environment variable is ``0``."""
    return os.environ.get(SWITCHES[name], "1") != "0"


def fallback_allowed_by_env() -> bool:
    return os.environ.get(FALLBACK_ENV, "0") not in ("", "0")
