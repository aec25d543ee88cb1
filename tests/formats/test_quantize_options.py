"""`pagoda quantize` options: float zero points, per-layer group sizes, the calibration clip search,
and INT4 sources written through unchanged. Runs on a tiny random Llama saved by transformers."""

from __future__ import annotations

import json

import pytest
import torch

from pagoda.kernels.int4 import Int4Weight, quantize_int4
from pagoda.node_agent.cli.main import main
from pagoda.node_agent.engine.calibration import linear_input_grams
from pagoda.node_agent.engine.config import EngineConfig, PhaseFormats
from pagoda.node_agent.engine.llm_engine import LLMEngine
from pagoda.node_agent.models.config import LINEAR_NAMES
from pagoda.node_agent.models.int4_quant import clip_search, quantize_rtn
from pagoda.node_agent.models.loader import load_model
from pagoda.node_agent.models.quantize import MANIFEST, format_report, quantize_checkpoint
from tests.tiny_models import random_causal_lm, save_random_model

from .test_gptq_awq import TINY, _gptq_qc, _rtn, dequant, encode_gptq

TINY_DENSE = {**TINY, "intermediate_size": 384, "max_position_embeddings": 1024}  # K = 192 and 384


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, builtin_tokenizer):
    """A dense float32 tiny Llama saved by transformers, with the built-in tokenizer."""
    from transformers import LlamaConfig

    _, path = save_random_model(
        LlamaConfig(**TINY_DENSE), tmp_path_factory.mktemp("tiny-dense"), builtin_tokenizer
    )
    return path


def _shapes(model) -> list[tuple[int, int]]:
    return [
        tuple(t.shape)
        for n, t in model.state_dict().items()
        if n.startswith("model.layers.") and n.endswith("_proj.weight")
    ]


def _mse(w: torch.Tensor, q: Int4Weight) -> float:
    return float((w - q.dequantize()).pow(2).mean())


def test_float_zero_holds_q4_1_blocks_and_beats_integer_zeros():
    torch.manual_seed(0)
    # Q4_1-style blocks (codes 0..15 using both ends, a float scale and min) come back exactly
    codes = torch.randint(0, 16, (8, 128))
    codes[:, ::32], codes[:, 1::32] = 0, 15
    d, m = torch.rand(8, 4) * 0.01 + 1e-3, -torch.rand(8, 4) * 0.05
    w = (codes.float().reshape(8, 4, 32) * d[..., None] + m[..., None]).reshape(8, 128)
    q = quantize_rtn(w, 32, float_zero=True)
    assert q.mins is not None and q.zeros is None
    assert torch.equal(q.dequantize().sub(w).abs().le(1e-6), torch.ones_like(w, dtype=torch.bool))
    assert (q.dequantize() - w).abs().max().item() <= 1e-6
    # on Gaussian weights the group's own [min, max] grid is closer than [min(w,0), max(w,0)] with a
    # rounded integer zero
    w = torch.randn(256, 512)
    for g in (32, 64, 128):
        assert _mse(w, quantize_rtn(w, g, float_zero=True)) < _mse(w, quantize_rtn(w, g)), g
    assert torch.equal(quantize_rtn(w, 64).packed, quantize_int4(w, 64).packed)  # int zero = engine's RTN


@pytest.mark.parametrize("float_zero", [False, True])
def test_clip_search_never_worse_than_rtn_and_grid_of_one_is_rtn(float_zero):
    torch.manual_seed(1)
    w = torch.randn(96, 256)
    w[:, 7] *= 8  # an outlier column widens its groups' range
    x = torch.randn(300, 256)
    x[:, 3] *= 10  # and an outlier activation channel weights its errors
    gram = x.t() @ x
    q, stats = clip_search(w, gram, 64, float_zero)
    assert stats["error"] < stats["rtn_error"]
    out_err = float(((x @ (w - q.dequantize()).t()) ** 2).sum())
    rtn = quantize_rtn(w, 64, float_zero)
    assert out_err < float(((x @ (w - rtn.dequantize()).t()) ** 2).sum())
    assert stats["error"] <= stats["clip_error"] <= stats["rtn_error"]  # refinement only improves
    only_rtn, _ = clip_search(w, gram, 64, float_zero, grid=(1.0,), refine_steps=0)
    assert torch.equal(only_rtn.packed, rtn.packed) and torch.equal(only_rtn.scales, rtn.scales)


@pytest.mark.slow
def test_calibration_grams_cover_every_linear(tiny_dir):
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_dir), dtype="float32", formats=PhaseFormats.reference(), kv_memory=8 << 20
        )
    )
    grams, tokens = linear_input_grams(engine)
    names = {f"model.layers.{i}.{n}.weight" for i in range(2) for n in LINEAR_NAMES}
    assert set(grams) == names and tokens > 100
    g0 = grams["model.layers.0.self_attn.q_proj.weight"]
    assert g0 is grams["model.layers.0.self_attn.v_proj.weight"] and g0.shape == (192, 192)
    assert grams["model.layers.1.mlp.down_proj.weight"].shape == (384, 384)
    assert torch.allclose(g0, g0.t()) and torch.linalg.eigvalsh(g0.double()).min() > -1e-3
    # the hooks are gone: the engine's linears run as before
    assert all(
        type(w).__name__ != "_Recorder"
        for la in engine.model.layers
        for lin in la.linears()
        for w in lin.by_phase.values()
    )


