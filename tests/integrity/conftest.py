"""Integrity tests run the model with one torch thread: on a shared, busy CPU, several threads per
process oversubscribe the cores and make every step many times slower."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


if not torch.cuda.is_available():  # Triton kernels run in the interpreter (set before they load)
    os.environ.setdefault("TRITON_INTERPRET", "1")
