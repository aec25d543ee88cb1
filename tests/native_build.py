"""Native-kernel test gates: a skip only where no C compiler exists; where one does, a library that
did not build fails the test (a broken ``.c`` file must not keep the suite green)."""

from __future__ import annotations

import ctypes

import pytest

from pagoda.kernels.cpu_int4_native import library, status


def native_built() -> bool:
    """True when the native library is loaded; False where there is no C compiler (or it is
    switched off); fails the calling test when a compiler exists and the build broke."""
    if library() is not None:
        return True
    if status.get("compiler") and not str(status["reason"]).startswith("disabled"):
        pytest.fail(f"the native kernels failed to build with a C compiler present: {status['reason']}")
    return False


def require_native() -> ctypes.CDLL:
    """The native library, or a skip saying that no C compiler exists (a failure otherwise)."""
    if not native_built():
        pytest.skip(f"no C compiler here, so no native kernels ({status['reason']})")
    return library()
