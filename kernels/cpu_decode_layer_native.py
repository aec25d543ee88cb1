"""ctypes side of ``cpu_decode_layer.c``: a whole decoder layer's step as one native call.

``DecodeLayerSpec`` holds one layer's fixed part (norm weights, four INT4 or per-channel FP8
weights) as a C struct built once; ``run_decode_layers`` runs every layer of one step over the
step's pages, one block table row and context length per token (``token_tables`` expands a prefill
chunk's). The caller (node_agent/models/native_decode.py) decides which models and steps this path
serves.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .cpu_attention_native import _int32, _mode, _scale_arg
from .cpu_attention_native import _lib as _attention_lib
from .cpu_fp8_native import fused_available
from .fp8 import Fp8Weight
from .int4 import Int4Weight

_ptr, _i64, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _I4(ctypes.Structure):
    _fields_ = [
        ("packed", _ptr), ("scales", _ptr), ("offsets", _ptr),
        ("mode", _i64), ("n", _i64), ("k", _i64), ("group", _i64), ("interleaved", _i64), ("fp8", _i64),
    ]  # fmt: skip


class _Layer(ctypes.Structure):
    _fields_ = [
        ("hidden", _i64), ("hq", _i64), ("hkv", _i64), ("d", _i64), ("inter", _i64), ("eps", _f32),
        ("in_norm", _ptr), ("post_norm", _ptr),
        ("qkv", _I4), ("o", _I4), ("gate_up", _I4), ("down", _I4),
        ("k_cache", _ptr), ("k_scale", _ptr), ("v_cache", _ptr), ("v_scale", _ptr),
        ("k_mode", _i64), ("v_mode", _i64),
        ("qkv_bias", _ptr), ("q_norm", _ptr), ("k_norm", _ptr), ("window", _i64),
    ]  # fmt: skip


class _Step(ctypes.Structure):
    _fields_ = [
        ("t", _i64), ("slots", _ptr), ("num_slots", _i64), ("cos", _ptr), ("sin", _ptr),
        ("tables", _ptr), ("cols", _i64), ("lens", _ptr), ("num_pages", _i64), ("page_size", _i64),
        ("scale", _f32), ("scratch", _ptr), ("threads", _i64),
    ]  # fmt: skip


def library() -> ctypes.CDLL | None:
    """The native library with this file's functions typed, or None when it is unavailable."""
    lib = _attention_lib()
    if lib is None or getattr(lib, "pagoda_decode_layer_ready", False):
        return lib
    lib.pagoda_decode_layer.restype = ctypes.c_int
    lib.pagoda_decode_layer.argtypes = [ctypes.POINTER(_Layer), ctypes.POINTER(_Step), _ptr]
    lib.pagoda_decode_scratch_floats.restype = _i64
    lib.pagoda_decode_scratch_floats.argtypes = [_i64] * 6
    lib.pagoda_decode_layer_ready = True
    return lib


def _i4(w: Int4Weight) -> _I4:
    scales, offsets, mode = w.native_params()
    nibbles, interleaved = w.native_nibbles()
    return _I4(
        nibbles.data_ptr(), scales.data_ptr(), offsets.data_ptr(),
        mode, w.out_features, w.in_features, w.group_size, int(interleaved),
    )  # fmt: skip


def _fp8(w: Fp8Weight) -> tuple[_I4, Tensor]:
    """The struct of an FP8 weight and its float32 scales (kept alive by the spec)."""
    scales = w.scale.float().contiguous()
    codes = w.weight.view(torch.uint8)
    return _I4(codes.data_ptr(), scales.data_ptr(), None, 0, w.out_features, w.in_features, 0, 0, 1), scales


def fp8_servable(w: object) -> bool:
    """Whether the native layer can run this weight: per-channel FP8 with contiguous CPU codes, K a
    multiple of 16, and the fused kernel built (AVX-512 F)."""
    if type(w) is not Fp8Weight or w.weight.device.type != "cpu" or not w.weight.is_contiguous():
        return False
    return w.in_features % 16 == 0 and w.scale.shape == (w.out_features,) and fused_available()


