"""Block-scaled FP8 weights (DeepSeek-V3's 128x128 layout, here smaller blocks with partial edges):
exact dequantization, the tiled CPU path, row maps after stacking and slicing, and the Triton
kernel against the reference (interpreter on CPU)."""

import pytest
import torch
from kernel_testing import needs_triton

from pagoda.kernels.fp8_block import (
    Fp8BlockWeight,
    concat_block_rows,
    fp8_block_act_reference,
    fp8_block_linear,
    fp8_block_reference,
    quantize_fp8_block,
)
from pagoda.kernels.fp8_format import FP8_DTYPE


def _by_loops(w: Fp8BlockWeight) -> torch.Tensor:
    """Dequantization written element block by element block (independent of the module)."""
    n, k = w.weight.shape
    bn, bk = w.block
    out = torch.empty(n, k)
    for r in range(n):
        for c0 in range(0, k, bk):
            out[r, c0 : c0 + bk] = w.weight[r, c0 : c0 + bk].float() * w.scale[r // bn, c0 // bk]
    return out


@pytest.mark.parametrize(("n", "k", "block"), [(40, 48, (16, 32)), (32, 64, (16, 16)), (7, 5, (4, 4))])
def test_quantize_and_dequantize_are_exact_per_block(n, k, block):
    torch.manual_seed(n + k)
    src = torch.randn(n, k) * torch.linspace(0.1, 4, k)
    w = quantize_fp8_block(src, block)
    assert w.weight.dtype == FP8_DTYPE
    assert w.scale.shape == (-(-n // block[0]), -(-k // block[1]))
    assert torch.equal(w.dequantize(), _by_loops(w))
    assert torch.equal(w.dequantize(), w.weight.float() * w.scales_for_rows())
    assert ((w.dequantize() - src).norm() / src.norm()).item() < 0.05  # e4m3 rounding only


def test_cpu_path_equals_the_reference_and_rows_tile():
    torch.manual_seed(0)
    w = quantize_fp8_block(torch.randn(300, 80), (128, 32))  # 300 rows: 3 tiles, a partial block
    x, bias = torch.randn(5, 80), torch.randn(300)
    want = fp8_block_reference(x, w, bias)
    got = fp8_block_linear(x, w, bias, backend="cpu")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        fp8_block_linear(x[None], w, backend="reference")[0], fp8_block_reference(x, w), rtol=0, atol=0
    )


def test_stacked_and_sliced_weights_keep_every_value():
    torch.manual_seed(1)
    a, b = (
        quantize_fp8_block(torch.randn(20, 48), (16, 16)),
        quantize_fp8_block(torch.randn(12, 48), (16, 16)),
    )
    both = concat_block_rows([a, b])
    assert torch.equal(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    part = both.take_rows(9, 27)  # across the join and inside partial blocks
    assert torch.equal(part.dequantize(), both.dequantize()[9:27])
    cols = both.take_cols(16, 48)
    assert torch.equal(cols.dequantize(), both.dequantize()[:, 16:48])
    with pytest.raises(ValueError, match="splits the FP8 blocks"):
        both.take_cols(8, 48)
    assert concat_block_rows([a, quantize_fp8_block(torch.randn(4, 32), (16, 16))]) is None


def test_huge_block_scales_dequantize_exactly_too():
    w = quantize_fp8_block(torch.randn(20, 40) * 1e6, (16, 16))  # scales above 2**8: no folding
    assert w.scale.max() > 2**8
    assert torch.equal(w.dequantize(), _by_loops(w))


def test_checkpoint_scale_shape_is_checked():
    w = quantize_fp8_block(torch.randn(20, 40), (16, 16))
    with pytest.raises(ValueError, match=r"q_proj.weight_scale_inv must be \(2, 3\)"):
        Fp8BlockWeight.from_checkpoint(w.weight, w.scale[:1], (16, 16), "q_proj.weight")


@needs_triton
@pytest.mark.parametrize(("m", "n", "k"), [(1, 24, 40), (5, 70, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernel_matches_the_reference(m, n, k, dtype):
    torch.manual_seed(m + n)
    w = concat_block_rows(
        [quantize_fp8_block(torch.randn(n - 8, k), (16, 16)), quantize_fp8_block(torch.randn(8, k), (16, 16))]
    )
    x, bias = torch.randn(m, k).to(dtype), torch.randn(n)
    got = fp8_block_linear(x, w, bias, backend="triton")
    assert got.dtype == dtype and got.shape == (m, n)
    # exactly the reference on the kernel's rounded activations (summation order aside) ...
    torch.testing.assert_close(got.float(), fp8_block_act_reference(x, w, bias).float(), rtol=2e-2, atol=2e-2)
    if dtype == torch.float32:
        torch.testing.assert_close(got, fp8_block_act_reference(x, w, bias), rtol=1e-4, atol=1e-4)
    # ... and within e4m3 activation rounding of the weight-only reference
    want = fp8_block_reference(x.float(), w, bias)
    assert ((got.float() - want).norm() / want.norm()).item() < 0.05


def test_block_expert_stack_runs_its_block_scales():
    from pagoda.kernels.moe import ExpertStack, fused_moe, moe_reference

    torch.manual_seed(2)
    e, h, i, block = 3, 40, 24, (16, 16)
    gus = [concat_block_rows([quantize_fp8_block(torch.randn(i, h), block) for _ in "gu"]) for _ in range(e)]
    downs = [quantize_fp8_block(torch.randn(h, i), block) for _ in range(e)]
    stack = ExpertStack(
        "fp8_block",
        e,
        h,
        i,
        torch.stack([g.weight for g in gus]),
        torch.stack([d.weight for d in downs]),
        gate_up_scales=torch.stack([g.scale for g in gus]),
        down_scales=torch.stack([d.scale for d in downs]),
        block=block,
        gate_up_rows=torch.stack([g.row_block for g in gus]),
        down_rows=torch.stack([d.row_block for d in downs]),
    )
    assert torch.equal(stack.dequantize(1)[0], gus[1].dequantize())
    assert stack.nbytes() == sum(g.nbytes + d.nbytes for g, d in zip(gus, downs, strict=True))
    x = torch.randn(6, h)
    ids = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2], [1, 0], [2, 1]])
    wts = torch.rand(6, 2)
    want = moe_reference(x, wts, ids, stack)
    torch.testing.assert_close(fused_moe(x, wts, ids, stack, backend="cpu"), want, rtol=1e-5, atol=1e-5)
