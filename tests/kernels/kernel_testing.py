"""Shared helpers for the kernel tests (backend lists, a paged KV pool builder, the native library
for the VNNI kernels' tests)."""

from __future__ import annotations

import ctypes
import math
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from pagoda.kernels.dispatch import triton_available
from pagoda.kernels.fp8_format import FP8_DTYPE
from pagoda.kernels.paged_attention import calibrate_kv_scales, write_kv
from tests.native_build import native_built, require_native  # noqa: F401  (re-exported)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")
ALL_BACKENDS = ["reference", "cpu", pytest.param("triton", marks=needs_triton)]
FAST_BACKENDS = ["cpu", pytest.param("triton", marks=needs_triton)]

KV_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": FP8_DTYPE}


@dataclass
class PagedKV:
    """A filled paged KV pool plus the float K/V each sequence holds (for checks)."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_pages] int32, padded with 0
    context_lens: torch.Tensor  # [B] int32
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    keys: list[torch.Tensor]  # per sequence [L, Hkv, D] float32
    values: list[torch.Tensor]


def make_paged_kv(
    context_lens: list[int],
    page_size: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int = 0,
    spare_pages: int = 3,
) -> PagedKV:
    """Random K/V for each sequence written to randomly permuted pages via the reference write."""
    gen = torch.Generator().manual_seed(seed)
    need = [math.ceil(n / page_size) for n in context_lens]
    total = sum(need) + spare_pages
    perm = torch.randperm(total, generator=gen)
    max_pages = max(max(need), 1) + 1  # one padding column always present
    tables = torch.zeros(len(context_lens), max_pages, dtype=torch.int32)
    keys = [torch.randn(n, kv_heads, head_dim, generator=gen) for n in context_lens]
    values = [torch.randn(n, kv_heads, head_dim, generator=gen) * 2 for n in context_lens]
    k_scale = v_scale = None
    if dtype == FP8_DTYPE:
        k_scale, v_scale = calibrate_kv_scales(torch.cat(keys), torch.cat(values))
    shape = (total, page_size, kv_heads, head_dim)
    k_cache = torch.zeros(shape, dtype=dtype)
    v_cache = torch.zeros(shape, dtype=dtype)
    pos = 0
    for b, n in enumerate(context_lens):
        pages = perm[pos : pos + need[b]]
        pos += need[b]
        tables[b, : need[b]] = pages.to(torch.int32)
        slots = pages.repeat_interleave(page_size) * page_size + torch.arange(page_size).repeat(need[b])
        write_kv(k_cache, v_cache, keys[b], values[b], slots[:n], k_scale, v_scale, backend="reference")

    def to(t):
        return None if t is None else t.to(DEVICE)

    return PagedKV(
        to(k_cache),
        to(v_cache),
        to(tables),
        to(torch.tensor(context_lens, dtype=torch.int32)),
        to(k_scale),
        to(v_scale),
        keys,
        values,
    )


def native_library() -> ctypes.CDLL:
    """The native kernels' library; a skip only where no C compiler exists (tests/native_build.py)."""
    return require_native()


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """Small float64 references: one torch thread, so a busy core cannot stall them at a barrier."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
