"""ctypes wrappers of ``cpu_attention.c``: the native CPU paged KV write and paged decode attention.

Both serve float32 caches, FP8 e4m3 caches (static or per-token scales) and int8 caches (per-token
scales) on CPU tensors; for anything else (bfloat16 pages, CUDA tensors, shapes the torch path would
reject) they return False/None and the caller runs the torch path, which then raises its own
errors. They also step aside when the native library cannot be built (``cpu_int4_native.status``)
or ``PAGODA_NATIVE_ATTENTION=0``.
"""

from __future__ import annotations

import ctypes
import math

import torch
from torch import Tensor

from .cpu_int4_native import library
from .fp8_format import FP8_DTYPE, TOKEN_SCALE_DTYPE
from .int8_format import INT8_DTYPE
from .switches import SWITCHES, switch_on

ENV_VAR = SWITCHES["native_attention"]
# cache modes of the C side
MODE_F32, MODE_FP8_STATIC, MODE_FP8_TOKEN, MODE_INT8_TOKEN = 0, 1, 2, 3


def enabled() -> bool:
    """False when ``PAGODA_NATIVE_ATTENTION=0`` (read per call, so tests can flip it)."""
    return switch_on("native_attention")


def _lib() -> ctypes.CDLL | None:
    lib = library()
    if lib is None or getattr(lib, "pagoda_attention_ready", False):
        return lib
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.pagoda_write_kv.restype = i32
    lib.pagoda_write_kv.argtypes = [i64, ptr, i64, *([ptr, i64, i64, i64, ptr, i32, ptr] * 2)]
    lib.pagoda_paged_decode.restype = i32
    lib.pagoda_paged_decode.argtypes = [
        ptr, i64, i64, i64, ptr, i32, ptr, ptr, i32, ptr, i64, i64, i64, ptr, i64, ptr, i64, ctypes.c_float, ptr, i32,
    ]  # fmt: skip
    lib.pagoda_f32_to_e4m3.restype = None
    lib.pagoda_f32_to_e4m3.argtypes = [ptr, i64, ptr, i32]
    lib.pagoda_f32_to_int8.restype = None
    lib.pagoda_f32_to_int8.argtypes = [ptr, i64, ctypes.c_float, ptr, i32]
    lib.pagoda_attention_ready = True
    return lib


def _mode(cache: Tensor, scale: Tensor | None) -> int | None:
    """The C cache mode, or None when the native path does not serve this cache: float32; FP8 with
    static ``[H]`` or page scales; int8 with page scales only (bfloat16, contiguous, shape
    ``cache.shape[:3]``)."""
    dtype = cache.dtype
    if not cache.is_cpu or not cache.is_contiguous():
        return None
    if dtype is torch.float32:
        return MODE_F32
    if dtype not in (FP8_DTYPE, INT8_DTYPE) or scale is None or not scale.is_cpu:
        return None
    if scale.dim() == 3:  # per-token page scales, written in place: must be the pool's own tensor
        ok = scale.dtype == TOKEN_SCALE_DTYPE and scale.is_contiguous() and scale.shape == cache.shape[:3]
        if not ok:
            return None
        return MODE_INT8_TOKEN if dtype is INT8_DTYPE else MODE_FP8_TOKEN
    static_ok = dtype is FP8_DTYPE and tuple(scale.shape) == (cache.shape[2],)  # int8 has no static mode
    return MODE_FP8_STATIC if static_ok else None


def _scale_arg(mode: int, scale: Tensor | None) -> Tensor | None:
    """The scale tensor the C side reads (static scales as contiguous float32)."""
    if mode == MODE_FP8_STATIC:
        return scale.float().contiguous()
    return scale if mode in (MODE_FP8_TOKEN, MODE_INT8_TOKEN) else None


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _rows(x: Tensor, cache: Tensor) -> Tensor | None:
    """``x [T, H, D]`` as float32 whose [H, D] rows are contiguous (tokens any stride apart)."""
    if x.dim() != 3 or x.shape[1:] != cache.shape[2:] or not x.is_cpu:
        return None
    x = x if x.dtype is torch.float32 else x.float()
    if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        x = x.contiguous()
    return x


