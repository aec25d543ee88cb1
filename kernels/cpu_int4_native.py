"""Pagoda's native CPU kernels (the float32 INT4 and INT8 GEMMs of ``cpu_int4.c``, and every other
source in ``SOURCES``): one shared object, built once per machine with the system C compiler and
called through ctypes.

``native_int4_mm`` returns None when the library cannot be built or loaded (no compiler, a build
error); the reason is logged once and kept in ``status``, and kernels/selector.py decides whether
that is an error (a compiler that failed) or a fallback (no compiler, or one the user allowed).
``build_library`` builds from any source folder into any cache folder (the tests break a copy).
The shared object is cached under ``$PAGODA_CACHE_DIR/kernels`` (default ``~/.cache/pagoda``; a
per-user temp folder when that is not writable), keyed by the sources' and headers' hash, the
compiler and its flags and the CPU's feature flags (it is built with ``-march=native``);
``PAGODA_NATIVE_INT4=0`` turns the path off.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch
from torch import Tensor

from .switches import switch_on
from .vnni_layout import deinterleave16, deinterleave16_i8

log = logging.getLogger("pagoda.kernels")

SOURCE_DIR = Path(__file__).parent
HEADER_NAMES = ("cpu_math.h", "cpu_vnni.h", "cpu_int4_params.h")  # included: hashed, not compiled
SOURCE_NAMES = (
    "cpu_int4.c",
    "cpu_int4_vnni.c",
    "cpu_int8_vnni.c",
    "cpu_attention.c",
    "cpu_decode_layer.c",
    "cpu_fp8.c",
)
HEADERS = tuple(SOURCE_DIR / n for n in HEADER_NAMES)
SOURCES = tuple(SOURCE_DIR / n for n in SOURCE_NAMES)
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-ffp-contract=off"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
# "compiler": whether a C compiler was found; a failed build with one is an error (kernels/selector.py)
status: dict[str, object] = {"loaded": False, "reason": "not built yet", "compiler": None}


class NoCompilerError(RuntimeError):
    """No C compiler on this machine: the native kernels cannot be built (a fallback runs)."""


class KernelBuildError(RuntimeError):
    """A C compiler exists but the native kernels did not build or load."""


def compiler() -> str | None:
    """The C compiler the build uses: ``$CC`` if it names an executable, else gcc or cc on PATH."""
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc)
    return shutil.which("gcc") or shutil.which("cc")


def cache_dir() -> Path:
    """Where the shared object is built: ``$PAGODA_CACHE_DIR/kernels`` (default ``~/.cache/pagoda``),
    or a per-user folder under the temp dir when that one cannot be written (a read-only home)."""
    root = Path(os.environ.get("PAGODA_CACHE_DIR", str(Path.home() / ".cache" / "pagoda"))) / "kernels"
    try:
        root.mkdir(parents=True, exist_ok=True)
        if os.access(root, os.W_OK):
            return root
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"pagoda-{os.getuid()}" / "kernels"


def build_library(source_dir: Path = SOURCE_DIR, out_dir: Path | None = None) -> ctypes.CDLL:
    """Compile (or reuse from ``out_dir``) the shared object of the sources in ``source_dir`` and load
    it. Raises NoCompilerError without a compiler, KernelBuildError (with the compiler's message)
    when the sources fail to build or the object to load."""
    source_dir = Path(source_dir)
    sources = [source_dir / n for n in SOURCE_NAMES]
    cc = compiler()
    if cc is None:
        raise NoCompilerError(f"no C compiler ({os.environ.get('CC') or 'gcc or cc'}) on PATH")
    try:
        src = b"".join(p.read_bytes() for p in (*sources, *(source_dir / n for n in HEADER_NAMES)))
    except OSError as exc:
        raise KernelBuildError(f"native kernel sources incomplete in {source_dir}: {exc}") from exc
    # -march=native: the object is only valid on this CPU model, so its flags are part of the key
    key = hashlib.sha256(src + " ".join([cc, *FLAGS, _cpu_flags()]).encode()).hexdigest()[:16]
    out = Path(out_dir or cache_dir()) / f"cpu_int4-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            tmp_out = Path(tmp) / out.name
            proc = subprocess.run(
                [cc, *FLAGS, *map(str, sources), "-o", str(tmp_out)],
                capture_output=True,
                text=True,
                timeout=120,
            )
            if proc.returncode != 0:
                errors = [ln for ln in proc.stderr.splitlines() if "error" in ln] or proc.stderr.splitlines()
                raise KernelBuildError(f"{cc} failed to build the native kernels: {' | '.join(errors[:3])}")
            os.replace(tmp_out, out)  # atomic: concurrent workers never load half a file
    try:
        lib = ctypes.CDLL(str(out))
    except OSError as exc:
        raise KernelBuildError(f"cannot load the native kernels ({out}): {exc}") from exc
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    for fn in (lib.pagoda_int4_gemm_f32, lib.pagoda_int4_vnni_gemm_f32):
        fn.restype = ctypes.c_int
        fn.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ctypes.c_int, i64, i64, ptr, ctypes.c_int]
    for fn8 in (lib.pagoda_int8_gemm_f32, lib.pagoda_int8_vnni_gemm_f32):
        fn8.restype = ctypes.c_int
        fn8.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, ptr, ctypes.c_int]
    return lib


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def library() -> ctypes.CDLL | None:
    """The loaded library, building it on first use; None (reason in ``status``) if unavailable.
    Whether that unavailability is an error is the selector's call (kernels/selector.py)."""
    global _lib
    if _lib is not None or status["reason"] not in ("not built yet",):
        return _lib
    with _lock:
        if _lib is None and status["reason"] == "not built yet":
            status["compiler"] = compiler() is not None
            if not switch_on("native_int4"):
                status.update(loaded=False, reason="disabled by PAGODA_NATIVE_INT4=0")
            else:
                try:
                    _lib = build_library()
                    status.update(loaded=True, reason="")
                except Exception as exc:  # no compiler, a build or load error: reported by the selector
                    status.update(loaded=False, reason=f"{type(exc).__name__}: {exc}")
                    log.warning("native CPU kernels unavailable: %s", status["reason"])
    return _lib


_NON_FINITE = 6  # the VNNI kernels' code for NaN or inf in x (5: built without VNNI)
_vnni_runs: dict[str, bool] = {}


def _vnni_probe(kind: str) -> bool:
    """One call of the ``kind`` ("int4" or "int8") VNNI kernel on a one-row problem: 0 means it runs
    here (library built, AVX-512 VNNI); 5, built without it. ``PAGODA_NATIVE_VNNI=0`` says no."""
    if kind not in _vnni_runs:
        lib = library()
        runs = False
        if lib is not None and switch_on("vnni"):
            x, y = torch.zeros(1, 32), torch.empty(1, 1)
            w = torch.full((1, 32 // (8 if kind == "int4" else 4), 16, 4), 0 if kind == "int4" else 128)
            w, params = w.to(torch.uint8), torch.zeros(1, 1, dtype=torch.float16)
            if kind == "int4":
                rc = lib.pagoda_int4_vnni_gemm_f32(
                    x.data_ptr(), 1, 32, w.data_ptr(), params.data_ptr(), params.data_ptr(), 1, 1, 32,
                    y.data_ptr(), 1,
                )  # fmt: skip
            else:
                rc = lib.pagoda_int8_vnni_gemm_f32(
                    x.data_ptr(), 1, 32, w.data_ptr(), params.data_ptr(), 1, 32, y.data_ptr(), 1
                )
            runs = rc == 0
        _vnni_runs[kind] = runs
    return _vnni_runs[kind]


def _ran(rc: int, kernel: str, k: int, group: int, vnni: bool = False) -> bool:
    """True when a native GEMM returned 0; False when a VNNI one found NaN or inf in x (the caller then
    runs the float32 kernel); any other code raises."""
    if rc == 0:
        return True
    if vnni and rc == _NON_FINITE:
        return False
    raise RuntimeError(f"native {kernel} kernel failed (code {rc}) for K={k}, group={group}")


def vnni_available() -> bool:
    """Whether the VNNI INT4 kernel runs here (probed once; ``PAGODA_NATIVE_VNNI=0`` turns it off)."""
    return _vnni_probe("int4")


def vnni8_available() -> bool:
    """Whether the VNNI INT8 kernel runs here (the same switch)."""
    return _vnni_probe("int8")


def native_int4_mm(
    x: Tensor,
    packed: Tensor,
    scales: Tensor,
    offsets: Tensor,
    group: int,
    mode: int | None = None,
    interleaved: bool = False,
) -> Tensor | None:
    """``x [M, K] float32 @ dequant.T -> [M, N] float32``, or None when the library is unavailable.
    ``scales`` and ``offsets`` are both float32 or both float16 (``mode`` 0 or 1, found from the
    dtype when None), or codes uint8 [N, K/group, 3] and their float16 table (``mode=2``).
    ``interleaved``: ``packed`` is the VNNI kernel's 16-row layout (``vnni_layout.interleave16``); N is
    then the scales' rows. An x holding NaN or inf runs the float32 kernel on the canonical nibbles."""
    lib = library()
    if lib is None:
        return None
    n = scales.shape[0] if interleaved else packed.shape[0]
    groups = x.shape[-1] // group if group > 0 else 0
    if mode == 2:
        if scales.dtype != torch.uint8 or scales.shape != (n, groups, 3):
            raise ValueError(
                f"codes must be uint8 {(n, groups, 3)}, got {scales.dtype} {tuple(scales.shape)}"
            )
        if offsets.dtype != torch.float16 or offsets.dim() != 1 or offsets.numel() > 4096:
            raise ValueError(f"a code table is float16 [<= 4096], got {offsets.dtype} {tuple(offsets.shape)}")
    elif scales.dtype != offsets.dtype or scales.dtype not in (torch.float32, torch.float16):
        raise ValueError(
            f"scales and offsets must both be float32 or float16, got {scales.dtype}, {offsets.dtype}"
        )
    elif mode not in (None, int(scales.dtype == torch.float16)):
        raise ValueError(f"parameter mode {mode} does not match {scales.dtype} scales")
    mode = int(scales.dtype == torch.float16) if mode is None else mode
    scales, offsets, packed = scales.contiguous(), offsets.contiguous(), packed.contiguous()
    x = x.contiguous()
    m, k = x.shape
    if interleaved:
        if packed.dim() != 4 or packed.shape != (-(-n // 16), k // 8, 16, 4):
            raise ValueError(f"16-row nibbles for N={n}, K={k} have the wrong shape {tuple(packed.shape)}")
        y = torch.empty(m, n, dtype=torch.float32)
        rc = lib.pagoda_int4_vnni_gemm_f32(
            x.data_ptr(), m, k, packed.data_ptr(), scales.data_ptr(), offsets.data_ptr(), mode, n, group,
            y.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if _ran(rc, "VNNI INT4", k, group, vnni=True):
            return y
        packed = deinterleave16(packed, n)  # float semantics for NaN and inf: the float32 kernel
    y = torch.empty(m, n, dtype=torch.float32)
    rc = lib.pagoda_int4_gemm_f32(
        x.data_ptr(), m, k, packed.data_ptr(), scales.data_ptr(), offsets.data_ptr(), mode, n, group,
        y.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    _ran(rc, "INT4", k, group)
    return y


def native_int8_mm(
    x: Tensor, qweight: Tensor, scales: Tensor, group: int, interleaved: bool = False
) -> Tensor | None:
    """``x [M, K] float32 @ (q * block scale).T -> [M, N] float32`` (float16 block scales), or None
    when the library is unavailable. ``interleaved``: ``qweight`` is the VNNI kernel's biased 16-row
    layout (``vnni_layout.interleave16_i8``); an x holding NaN or inf then runs the float32 kernel."""
    lib = library()
    if lib is None:
        return None
    want = torch.uint8 if interleaved else torch.int8
    if qweight.dtype != want or scales.dtype != torch.float16:
        raise ValueError(f"expected {want} weights and float16 scales, got {qweight.dtype}, {scales.dtype}")
    x, qweight, scales = x.contiguous(), qweight.contiguous(), scales.contiguous()
    m, k = x.shape
    n = scales.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    if interleaved:
        if qweight.dim() != 4 or qweight.shape != (-(-n // 16), k // 4, 16, 4):
            raise ValueError(
                f"16-row int8 weights for N={n}, K={k} have the wrong shape {tuple(qweight.shape)}"
            )
        rc = lib.pagoda_int8_vnni_gemm_f32(
            x.data_ptr(), m, k, qweight.data_ptr(), scales.data_ptr(), n, group, y.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        if _ran(rc, "VNNI INT8", k, group, vnni=True):
            return y
        qweight = deinterleave16_i8(qweight, n)  # float semantics for NaN and inf: the float32 kernel
    rc = lib.pagoda_int8_gemm_f32(
        x.data_ptr(), m, k, qweight.data_ptr(), scales.data_ptr(), n, group, y.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    _ran(rc, "INT8", k, group)
    return y