def int4_servable(w: object) -> bool:
    """Whether the native layer can run this weight: INT4 with its canonical CPU tensors, parameters
    the kernel reads (float32, float16 or codes), K a multiple of the group."""
    nibbles = w.native_nibbles() if isinstance(w, Int4Weight) else None
    if nibbles is None or nibbles[0].device.type != "cpu" or w.in_features % w.group_size:
        return False
    return w.native_params() is not None


@dataclass
class DecodeLayerSpec:
    """One layer's fixed inputs; keeps the tensors its C struct points into alive."""

    c: _Layer
    keep: tuple

    @classmethod
    def build(
        cls,
        hq: int,
        hkv: int,
        d: int,
        eps: float,
        in_norm: Tensor,
        post_norm: Tensor,
        qkv: Int4Weight | Fp8Weight,
        o: Int4Weight | Fp8Weight,
        gate_up: Int4Weight | Fp8Weight,
        down: Int4Weight | Fp8Weight,
        qkv_bias: Tensor | None = None,
        qk_norms: tuple[Tensor, Tensor] | None = None,
        window: int | None = None,
    ) -> DecodeLayerSpec:
        """The layer's C struct (each projection INT4 or FP8, as ``int4_servable``/``fp8_servable``
        accept); ``window``: its sliding window (None: every earlier key)."""
        hidden, inter = o.out_features, down.in_features
        shapes = {
            "qkv": (qkv.out_features, qkv.in_features, (hq + 2 * hkv) * d, hidden),
            "o": (o.out_features, o.in_features, hidden, hq * d),
            "gate_up": (gate_up.out_features, gate_up.in_features, 2 * inter, hidden),
            "down": (down.out_features, down.in_features, hidden, inter),
        }
        for name, (n, k, want_n, want_k) in shapes.items():
            if (n, k) != (want_n, want_k):
                raise ValueError(f"{name} weight is [{n}, {k}], the layer needs [{want_n}, {want_k}]")
        norms = (in_norm.float().contiguous(), post_norm.float().contiguous())
        extra: list[Tensor] = []

        def weight(w: Int4Weight | Fp8Weight) -> _I4:
            if isinstance(w, Int4Weight):
                return _i4(w)
            struct, scales = _fp8(w)
            extra.append(scales)
            return struct

        c = _Layer(
            hidden, hq, hkv, d, inter, eps, norms[0].data_ptr(), norms[1].data_ptr(),
            weight(qkv), weight(o), weight(gate_up), weight(down),
        )  # fmt: skip
        c.window = window or 0
        if qkv_bias is not None:
            bias = qkv_bias.float().contiguous()
            if bias.shape != ((hq + 2 * hkv) * d,):
                raise ValueError(f"qkv bias is {tuple(bias.shape)}, the layer needs [{(hq + 2 * hkv) * d}]")
            c.qkv_bias = bias.data_ptr()
            extra.append(bias)
        if qk_norms is not None:
            qn, kn = (w.float().contiguous() for w in qk_norms)
            if qn.shape != (d,) or kn.shape != (d,):
                raise ValueError(
                    f"q/k norm weights are {tuple(qn.shape)}, {tuple(kn.shape)}; the layer needs [{d}]"
                )
            c.q_norm, c.k_norm = qn.data_ptr(), kn.data_ptr()
            extra += [qn, kn]
        return cls(c, (norms, qkv, o, gate_up, down, *extra))


LayerPages = tuple[dict[str, Tensor], dict[str, Tensor], tuple[int, int]]  # caches, scales, C modes
# pagoda_decode_layer's codes for a projection's GEMM (10, 40, 50, 60 + the kernel's code) when the VNNI
# kernel found NaN or inf in its input (code 6)
_NON_FINITE_GEMM = {16: "qkv_proj", 46: "o_proj", 56: "gate_up_proj", 66: "down_proj"}


