"""``python -m pagoda.kernels.selfcheck``: build the native CPU kernels where the package is installed
and run one INT4 GEMM against the torch reference; exit 1, saying why, if either fails. The node
agent image runs it at build time, and the packaging test in a fresh venv holding only the wheel."""

from __future__ import annotations

import sys

import torch

from .cpu_int4_native import build_library, cache_dir, native_int4_mm
from .int4 import dequantize_int4, quantize_int4


def check() -> str:
    """One native INT4 call compared with the reference; raises on any failure."""
    build_library()  # raises with the compiler's message (or "no C compiler") instead of falling back
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(48, 256, generator=gen), torch.randn(3, 256, generator=gen)
    qw = quantize_int4(w, 32)
    y = native_int4_mm(x, qw.packed, qw.scales, qw.offsets().contiguous(), 32)
    if y is None:
        raise RuntimeError("the native library built but did not load")
    ref = x @ dequantize_int4(qw).t()
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    return f"native INT4 kernel ok (built in {cache_dir()})"


def main() -> int:
    try:
        print(check())
    except Exception as exc:
        print(f"native kernel self-check failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
