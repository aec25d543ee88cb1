"""GGUF Q4_0 / Q4_1 blocks load into INT4 exactly: the same values gguf's own dequantization gives."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pagoda.kernels.int4 import Int4Weight, dequantize_int4
from pagoda.node_agent.models.gguf_blocks import int4_from_gguf, permute_rows
from pagoda.node_agent.models.layers import concat_rows
from pagoda.node_agent.models.loader import _unpermute_rope, resolve_source


def _blocks(type_name: str, rows: int, cols: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Random ggml blocks written from the format's definition, and the weights they hold."""
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 16, size=(rows, cols // 32, 32), dtype=np.uint8)
    d = (rng.random((rows, cols // 32)) * 0.05 + 1e-3).astype(np.float16)
    m = (-rng.random((rows, cols // 32)) * 0.2).astype(np.float16)
    qs = (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8)  # byte j: weight j low, j + 16 high
    head = [d[..., None].view(np.uint8)]
    if type_name == "Q4_1":
        head.append(m[..., None].view(np.uint8))
        w = q * d[..., None].astype(np.float32) + m[..., None].astype(np.float32)
    else:
        w = (q.astype(np.float32) - 8) * d[..., None].astype(np.float32)
    raw = np.concatenate([*(h.reshape(rows, cols // 32, 2) for h in head), qs], axis=-1)
    return raw.reshape(rows, -1), w.reshape(rows, cols)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1"])
def test_blocks_load_exactly(type_name):
    raw, w = _blocks(type_name, 24, 96, seed=1)
    qw = int4_from_gguf(type_name, raw, 24, 96)
    assert qw.group_size == 32 and qw.symmetric == (type_name == "Q4_0")
    assert torch.equal(dequantize_int4(qw), torch.from_numpy(w))
    ref = gguf.dequantize(raw, gguf.GGMLQuantizationType[type_name]).reshape(24, 96)
    assert torch.equal(dequantize_int4(qw), torch.from_numpy(np.asarray(ref, dtype=np.float32)))


def test_bad_blocks_are_refused():
    with pytest.raises(ValueError, match="not an INT4-exact"):
        int4_from_gguf("Q8_0", np.zeros((2, 34), np.uint8), 2, 32)
    with pytest.raises(ValueError, match="whole 32-weight blocks"):
        int4_from_gguf("Q4_1", np.zeros((2, 20), np.uint8), 2, 30)


def test_row_permutation_and_fusion_keep_values():
    raw0, w0 = _blocks("Q4_0", 16, 64, seed=2)
    raw1, w1 = _blocks("Q4_1", 8, 64, seed=3)
    a, b = int4_from_gguf("Q4_0", raw0, 16, 64), int4_from_gguf("Q4_1", raw1, 8, 64)
    order = torch.randperm(16, generator=torch.Generator().manual_seed(0))
    assert torch.equal(dequantize_int4(permute_rows(a, order)), torch.from_numpy(w0)[order])
    fused = concat_rows([a, b])  # symmetric + float zero -> one float-zero weight, same values
    assert isinstance(fused, Int4Weight) and fused.float_zero
    assert torch.equal(dequantize_int4(fused), torch.from_numpy(np.concatenate([w0, w1])))
    assert concat_rows([a, torch.zeros(4, 64)]) is None  # mixed kinds are not fused


def test_builtin_model_linears_are_its_q4_1_blocks(builtin_loaded):
    """Every block linear of the built-in GGUF is Q4_1 and arrives as INT4 with float zeros, holding
    exactly what gguf's dequantization (the transformers reference's weights) gives."""
    ints = {k: v for k, v in builtin_loaded.weights.items() if isinstance(v, Int4Weight)}
    assert len(ints) == 30 * 7 and all(v.float_zero and v.group_size == 32 for v in ints.values())
    _, path = resolve_source("builtin://smollm2-135m")
    reader = gguf.GGUFReader(str(path))
    want = {"blk.5.attn_q.weight": ("model.layers.5.self_attn.q_proj.weight", 9)}
    want["blk.5.ffn_up.weight"] = ("model.layers.5.mlp.up_proj.weight", None)
    for t in reader.tensors:
        if t.name in want:
            hf, heads = want[t.name]
            arr = np.asarray(gguf.dequantize(t.data, t.tensor_type), dtype=np.float32)
            arr = arr.reshape([int(d) for d in reversed(t.shape)])
            if heads:
                arr = _unpermute_rope(arr, heads)
            assert torch.equal(dequantize_int4(ints[hf]), torch.from_numpy(np.array(arr)))
