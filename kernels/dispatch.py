"""Backend selection and per-op call counters for the kernels package.

Backends:
  * ``triton``    - Triton kernels (CUDA; also CPU tensors under ``TRITON_INTERPRET=1``).
  * ``cpu``       - vectorized torch paths (torch's native CPU INT4/FP8 ops where they exist);
                    device-agnostic torch code, so it also serves CUDA when Triton is missing.
  * ``reference`` - plain, slow, obviously-correct torch code (loops); the ground truth in tests.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections import Counter
from typing import Literal, get_args

import torch

Backend = Literal["triton", "cpu", "reference"]
BACKENDS: tuple[str, ...] = get_args(Backend)
ENV_VAR = "PAGODA_KERNELS"

log = logging.getLogger("pagoda.kernels")

_lock = threading.Lock()
_calls: Counter[str] = Counter()
_logged: set[str] = set()
_choices: dict[tuple, Backend] = {}


@functools.cache
def triton_available() -> bool:
    """True when ``import triton`` works (cached)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_interpreting() -> bool:
    """True when Triton kernels run in the interpreter (CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _check_name(name: str, source: str) -> Backend:
    if name not in BACKENDS:
        raise ValueError(
            f"unknown kernel backend {name!r} (from {source}); expected one of {', '.join(BACKENDS)}"
        )
    return name  # type: ignore[return-value]


def select_backend(device: torch.device | str, requested: str | None = None) -> Backend:
    """Pick the backend for tensors on ``device``.

    ``PAGODA_KERNELS=reference`` forces the reference everywhere (a debugging switch). Otherwise an
    explicit ``requested`` wins, then any other ``PAGODA_KERNELS`` value, then the automatic choice:
    ``triton`` on CUDA when Triton imports, else ``cpu``. A ``triton`` request that cannot run (no
    Triton, or CPU tensors without the interpreter) falls back to ``cpu`` with a warning.
    """
    dev_type = device.type if isinstance(device, torch.device) else torch.device(device).type
    env = os.environ
    key = (dev_type, requested, env.get(ENV_VAR, ""), env.get("TRITON_INTERPRET", ""), triton_available())
    choice = _choices.get(key)
    if choice is None:  # decided once per (device type, request, environment): ops call this per step
        choice = _choices[key] = _select(torch.device(dev_type), requested)
    return choice


def _select(device: torch.device, requested: str | None) -> Backend:
    env = os.environ.get(ENV_VAR, "").strip().lower()
    if env in ("", "auto"):
        env = ""
    else:
        _check_name(env, f"${ENV_VAR}")
    if env == "reference":
        return "reference"
    name = requested if requested not in (None, "auto") else (env or None)
    if name is not None:
        backend = _check_name(name, "request")
        if backend == "triton" and not (
            triton_available() and (device.type == "cuda" or triton_interpreting())
        ):
            _log_once(f"fallback:{device.type}", "triton backend unavailable on %s; using cpu", device.type)
            return "cpu"
        return backend
    if device.type == "cuda" and triton_available():
        return "triton"
    return "cpu"


def _log_once(key: str, msg: str, *args: object) -> None:
    with _lock:
        if key in _logged:
            return
        _logged.add(key)
    log.info(msg, *args)


def record(op: str, backend: str) -> None:
    """Count one call of ``op`` on ``backend``; log the first one of each pair."""
    key = f"{op}/{backend}"
    with _lock:
        _calls[key] += 1
        first = key not in _logged
        _logged.add(key)
    if first:
        log.info("kernel %s uses backend %s", op, backend)


def resolve(
    op: str, device: torch.device | str, requested: str | None, supports: tuple[str, ...] = BACKENDS
) -> Backend:
    """select_backend + record, the one call every op makes.

    An op without a kernel for the selected backend (``supports``) runs its ``cpu`` path, and the
    counter records what actually ran.
    """
    backend = select_backend(device, requested)
    if backend not in supports:
        backend = "cpu"
    record(op, backend)
    return backend


def kernel_stats() -> dict[str, int]:
    """Calls per ``"op/backend"`` since start (or the last reset)."""
    with _lock:
        return dict(_calls)


def reset_kernel_stats() -> None:
    """Zero the counters (tests, benchmarks)."""
    with _lock:
        _calls.clear()