def page_modes(cache: dict[str, Tensor], scales: dict[str, Tensor]) -> tuple[int, int] | None:
    """The C modes of a layer's K and V pages, or None when this path does not serve them."""
    k, v = cache.get("k"), cache.get("v")
    if k is None or v is None:
        return None
    km, vm = _mode(k, scales.get("k")), _mode(v, scales.get("v"))
    return None if km is None or vm is None else (km, vm)


def token_tables(block_tables: Tensor, cu_q_lens: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
    """A prefill chunk's per-token attention rows: each token's sequence's block table row and, as its
    context length, its position + 1 (its own key and every earlier one)."""
    counts = (cu_q_lens[1:] - cu_q_lens[:-1]).long()
    rows = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)
    return block_tables[rows.to(block_tables.device)], (positions + 1).to(torch.int32)


def run_decode_layers(
    specs: Sequence[DecodeLayerSpec],
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    slots: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    pages: Sequence[LayerPages],
    scale: float,
    threads: int,
) -> Tensor:
    """Every layer over ``x [T, hidden]`` (a new tensor is returned). ``pages[i]`` is layer i's
    (caches, scales, ``page_modes``). Raises ValueError for slots, lengths or page ids outside the
    pool."""
    lib = library()
    if lib is None:
        raise RuntimeError("the native CPU kernels are unavailable")
    t, first = x.shape[0], specs[0].c
    hq, hkv, d = first.hq, first.hkv, first.d
    x = x.float().contiguous().clone()
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    slots = slots.long().contiguous()
    tables = _int32(block_tables, "block_tables")
    lens = _int32(context_lens.reshape(-1), "context_lens")
    k0 = pages[0][0]["k"]
    num_pages, page_size = k0.shape[0], k0.shape[1]
    if cos.shape != (t, d) or sin.shape != (t, d) or slots.shape != (t,) or tables.shape[0] != t:
        raise ValueError(
            f"native decode layer: {t} tokens with cos {tuple(cos.shape)}, slots {tuple(slots.shape)}, "
            f"tables {tuple(tables.shape)}"
        )
    if t and (int(slots.max()) >= num_pages * page_size):
        raise ValueError(f"slot {int(slots.max())} is beyond the KV pool's {num_pages * page_size} slots")
    need = lib.pagoda_decode_scratch_floats(t, first.hidden, hq, hkv, d, first.inter)
    scratch = torch.empty(need, dtype=torch.float32)
    step = _Step(
        t, slots.data_ptr(), num_pages * page_size, cos.data_ptr(), sin.data_ptr(), tables.data_ptr(),
        tables.shape[1], lens.data_ptr(), num_pages, page_size, scale, scratch.data_ptr(), threads,
    )  # fmt: skip
    for i, (spec, (cache, page_scales, (km, vm))) in enumerate(zip(specs, pages, strict=True)):
        if cache["k"].shape[:2] != (num_pages, page_size):
            raise ValueError(f"layer {i}: pages of another shape than layer 0's")
        ks, vs = _scale_arg(km, page_scales.get("k")), _scale_arg(vm, page_scales.get("v"))
        c = spec.c
        c.k_cache, c.v_cache = cache["k"].data_ptr(), cache["v"].data_ptr()
        c.k_scale, c.v_scale = (
            (None if ks is None else ks.data_ptr()),
            (None if vs is None else vs.data_ptr()),
        )
        c.k_mode, c.v_mode = km, vm
        rc = lib.pagoda_decode_layer(ctypes.byref(c), ctypes.byref(step), x.data_ptr())
        if rc == 20:
            raise ValueError(f"layer {i}: a slot lies outside the KV pool")
        if rc == 30:
            raise ValueError(f"layer {i}: a context length or page id lies outside the block table or pool")
        if rc in _NON_FINITE_GEMM:
            raise FloatingPointError(f"layer {i}: NaN or inf in the activations of {_NON_FINITE_GEMM[rc]}")
        if rc:
            raise RuntimeError(f"native decode layer {i} failed (code {rc})")
    return x
