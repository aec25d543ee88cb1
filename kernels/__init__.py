"""pagoda.kernels: quantized linear layers, paged KV attention and KV page integrity.

Every op has a torch ``reference``, a vectorized ``cpu`` path and (for the hot ops) a ``triton``
kernel; :func:`select_backend` picks one per call. :func:`select_kernels` (selector.py) decides and
reports, once per model, which backend each op runs and why. Triton is imported lazily, only when
used.
"""

from .dispatch import Backend, kernel_stats, reset_kernel_stats, select_backend
from .fp8 import Fp8Weight, fp8_linear
from .fp8_format import FP8_MAX, dequantize_fp8, quantize_fp8, quantize_fp8_weight
from .int4 import Int4Weight, dequantize_int4, int4_linear, pick_group_size, quantize_int4
from .integrity import check_page_tags, find_mismatches, next_tag
from .linear import LinearWeight, make_linear_weight
from .paged_attention import (
    calibrate_kv_scales,
    convert_pages,
    paged_decode_attention,
    paged_prefill_attention,
    write_kv,
)
from .selector import KernelSelection, KernelSelectionError, select_kernels

__all__ = [
    "FP8_MAX",
    "Backend",
    "Fp8Weight",
    "Int4Weight",
    "KernelSelection",
    "KernelSelectionError",
    "LinearWeight",
    "calibrate_kv_scales",
    "check_page_tags",
    "convert_pages",
    "dequantize_fp8",
    "dequantize_int4",
    "find_mismatches",
    "fp8_linear",
    "int4_linear",
    "kernel_stats",
    "make_linear_weight",
    "next_tag",
    "paged_decode_attention",
    "paged_prefill_attention",
    "pick_group_size",
    "quantize_fp8",
    "quantize_fp8_weight",
    "quantize_int4",
    "reset_kernel_stats",
    "select_backend",
    "select_kernels",
    "write_kv",
]
