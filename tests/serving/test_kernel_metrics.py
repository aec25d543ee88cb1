"""/metrics carries the kernel table of the model this process built: one info series per op."""

from __future__ import annotations

import torch

from pagoda.kernels.selector import select_kernels
from pagoda.node_agent.serving.api.metrics import EngineSnapshot, ServeMetrics, kernel_backends


def test_the_kernel_table_is_an_info_series_per_op() -> None:
    sel = select_kernels("cpu", torch.float32, int4_compute="bf16")
    sel.note("decode_layers", "off", "a test's model")
    sel.log_table()
    assert kernel_backends() == {op: backend for op, backend, _ in sel.rows()}
    text = ServeMetrics("decode", lambda: EngineSnapshot(ready=True)).render().decode()
    lines = [ln for ln in text.splitlines() if ln.startswith("pagoda_kernel_backend_info{")]
    assert len(lines) == len(sel.table)
    assert any('op="int4_gemm"' in ln and 'backend="torch-int4pack-bf16"' in ln for ln in lines)
    assert all('pool="decode"' in ln and ln.endswith(" 1.0") for ln in lines)
