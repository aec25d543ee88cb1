"""The decode glue: eager ops match the layer code they replace; --compile compiles them at load
(or falls back to eager, saying why) and generates the same tokens."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagoda.node_agent.models import step_ops
from pagoda.node_agent.models.rope import apply_rope
from pagoda.node_agent.params import SamplingParams


def test_eager_glue_matches_plain_torch():
    gen = torch.Generator().manual_seed(0)
    hq, hkv, d, t = 4, 2, 8, 3
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen)
    cos, sin = torch.randn(t, d, generator=gen), torch.randn(t, d, generator=gen)
    q, k, v = step_ops.rope_qk(qkv, cos, sin, hq, hkv, d)
    heads = qkv.view(t, hq + 2 * hkv, d)
    torch.testing.assert_close(q, apply_rope(heads[:, :hq], cos, sin), rtol=0, atol=0)
    torch.testing.assert_close(k, apply_rope(heads[:, hq : hq + hkv], cos, sin), rtol=0, atol=0)
    assert torch.equal(v, heads[:, hq + hkv :])
    gu = torch.randn(t, 2 * d, generator=gen)
    assert torch.equal(step_ops.swiglu(gu), F.silu(gu[:, :d]) * gu[:, d:])
    x, delta, w = (
        torch.randn(t, d, generator=gen),
        torch.randn(t, d, generator=gen),
        torch.randn(d, generator=gen),
    )
    y, normed = step_ops.add_rms_norm(x, delta, w, 1e-6)
    assert torch.equal(y, x + delta)
    yf = (x + delta).double()
    want = (w.double() * yf * torch.rsqrt(yf.pow(2).mean(-1, keepdim=True) + 1e-6)).float()
    torch.testing.assert_close(normed, want)


def test_compile_failure_falls_back_to_eager_with_reason(monkeypatch, caplog):
    step_ops.disable_compile()

    def broken(*a, **k):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(torch, "compile", broken)
    assert step_ops.enable_compile(torch.device("cpu"), torch.float32, 4, 2, 8) is False
    assert step_ops.compile_state == {"enabled": False, "reason": "RuntimeError: no C++ compiler found"}
    assert step_ops.OPS == step_ops.EAGER
    assert "running eager: RuntimeError: no C++ compiler found" in caplog.text


@pytest.mark.slow
def test_compiled_engine_generates_the_same_tokens(make_engine):
    """Compiles at load (inductor, C++ on this CPU), then greedy tokens equal the eager engine's."""
    prompts = ["What is the capital of France?", "Write one sentence about rain."]
    params = SamplingParams(max_tokens=16, temperature=0.0)
    step_ops.disable_compile()
    eager = _greedy(make_engine(), prompts, params)
    try:
        engine = make_engine(compile=True)
        assert step_ops.compile_state["enabled"], step_ops.compile_state["reason"]
        assert step_ops.OPS["swiglu"] is not step_ops.EAGER["swiglu"]
        compiled = _greedy(engine, prompts, params)
    finally:
        step_ops.disable_compile()
    assert compiled == eager


def _greedy(engine, prompts: list[str], params: SamplingParams) -> list[list[int]]:
    ids = [engine.add_request(p, params) for p in prompts]
    final = engine.run_until_done()
    return [final[i].token_ids for i in ids]
