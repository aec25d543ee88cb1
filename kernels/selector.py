"""The kernel selector: one place that says which backend runs each op, and why.

``select_kernels`` looks at the device, the compute dtype, the flags (``--kernel-backend``,
``--int4-compute``, ``--allow-kernel-fallback``), the environment switches (kernels/switches.py,
``PAGODA_KERNELS``) and what built (the native C library), and returns a ``KernelSelection``: the
INT4 compute the model is built with and a table ``op -> (backend, why)``. The model adds the row
only it can fill (``decode_layers``, ``prefill_layers``: whether every layer of a decode step or a
small prefill chunk runs as one native call), logs the table
once (``log_table``) and keeps it; ``/metrics`` and the ``--json`` outputs report it.

Failures are loud: a C compiler that fails to build the native kernels is an error unless the user
allowed a fallback (``--allow-kernel-fallback`` / ``PAGODA_ALLOW_KERNEL_FALLBACK=1``); so is
``--int4-compute float32`` when its kernel is switched off. Only a machine without a C compiler
falls back by itself (to torch's bf16 INT4 op), and the table says so at warning level.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import torch

from . import cpu_int4_native
from .dispatch import ENV_VAR as BACKEND_ENV
from .dispatch import select_backend
from .linear import DEFAULT_INT4_COMPUTE, check_int4_compute, onednn_enabled
from .switches import FALLBACK_ENV, SWITCHES, fallback_allowed_by_env, switch_on

log = logging.getLogger("pagoda.kernels.selector")  # the CLI shows it at INFO without -v

# The ops of the table, in the order it is shown.
OPS = (
    "int4_gemm",
    "fp8_gemm",
    "int8_head_gemm",
    "dense_gemm",
    "write_kv",
    "paged_attention_decode",
    "paged_attention_prefill",
    "decode_layers",
    "prefill_layers",
    "integrity_check",
    "moe",
)
_logged_tables: set[tuple] = set()
_lock = threading.Lock()
_active: KernelSelection | None = None  # the last selection logged: what /metrics reports


class KernelSelectionError(RuntimeError):
    """The requested kernels cannot run here and no fallback was allowed."""


@dataclass(frozen=True)
class Choice:
    backend: str
    why: str
    fallback: bool = False  # a slower or less exact path than asked for (logged as a warning)


@dataclass
class KernelSelection:
    """What the model is built with (``backend``, ``int4_compute``) and the table of what runs."""

    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    backend: str | None = None  # the requested kernel backend (None: automatic)
    int4_compute: str = DEFAULT_INT4_COMPUTE  # as it will run: float32 only where its kernel does
    requested_int4_compute: str = DEFAULT_INT4_COMPUTE
    allow_fallback: bool = False
    table: dict[str, Choice] = field(default_factory=dict)

    def note(self, op: str, backend: str, why: str, fallback: bool = False) -> None:
        """Add or replace the row of ``op`` (the model fills ``decode_layers`` and ``prefill_layers``)."""
        self.table[op] = Choice(backend, why, fallback)

    def rows(self) -> list[tuple[str, str, str]]:
        order = {op: i for i, op in enumerate(OPS)}
        ops = sorted(self.table, key=lambda op: order.get(op, len(OPS)))
        return [(op, self.table[op].backend, self.table[op].why) for op in ops]

    def as_dict(self) -> dict:
        """The JSON form (the ``kernels`` key of ``pagoda bench ... --json`` and ``pagoda eval``)."""
        return {
            "device": self.device,
            "dtype": str(self.dtype).removeprefix("torch."),
            "int4_compute": self.int4_compute,
            "native_library": "built"
            if cpu_int4_native.status["loaded"]
            else cpu_int4_native.status["reason"],
            "ops": {op: {"backend": b, "why": why} for op, b, why in self.rows()},
        }

    def log_table(self) -> None:
        """Log the table once per process and distinct content; it becomes the reported one."""
        global _active
        key = (self.device, str(self.dtype), tuple(self.rows()))
        with _lock:
            _active = self
            if key in _logged_tables:
                return
            _logged_tables.add(key)
        width = max(len(op) for op in self.table)
        lines = [f"  {op:<{width}}  {b:<20} {why}" for op, b, why in self.rows()]
        log.info("kernels (%s, %s):\n%s", self.device, self.as_dict()["dtype"], "\n".join(lines))
        for op, choice in self.table.items():
            if choice.fallback:
                log.warning("kernel fallback: %s runs %s (%s)", op, choice.backend, choice.why)


def active_selection() -> KernelSelection | None:
    """The selection most recently logged in this process (None before a model is built)."""
    return _active


def native_library_state() -> tuple[str, str]:
    """("built" | "no compiler" | "disabled" | "failed", the reason), building on first call."""
    lib = cpu_int4_native.library()
    status = cpu_int4_native.status
    if lib is not None:
        return "built", "built with " + str(cpu_int4_native.compiler())
    reason = str(status["reason"])
    if reason.startswith("disabled"):
        return "disabled", reason
    if not status.get("compiler"):
        return "no compiler", reason
    return "failed", reason


def select_kernels(
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    backend: str | None = None,
    int4_compute: str = DEFAULT_INT4_COMPUTE,
    allow_fallback: bool = False,
) -> KernelSelection:
    """Decide every op's backend for a model on ``device`` computing in ``dtype``.

    Raises KernelSelectionError where the native kernels should run but cannot (a failed build with
    a compiler present, or ``--int4-compute float32`` with its kernel switched off), unless
    ``allow_fallback`` (or ``PAGODA_ALLOW_KERNEL_FALLBACK=1``)."""
    check_int4_compute(int4_compute)
    dev = torch.device(device)
    allow = allow_fallback or fallback_allowed_by_env()
    base = select_backend(dev, backend)
    sel = KernelSelection(dev.type, dtype, backend, int4_compute, int4_compute, allow)
    cpu_native = base == "cpu" and dev.type == "cpu"
    state, reason = native_library_state() if cpu_native else ("unused", "")
    if state == "failed" and not allow:
        raise KernelSelectionError(
            f"the native CPU kernels failed to build ({reason}); fix the build, or pass "
            f"--allow-kernel-fallback (or {FALLBACK_ENV}=1) to run the torch paths"
        )
    native = state == "built"
    if cpu_native and dtype == torch.float32 and int4_compute == "float32" and not native:
        if state == "disabled" and not allow:
            raise KernelSelectionError(
                f"--int4-compute float32 needs the native INT4 kernel, which is off ({reason}); "
                "pass --int4-compute bf16, or --allow-kernel-fallback to run bf16"
            )
        sel.int4_compute = "bf16"
    _fill(sel, base, native, state, reason)
    return sel


def _generic(base: str, dev: str) -> Choice:
    if base == "triton":
        return Choice("triton", "CUDA with Triton" if dev == "cuda" else "TRITON_INTERPRET=1")
    if base == "reference":
        return Choice("reference", f"{BACKEND_ENV}=reference or --kernel-backend reference")
    return Choice("torch", "vectorized torch" + ("" if dev == "cpu" else " (Triton unavailable)"))


def _fill(sel: KernelSelection, base: str, native: bool, state: str, reason: str) -> None:
    generic = _generic(base, sel.device)
    for op in OPS:
        sel.table[op] = generic
    cpu = base == "cpu" and sel.device == "cpu"
    f32 = sel.dtype == torch.float32
    if base == "reference":
        for op in ("decode_layers", "prefill_layers"):
            sel.note(op, "off", "the reference kernels")
        return
    if not cpu:
        sel.note("write_kv", "torch", "no Triton KV write; vectorized torch")
        sel.note("dense_gemm", "torch", "F.linear")
        for op in ("decode_layers", "prefill_layers"):
            sel.note(op, "off", "CPU only")
        return
    missing = f"native kernels {state}: {reason}"
    vnni = native and switch_on("vnni") and cpu_int4_native.vnni_available()
    native_name = "native-vnni" if vnni else "native"
    native_why = "AVX-512 VNNI" if vnni else f"float32 C kernel (no VNNI, or {SWITCHES['vnni']}=0)"
    if not f32:
        sel.note("int4_gemm", "torch-int4pack", f"{str(sel.dtype).removeprefix('torch.')} activations")
    elif sel.int4_compute == "float32":
        sel.note("int4_gemm", native_name, f"--int4-compute float32, {native_why}")
    elif sel.requested_int4_compute == "float32":
        sel.note("int4_gemm", "torch-int4pack-bf16", f"float32 asked, {missing}", fallback=True)
    else:
        sel.note("int4_gemm", "torch-int4pack-bf16", "--int4-compute bf16")
    if native and switch_on("native_fp8"):
        sel.note(
            "fp8_gemm", "native", "fused e4m3 GEMM below 256 rows (AVX-512 F); else rows decoded natively"
        )
    else:
        why = f"{SWITCHES['native_fp8']}=0" if native else missing
        sel.note("fp8_gemm", "torch", f"e4m3 rows decoded in blocks by torch ops ({why}), float32 matmul")
    int4_moe = sel.table["int4_gemm"]  # INT4 experts: the same kernel over each expert's routed rows
    sel.note("moe", int4_moe.backend, f"grouped by expert; INT4 experts: {int4_moe.why}", int4_moe.fallback)
    if f32 and native:
        sel.note("int8_head_gemm", native_name, f"block (Q8_0) heads: {native_why}; per-row heads: torch")
    else:
        sel.note("int8_head_gemm", "torch", "int8pack op" + ("" if native else f" ({missing})"), not native)
    dense = "onednn" if f32 and onednn_enabled() else "torch"
    sel.note("dense_gemm", dense, "prepacked float32" if dense == "onednn" else "F.linear")
    attention_on = switch_on("native_attention")
    if native and attention_on:
        for op in ("write_kv", "paged_attention_decode"):
            sel.note(op, "native", "float32, fp8 and int8 pages; torch for bf16 pages")
    else:
        why = f"{SWITCHES['native_attention']}=0" if native else missing
        for op in ("write_kv", "paged_attention_decode"):
            sel.note(op, "torch", why, fallback=not native)
    sel.note("paged_attention_prefill", "torch", "scaled_dot_product_attention per sequence")
    for op in ("decode_layers", "prefill_layers"):
        if not switch_on("native_decode"):
            sel.note(op, "off", f"{SWITCHES['native_decode']}=0")
        elif not native:
            sel.note(op, "off", missing)
        else:
            sel.note(op, "native", "every layer one native call (checked when the model is built)")
