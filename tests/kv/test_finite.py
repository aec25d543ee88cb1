"""The value check of arriving KV pages: every chunk is looked at, and each dtype family is judged
by its own rule."""

from __future__ import annotations

import pytest
import torch

from pagoda.node_agent.kv import finite
from pagoda.node_agent.kv.finite import NON_FINITE, OUT_OF_RANGE, bad_values


def test_a_bad_value_in_the_last_chunk_is_found(monkeypatch) -> None:
    monkeypatch.setattr(finite, "CHUNK_BYTES", 64)  # 16 float32 per pass
    x = torch.zeros(10, 7)
    assert bad_values(x) is None
    x[-1, -1] = float("nan")
    assert bad_values(x) == NON_FINITE
    x[-1, -1] = -1e6
    assert bad_values(x) == OUT_OF_RANGE and bad_values(x, max_abs=1e7) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_floating_pages(dtype) -> None:
    x = torch.randn(4, 8).to(dtype)
    assert bad_values(x) is None
    x[1, 2] = float("inf")
    assert bad_values(x) == NON_FINITE


def test_fp8_pages_refuse_only_nan_encodings_and_int8_pages_pass() -> None:
    x = torch.tensor([1.0, -448.0, 0.0]).to(torch.float8_e4m3fn)
    assert bad_values(x) is None
    x.view(torch.uint8)[1] = 0x7F
    assert bad_values(x) == NON_FINITE
    assert bad_values(torch.tensor([-128, 127], dtype=torch.int8)) is None