def native_write_kv(
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor,
    v: Tensor,
    slot_mapping: Tensor,
    k_scale: Tensor | None,
    v_scale: Tensor | None,
) -> bool:
    """``write_kv`` in one native call; False (nothing written) when this path does not serve the
    inputs. Raises ValueError for a slot beyond the pool."""
    if not enabled():
        return False
    km, vm = _mode(k_cache, k_scale), _mode(v_cache, v_scale)
    if km is None or vm is None or slot_mapping.dim() != 1 or not slot_mapping.is_cpu:
        return False
    kx, vx = _rows(k, k_cache), _rows(v, v_cache)
    t = slot_mapping.shape[0]
    if kx is None or vx is None or kx.shape[0] != t or vx.shape[0] != t:
        return False
    lib = _lib()
    if lib is None:
        return False
    slots = slot_mapping.long().contiguous()
    ks, vs = _scale_arg(km, k_scale), _scale_arg(vm, v_scale)
    num_slots = min(k_cache.shape[0] * k_cache.shape[1], v_cache.shape[0] * v_cache.shape[1])
    rc = lib.pagoda_write_kv(
        t, slots.data_ptr(), num_slots,
        kx.data_ptr(), kx.stride(0), kx.shape[1], kx.shape[2], k_cache.data_ptr(), km, _ptr(ks),
        vx.data_ptr(), vx.stride(0), vx.shape[1], vx.shape[2], v_cache.data_ptr(), vm, _ptr(vs),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"slot_mapping holds slot {int(slots.max())} but the KV pool has {num_slots} slots")
    return True


def native_paged_decode(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    k_scale: Tensor | None,
    v_scale: Tensor | None,
    window: int | None = None,
) -> Tensor | None:
    """``paged_decode_attention`` in one native call (``[B, Hq, D]`` in ``q.dtype``), or None when
    this path does not serve the inputs. ``window``: each query sees only its last ``window`` keys
    (pages before them are not read). Raises ValueError when a sequence's length exceeds its block
    table or a page it reads lies outside the pool."""
    if not enabled():
        return None
    km, vm = _mode(k_cache, k_scale), _mode(v_cache, v_scale)
    if km is None or vm is None or q.dim() != 3 or not q.is_cpu:
        return None
    bsz, hq, d = q.shape
    num_pages, page_size, hkv, _ = k_cache.shape
    if (
        k_cache.shape != v_cache.shape
        or k_cache.shape[3] != d
        or hq % hkv
        or block_tables.dim() != 2
        or not block_tables.is_cpu
        or block_tables.shape[0] != bsz
        or context_lens.numel() != bsz
    ):
        return None
    lib = _lib()
    if lib is None:
        return None
    tables = _int32(block_tables, "block_tables")
    lens = _int32(context_lens.reshape(-1), "context_lens")
    qf = q.float().contiguous()
    ks, vs = _scale_arg(km, k_scale), _scale_arg(vm, v_scale)
    out = torch.empty(bsz, hq, d, dtype=torch.float32)
    rc = lib.pagoda_paged_decode(
        qf.data_ptr(), bsz, hq, d, k_cache.data_ptr(), km, _ptr(ks), v_cache.data_ptr(), vm, _ptr(vs),
        num_pages, page_size, hkv, tables.data_ptr(), tables.shape[1], lens.data_ptr(), window or 0, scale,
        out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if rc == -(bsz + 1):
        raise MemoryError("native paged decode: no memory for its scratch buffers")
    if rc < 0:
        b = -rc - 1
        length, cols = int(lens[b]), tables.shape[1]
        first = max(0, length - window) // page_size if window else 0
        used = tables[b, first : math.ceil(max(length, 0) / page_size)].tolist()
        raise ValueError(
            f"sequence {b}: context length {length} with a block table of {cols} pages of "
            f"{page_size} (page ids {used[:8]}{'...' if len(used) > 8 else ''}) reads outside "
            f"the table or outside the pool's {num_pages} pages"
        )
    return out if q.dtype is torch.float32 else out.to(q.dtype)


def _int32(t: Tensor, name: str) -> Tensor:
    """``t`` as contiguous int32 (the engine passes int32 already); ValueError if values overflow."""
    if t.dtype is not torch.int32:
        if t.numel() and (int(t.max()) > 2**31 - 1 or int(t.min()) < -(2**31)):
            raise ValueError(f"{name} holds values beyond int32")
        t = t.to(torch.int32)
    return t.contiguous()


def f32_to_e4m3_bits(x: Tensor, scalar: bool = False) -> Tensor | None:
    """The C converter (test hook): float32 ``x`` -> uint8 e4m3fn bits of ``clamp(x, -448, 448)``,
    through the vector path (``scalar=False``) or the scalar one; None without the library."""
    lib = _lib()
    if lib is None:
        return None
    x = x.float().contiguous().reshape(-1)
    out = torch.empty(x.numel(), dtype=torch.uint8)
    lib.pagoda_f32_to_e4m3(x.data_ptr(), x.numel(), out.data_ptr(), int(scalar))
    return out


def f32_to_int8(x: Tensor, scale: float, scalar: bool = False) -> Tensor | None:
    """The C int8 quantizer (test hook): float32 ``x`` -> int8 ``round(x / scale)`` clamped to
    +-127, NaN -> 0, through the vector path (``scalar=False``) or the scalar one; None without the
    library."""
    lib = _lib()
    if lib is None:
        return None
    x = x.float().contiguous().reshape(-1)
    out = torch.empty(x.numel(), dtype=torch.int8)
    lib.pagoda_f32_to_int8(x.data_ptr(), x.numel(), scale, out.data_ptr(), int(scalar))
    return out