@pytest.mark.slow
def test_cli_float_zero_calibrated_checkpoint(tiny_dir, tmp_path, capsys):
    out = tmp_path / "q"
    rc = main(
        ["quantize", "--model", str(tiny_dir), "--weights", "int4", "--zero", "float", "--calibrate",
         "--out", str(out), "--json", str(tmp_path / "r.json"), "--no-progress"]
    )  # fmt: skip
    assert rc == 0
    printed = capsys.readouterr().out
    assert "(group 64: 12, group 128: 2; zero points float: 14)" in printed and "clip search on" in printed
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["calibrated"] and report["calibration_error"] < report["calibration_error_rtn"]
    assert report["group_sizes"] == {"64": 12, "128": 2} and report["group_size"] == "auto"
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["zero"] == "float" and manifest["calibrated"] and manifest["passthrough"] == []
    w = load_model(str(out)).weights["model.layers.1.mlp.down_proj.weight"]
    assert isinstance(w, Int4Weight) and w.mins is not None and w.group_size == 128


@pytest.mark.slow
def test_forced_group_size_must_divide_every_layer(tiny_dir, tmp_path):
    with pytest.raises(
        ValueError, match=r"group size 256 does not divide K=192 of model\.layers\.0\.self_attn"
    ):
        quantize_checkpoint(str(tiny_dir), "int4", tmp_path / "x", group_size=256, progress=False)
    assert not (tmp_path / "x").exists()  # refused before any work
    r = quantize_checkpoint(str(tiny_dir), "int4", tmp_path / "y", group_size=32, progress=False)
    assert r.group_sizes == {32: 14} and r.group_size == 32


@pytest.mark.slow
def test_int4_source_is_written_through_unchanged(tmp_path, builtin_tokenizer):
    """A GPTQ checkpoint's INT4 weights are copied as they are (no requantization), and the report
    says so; --requantize would quantize them again."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    model = random_causal_lm(LlamaConfig(**TINY_DENSE))
    src = tmp_path / "gptq"
    src.mkdir()
    stored = {}
    for name, t in model.state_dict().items():
        base = name.removesuffix(".weight")
        if base.endswith(("_proj",)) and base.startswith("model.layers."):
            q, zeros, scales = _rtn(t.detach(), 64, 1)
            stored.update(encode_gptq(q, zeros, scales, v1=True, name=base))
        else:
            stored[name] = t.detach().float().contiguous()
    save_file(stored, str(src / "model.safetensors"))
    cfg = model.config.to_dict() | _gptq_qc(64, sym=False)
    (src / "config.json").write_text(json.dumps(cfg))
    builtin_tokenizer._tok.save_pretrained(src)
    before = load_model(str(src)).weights
    report = quantize_checkpoint(str(src), "int4", tmp_path / "out", group_size=32, progress=False)
    assert report.passthrough == 14 and report.group_sizes == {64: 14} and report.zero_forms == {"int": 14}
    assert "written through unchanged" in format_report(report)
    # float16 scales stay float16 on disk (exact), integer zeros one byte each: K/2 + 2G + G per row
    assert report.linear_bytes_quant == sum(n * (k // 2 + 3 * k // 64) for n, k in _shapes(model))
    after = load_model(str(tmp_path / "out")).weights
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        a, b = before[name], after[name]
        assert (
            torch.equal(a.packed, b.packed)
            and torch.equal(a.zeros, b.zeros)
            and torch.equal(a.scales, b.scales)
        )
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
    again = quantize_checkpoint(
        str(src), "int4", tmp_path / "re", group_size=32, progress=False, requantize=True
    )
    assert again.passthrough == 0 and again.group_sizes == {32: 14}
    # dequant as stored == the definition of the GPTQ values
    q, zeros, scales = _rtn(model.state_dict()["model.layers.0.mlp.up_proj.weight"], 64, 1)
    assert torch.equal(
        after["model.layers.0.mlp.up_proj.weight"].dequantize(),
        dequant(q, zeros, scales, torch.arange(192) // 64),
    )


@pytest.mark.slow
def test_eval_scores_the_checkpoint_against_the_source(tiny_dir, tmp_path):
    """--eval builds the float32 reference from the source, not from the checkpoint (whose own
    dequantization would make the INT4 rows look lossless)."""
    rc = main(
        ["quantize", "--model", str(tiny_dir), "--weights", "int4", "--out", str(tmp_path / "q"), "--eval",
         "--eval-kernel-backend", "reference", "--json", str(tmp_path / "r.json"), "--no-progress"]
    )  # fmt: skip
    assert rc == 0
    ev = json.loads((tmp_path / "r.json").read_text())["eval"]
    assert ev["reference_model"] == str(tiny_dir) and ev["model"] == str(tmp_path / "q")
    row = ev["rows"][0]
    assert row["formats"] == "int4/bf16" and row["mean_kl"] > 1e-4  # RTN INT4 differs from float32
