"""The decoder's elementwise glue between GEMMs and attention, optionally compiled.

Three pure functions of tensors (so one compiled artifact serves every layer): RoPE over the q
and k heads of a fused qkv output, the SwiGLU product of a fused gate/up output, and a residual
add followed by RMSNorm. Eager, each is 3-8 small torch ops; ``enable_compile`` has
torch.compile (inductor; C++ on CPU, Triton on CUDA) fuse each into one kernel with dynamic
shapes, at load time. The GEMMs and the paged attention stay native ops: their shapes and
layouts vary per step and per format. When compilation is unavailable (no C++ compiler, an
inductor error) the eager functions stay, and the reason is logged and kept in ``compile_state``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F

from pagoda.node_agent.models.rope import apply_rope

log = logging.getLogger("pagoda.compile")


def rope_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, hq: int, hkv: int, d: int):
    """Fused qkv [T, (hq + 2 hkv) d] -> rotated q [T, hq, d], rotated k [T, hkv, d], v [T, hkv, d]."""
    heads = qkv.view(qkv.shape[0], hq + 2 * hkv, d)
    qk = apply_rope(heads[:, : hq + hkv], cos, sin)
    return qk[:, :hq], qk[:, hq:], heads[:, hq + hkv :]


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """Fused gate/up output [T, 2I] -> silu(gate) * up [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32 math (the HF order: normalize, cast, scale); one fused op in float32."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """(x + delta, RMSNorm(x + delta))."""
    y = x + delta
    return y, rms_norm(y, weight, eps)


EAGER = {"rope_qk": rope_qk, "swiglu": swiglu, "add_rms_norm": add_rms_norm}
OPS: dict[str, Any] = dict(EAGER)  # what the model calls; compiled versions replace these
compile_state: dict[str, Any] = {"enabled": False, "reason": "not requested"}


def enable_compile(device: torch.device, dtype: torch.dtype, hq: int, hkv: int, d: int) -> bool:
    """Compile the glue and run it once per shape family now (the first request never pays it).
    Returns whether compiled ops are in use; on failure logs why and keeps the eager ones."""
    if compile_state["enabled"]:
        return True
    try:
        compiled = {name: torch.compile(fn, dynamic=True) for name, fn in EAGER.items()}
        for t in (3, 5):  # two sizes, so the graphs are traced with a symbolic token count
            _warm_up(compiled, device, dtype, t, hq, hkv, d)
    except Exception as exc:  # no C++ compiler, an inductor error: stay eager, say why
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        reason = f"{type(exc).__name__}: {' '.join(lines[:4])[:400]}"
        compile_state.update(enabled=False, reason=reason)
        log.warning("torch.compile of the decode glue is unavailable, running eager: %s", reason)
        return False
    OPS.update(compiled)
    compile_state.update(enabled=True, reason="")
    log.info("decode glue compiled (torch.compile, inductor, dynamic shapes)")
    return True


def disable_compile() -> None:
    """Back to the eager functions (tests)."""
    OPS.update(EAGER)
    compile_state.update(enabled=False, reason="not requested")


def _warm_up(ops: dict, device: torch.device, dtype: torch.dtype, t: int, hq: int, hkv: int, d: int) -> None:
    kw = {"device": device, "dtype": dtype}
    qkv = torch.randn(t, (hq + 2 * hkv) * d, **kw)
    cos, sin = torch.randn(t, d, **kw), torch.randn(t, d, **kw)
    got = ops["rope_qk"](qkv, cos, sin, hq, hkv, d)
    want = rope_qk(qkv, cos, sin, hq, hkv, d)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
    x, w = torch.randn(t, hq * d, **kw), torch.randn(hq * d, **kw)
    for a, b in zip(ops["add_rms_norm"](x, x, w, 1e-6), add_rms_norm(x, x, w, 1e-6), strict=True):
        torch.testing.assert_close(a, b)
    gu = torch.randn(t, 4 * d, **kw)
    torch.testing.assert_close(ops["swiglu"](gu), swiglu(gu))
