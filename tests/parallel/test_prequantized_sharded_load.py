"""Quantized layers of prequantized checkpoints read per rank (deferred_quant): every parameter of
every rank equals the slice of the whole checkpoint converted at once (the loader's whole path, then
the shard plan), bit for bit, for a DeepSeek-V3-style FP8 block checkpoint (partial blocks, rows cut
inside a block), compressed-tensors W4A16 (symmetric, with zero points, act-ordered in runs or
scattered: columns kept whole there) and W8A16, GPTQ and AWQ; and a rank reads only its share of
the stored values."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import save_file

from pagoda.node_agent.models.deferred_quant import DeferredQuant
from pagoda.node_agent.models.loader import load_model
from pagoda.node_agent.models.parallel import make_plan, mlp_units, rank_weights, shard_weights
from tests.formats.ct_writer import weights_args, write_ct_checkpoint
from tests.parallel.same_weights import same_weights
from tests.parallel.test_sharded_load import _record_reads, fp8_block_dir  # noqa: F401  (a fixture)

LLAMA = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=256,
    initializer_range=0.05,
    tie_word_embeddings=False,
)
CT_VARIANTS = {
    "w4a16": weights_args(4, 128, True, actorder="static"),
    "w4a16_asym": weights_args(4, 32, False),
    "w8a16": weights_args(8, 0, True),
    "actorder_runs": weights_args(4, 32, True, actorder="group"),
    "actorder_scatter": weights_args(4, 32, False, actorder="group"),
}
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _check_ranks(path: str, world: int, formats: set[str]) -> None:
    whole = load_model(path)  # every quantized layer read and converted whole (today's path)
    units = mlp_units(whole.weights, whole.config, formats, None) if world > 1 else (1, 1)
    for rank in range(world):
        plan = make_plan(whole.config, rank, world, *units)
        want = shard_weights(whole.weights, whole.config, plan, formats)
        lazy = load_model(path, part=(rank, world), lazy=True)
        assert any(isinstance(w, DeferredQuant) for w in lazy.weights.values())
        got_plan, got = rank_weights(lazy.weights, lazy.config, rank, world, formats, None)
        assert got_plan == plan
        assert sorted(got) == sorted(want)
        for name in want:
            same_weights(got[name], want[name], name)


@pytest.mark.parametrize(
    "world, formats",
    [(w, f) for w in (1, 2, 4) for f in ({"fp32"}, {"fp8"})] + [(2, {"fp8", "int4"})],
    ids=lambda v: "+".join(sorted(v)) if isinstance(v, set) else str(v),
)
def test_fp8_block_ranks_equal_the_whole_checkpoints_slices(fp8_block_dir, world, formats):  # noqa: F811
    _check_ranks(str(fp8_block_dir), world, formats)


@pytest.fixture(scope="module")
def llama_model():
    from transformers import LlamaConfig

    from tests.tiny_models import random_causal_lm

    return random_causal_lm(LlamaConfig(**LLAMA))


@pytest.fixture(scope="module")
def ct_dir(llama_model, builtin_tokenizer, tmp_path_factory):
    made = {}

    def get(variant: str):
        if variant not in made:
            path = tmp_path_factory.mktemp(f"ct_{variant}")
            g_idx = {"actorder_runs": "runs", "actorder_scatter": "scatter"}.get(variant)
            write_ct_checkpoint(llama_model, path, builtin_tokenizer, CT_VARIANTS[variant], [], g_idx=g_idx)
            made[variant] = str(path)
        return made[variant]

    return get


@pytest.mark.parametrize(
    "variant, world",
    [(v, 2) for v in CT_VARIANTS] + [("w4a16_asym", 4), ("w8a16", 4), ("actorder_runs", 4)],
)
def test_compressed_tensors_ranks_equal_the_whole_checkpoints_slices(ct_dir, variant, world):
    _check_ranks(ct_dir(variant), world, {"fp8", "int4"})


def test_compressed_tensors_one_rank_reads_every_layer_whole(ct_dir):
    _check_ranks(ct_dir("w4a16_asym"), 1, {"fp32"})


@pytest.fixture(scope="module")
def gptq_awq_dir(llama_model, builtin_tokenizer, tmp_path_factory):
    from tests.formats.test_gptq_awq import _awq_qc, _gptq_qc, _rtn, encode_awq, encode_gptq

    made = {}

    def get(method: str):
        if method in made:
            return made[method]
        g = 64 if method == "gptq" else 32
        stored = {}
        for name, t in llama_model.state_dict().items():
            base = name.removesuffix(".weight")
            if not base.endswith(LINEARS):
                stored[name] = t.detach().float().contiguous()
                continue
            q, zeros, scales = _rtn(t.detach(), g, 1 if method == "gptq" else 0)
            if method == "gptq":
                stored.update(encode_gptq(q, zeros, scales, v1=True, name=base))
            else:
                stored.update(encode_awq(q, zeros, scales, name=base))
        path = tmp_path_factory.mktemp(method)
        save_file(stored, str(path / "model.safetensors"))
        cfg = llama_model.config.to_dict()
        qc = _gptq_qc(g, sym=False) if method == "gptq" else _awq_qc(g)
        cfg["quantization_config"] = qc["quantization_config"]
        (path / "config.json").write_text(json.dumps(cfg))
        builtin_tokenizer._tok.save_pretrained(path)
        made[method] = str(path)
        return made[method]

    return get


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_gptq_awq_ranks_equal_the_whole_checkpoints_slices(gptq_awq_dir, method, world):
    _check_ranks(gptq_awq_dir(method), world, {"fp8", "int4"})


@pytest.mark.parametrize(
    "variant, values", [("w4a16", "weight_packed"), ("w4a16_asym", "weight_packed"), ("gptq", "qweight")]
)
def test_a_rank_reads_half_of_every_quantized_layer(ct_dir, gptq_awq_dir, monkeypatch, variant, values):
    """At TP 2 every linear is split: a rank reads exactly half of the packed values, of the scales
    and of the zero points. Listing a layer reads only its small metadata whole (weight_shape,
    g_idx, and GPTQ's qzeros for the zero-of-16 check)."""
    path = gptq_awq_dir(variant) if variant == "gptq" else ct_dir(variant)
    stored = _stored(path)
    small = ("weight_shape", "g_idx", "weight_g_idx", "qzeros")
    parts = {k: s for k, s in stored.items() if k.rsplit(".", 1)[-1] in (values, "scales", "qzeros")}
    parts |= {k: s for k, s in stored.items() if k.endswith(("weight_scale", "weight_zero_point"))}
    for rank in range(2):
        reads = _record_reads(monkeypatch)
        lazy = load_model(path, part=(rank, 2), lazy=True)
        assert all(k.rsplit(".", 1)[-1] in small for k, _ in reads), reads
        reads.clear()
        rank_weights(lazy.weights, lazy.config, rank, 2, {"fp32"}, None)
        read = {}
        for key, bounds in reads:
            read[key] = read.get(key, 0) + torch.Size(b - a for a, b in bounds).numel()
        assert parts
        for key, shape in parts.items():
            assert read.get(key, 0) * 2 == shape.numel(), key


def _stored(path: str) -> dict[str, torch.Size]:
    from safetensors import safe_open

    with safe_open(f"{path}/model.safetensors", framework="pt") as h:
        return {k: torch.Size(h.get_slice(k).get_shape()) for k in h.keys()}


def test_columns_an_act_order_keeps_whole_are_read_whole_and_logged(ct_dir, caplog):
    path = ct_dir("actorder_runs")
    lazy = load_model(path, part=(1, 2), lazy=True)
    with caplog.at_level(logging.INFO, logger="pagoda.loader"):
        rank_weights(lazy.weights, lazy.config, 1, 2, {"fp32"}, None)
    lines = [r.getMessage() for r in caplog.records if "converted whole, then sliced" in r.getMessage()]
    assert any(line.startswith("model.layers.0.self_attn.o_proj.weight: slice") for line in lines), lines
    assert all("in permuted runs" in line for line in lines)
    assert not any("q_proj" in line for line in lines)  # rows need no column cut
