"""INT4 experts on the CPU honour the INT4 compute: "float32" runs the exact native kernel over each
expert's routed rows (the float32 product of the dequantized weights up to summation order),
"bf16" torch's int4pack op (bf16 activations and scales)."""

from __future__ import annotations

import copy

import pytest
import torch

from pagoda.kernels.cpu_int4_native import library
from pagoda.kernels.moe import fused_moe, make_expert_stack, moe_reference

pytestmark = pytest.mark.skipif(library() is None, reason="the native CPU kernels are not built here")

E, H, INTER, T, K = 6, 128, 64, 24, 2
# float32 summation order only (the reference dequantizes and multiplies in float32): measured
# ~1e-6 of outputs of ~1; bf16 activations and scales: ~1e-2.
MAX_F32_DIFF = 1e-4
MIN_BF16_DIFF = 1e-3


def _case(symmetric: bool):
    g = torch.Generator().manual_seed(3)
    gate, up = torch.randn(E, INTER, H, generator=g) * 0.1, torch.randn(E, INTER, H, generator=g) * 0.1
    down = torch.randn(E, H, INTER, generator=g) * 0.1
    stack = make_expert_stack(gate, up, down, "int4", group_size=32, symmetric=symmetric)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    weights = torch.rand(T, K, generator=g)
    return stack, x, weights, ids


@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_experts_compute_as_asked(symmetric):
    stack, x, weights, ids = _case(symmetric)
    want = moe_reference(x, weights, ids, stack)
    exact, fast = copy.deepcopy(stack), copy.deepcopy(stack)
    exact.prepare("cpu", keep_canonical=False, compute="float32")
    fast.prepare("cpu", keep_canonical=False, compute="bf16")
    assert exact.cpu_compute == "float32" and fast.cpu_compute == "bf16"
    assert not exact.canonical and exact.int4_weight("down", 0).cpu_compute == "float32"
    got = fused_moe(x, weights, ids, exact, backend="cpu")
    diff = (got - want).abs().max().item()
    assert diff <= MAX_F32_DIFF, diff
    assert (fused_moe(x, weights, ids, fast, backend="cpu") - want).abs().max().item() >= MIN_BF16_DIFF
    # every held tensor is counted, and the values survive: the reference reads them back exactly
    assert exact.nbytes() > 0
    assert torch.equal(exact.dequantize(2)[1], stack.dequantize(2)[1])
