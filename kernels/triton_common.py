"""Small helpers shared by the Triton kernel wrappers."""

from __future__ import annotations

import functools

import torch

from .dispatch import triton_interpreting


def dot_in_input_dtype(x: torch.Tensor) -> bool:
    """Feed bf16/fp16 operands to ``tl.dot`` as they are (tensor cores) on a GPU.

    The interpreter mis-computes 16-bit dots, so there operands are widened to float32 first.
    """
    return x.dtype in (torch.bfloat16, torch.float16) and x.is_cuda and not triton_interpreting()


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def target_programs(device: torch.device) -> int:
    """Programs that keep the device busy: 2 per SM on a GPU, a handful under the interpreter."""
    if device.type == "cuda" and not triton_interpreting():
        return 2 * _sm_count(device.index or 0)
    return 4
