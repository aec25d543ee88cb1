"""One check shared by the sharded-load tests: two loads' parameter objects are identical."""

from __future__ import annotations

import torch

from pagoda.kernels.fp8_block import Fp8BlockWeight
from pagoda.kernels.int4 import Int4Weight
from pagoda.node_agent.models.parallel import ColumnShard


def same_weights(a: object, b: object, name: str) -> None:
    if isinstance(a, ColumnShard):
        assert isinstance(b, ColumnShard) and a.full_in == b.full_in, name
        same_weights(a.weight, b.weight, name)
        assert (a.row_amax is None) == (b.row_amax is None), name
        if a.row_amax is not None:
            assert torch.equal(a.row_amax, b.row_amax), name
        return
    if isinstance(a, Fp8BlockWeight):
        assert isinstance(b, Fp8BlockWeight) and a.block == b.block, name
        assert torch.equal(a.weight.view(torch.uint8), b.weight.view(torch.uint8)), name
        assert torch.equal(a.scale, b.scale) and torch.equal(a.row_block, b.row_block), name
        return
    if isinstance(a, Int4Weight):
        assert isinstance(b, Int4Weight), name
        assert (a.out_features, a.in_features, a.group_size, a.symmetric) == (
            b.out_features,
            b.in_features,
            b.group_size,
            b.symmetric,
        ), name
        sa, sb = a.state(), b.state()
        assert sorted(sa) == sorted(sb), name
        for k in sa:
            assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), f"{name}.{k}"
        return
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), (name, type(a), type(b))
    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name
