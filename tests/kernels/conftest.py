"""Kernel-test setup: Triton runs in its interpreter on CPU tensors when there is no GPU.

TRITON_INTERPRET is read when ``@triton.jit`` decorates a function, so it must be set before any
Triton kernel module is imported (the ops import them lazily, on first use).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _no_backend_override(monkeypatch):
    """Tests choose backends explicitly; a developer's PAGODA_KERNELS must not rewrite them."""
    monkeypatch.delenv("PAGODA_KERNELS", raising=False)
