"""GGUF files loaded per rank: a rank's deferred GGUF tensors (gguf_lazy) dequantize only its slices,
and every parameter of every rank equals the slice of the whole file decoded at once (the loader's
whole path, then the shard plan) at tensor-parallel degrees 1, 2 and 4. The files are written with
the gguf package's writer: a dense llama with Q4_0 / Q4_1 blocks (kept as INT4 codes, q/k rows
permuted), Q8_0, Q5_0, Q4_K (256-value blocks, some column slices off their boundaries), F16, BF16
and F32 tensors; a qwen3moe whose stacked experts are Q8_0, Q4_0, Q4_K and F16; and the deepseek2
(MLA, split attn_k_b / attn_v_b, shared experts) of tests/engine/test_gguf_moe.py."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from pagoda.kernels.int4 import Int4Weight
from pagoda.node_agent.models.gguf_lazy import GgufTensor
from pagoda.node_agent.models.loader import _decode_gguf, load_model, resolve_source
from pagoda.node_agent.models.parallel import make_plan, mlp_units, rank_weights, shard_weights
from tests.parallel.same_weights import same_weights

HIDDEN, HEADS, KV_HEADS, FFN, VOCAB, EXPERTS = 256, 4, 2, 512, 250, 8
FORMATS = [{"fp32"}, {"fp8", "int4"}]


@pytest.fixture(autouse=True)
def _no_cache(monkeypatch):
    monkeypatch.setenv("PAGODA_NO_MODEL_CACHE", "1")


def _q4_k(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Q4_K blocks (d, dmin as float16, 12 scale bytes, 128 nibble bytes per 256 weights) with random
    codes and finite super-block scales (the gguf package cannot quantize K-quants)."""
    raw = rng.integers(0, 256, size=(rows, cols // 256, 144), dtype=np.uint8)
    scales = np.empty((rows, cols // 256, 2), np.float16)
    scales[..., 0] = rng.uniform(0.001, 0.01, scales.shape[:2])
    scales[..., 1] = rng.uniform(0.0, 0.005, scales.shape[:2])
    raw[..., :4] = scales.view(np.uint8)
    return raw.reshape(rows, -1)


def _add(w, name: str, arr: np.ndarray, qtype: str, rng: np.random.Generator) -> None:
    """``arr`` (float32, any leading dims) written as ``qtype``."""
    import gguf

    if qtype == "F32":
        w.add_tensor(name, arr)
    elif qtype == "F16":
        w.add_tensor(name, arr.astype(np.float16))
    elif qtype == "Q4_K":
        raw = _q4_k(int(np.prod(arr.shape[:-1])), arr.shape[-1], rng).reshape(*arr.shape[:-1], -1)
        w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    else:
        t = gguf.GGMLQuantizationType[qtype]
        w.add_tensor(name, gguf.quants.quantize(arr, t), raw_dtype=t)


def _header(w, arch: str, ffn: int) -> None:
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(2)
    w.add_feed_forward_length(ffn)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(VOCAB)


def _write(path, arch: str, layers: list[dict[str, str]], extra: dict[str, str]) -> None:
    """A two-block GGUF of ``arch``: per block, GGUF base name -> type, of random N(0, 0.05) values."""
    import gguf

    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch)
    _header(w, arch, FFN if arch == "llama" else 256)
    if arch == "qwen3moe":
        w.add_expert_count(EXPERTS)
        w.add_expert_used_count(2)
        w.add_expert_feed_forward_length(256)
        w.add_key_length(HIDDEN // HEADS)
        w.add_value_length(HIDDEN // HEADS)
    d, ff = HIDDEN // HEADS, FFN if arch == "llama" else 256
    shapes = {
        "attn_q": (HEADS * d, HIDDEN),
        "attn_k": (KV_HEADS * d, HIDDEN),
        "attn_v": (KV_HEADS * d, HIDDEN),
        "attn_output": (HIDDEN, HEADS * d),
        "ffn_gate": (ff, HIDDEN),
        "ffn_up": (ff, HIDDEN),
        "ffn_down": (HIDDEN, ff),
        "ffn_gate_inp": (EXPERTS, HIDDEN),
        "ffn_gate_exps": (EXPERTS, ff, HIDDEN),
        "ffn_up_exps": (EXPERTS, ff, HIDDEN),
        "ffn_down_exps": (EXPERTS, HIDDEN, ff),
        "attn_q_norm": (d,),
        "attn_k_norm": (d,),
        "attn_norm": (HIDDEN,),
        "ffn_norm": (HIDDEN,),
    }

    def values(shape):
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    for name, qtype in extra.items():
        shape = (HIDDEN,) if name == "output_norm" else (VOCAB, HIDDEN)
        _add(w, f"{name}.weight", values(shape), qtype, rng)
    for i, types in enumerate(layers):
        for base, qtype in types.items():
            _add(w, f"blk.{i}.{base}.weight", values(shapes[base]), qtype, rng)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


NORMS = {"attn_norm": "F32", "ffn_norm": "F32"}
DENSE_LAYERS = [
    {  # every linear weight INT4-exact: kept as codes
        "attn_q": "Q4_0",
        "attn_k": "Q4_0",
        "attn_v": "Q4_1",
        "attn_output": "Q4_0",
        "ffn_gate": "Q4_1",
        "ffn_up": "Q4_0",
        "ffn_down": "Q4_1",
        **NORMS,
    },
    {  # dequantized; o_proj's column halves (128) and down_proj's quarters cut Q4_K's 256 blocks
        "attn_q": "Q8_0",
        "attn_k": "F16",
        "attn_v": "BF16",
        "attn_output": "Q4_K",
        "ffn_gate": "Q5_0",
        "ffn_up": "F32",
        "ffn_down": "Q4_K",
        **NORMS,
    },
]
MOE_LAYERS = [
    {
        "attn_q": "Q8_0",
        "attn_k": "Q8_0",
        "attn_v": "F16",
        "attn_output": "Q4_0",
        "attn_q_norm": "F32",
        "attn_k_norm": "F32",
        "ffn_gate_inp": "F32",
        "ffn_gate_exps": "Q8_0",
        "ffn_up_exps": "Q4_0",
        "ffn_down_exps": "Q4_K",
        **NORMS,
    },
    {
        "attn_q": "F32",
        "attn_k": "F32",
        "attn_v": "F32",
        "attn_output": "F32",
        "attn_q_norm": "F32",
        "attn_k_norm": "F32",
        "ffn_gate_inp": "F32",
        "ffn_gate_exps": "Q4_1",
        "ffn_up_exps": "F16",
        "ffn_down_exps": "Q8_0",
        **NORMS,
    },
]
HEAD = {"token_embd": "Q8_0", "output": "Q4_K", "output_norm": "F32"}


@pytest.fixture(scope="module")
def dense_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf_dense") / "tiny-llama.gguf"
    _write(path, "llama", DENSE_LAYERS, HEAD)
    return str(path)


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf_moe") / "tiny-qwen3moe.gguf"
    _write(path, "qwen3moe", MOE_LAYERS, HEAD)
    return str(path)


@pytest.fixture(scope="module")
def deepseek2_gguf(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from tests.engine.test_gguf_moe import _write_deepseek2_gguf
    from tests.engine.test_mla import _hf_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_hf_config()).float().eval()
    path = tmp_path_factory.mktemp("gguf_deepseek2") / "tiny-deepseek2.gguf"
    _write_deepseek2_gguf(model, path, resolve_source("builtin://smollm2-135m")[1], split=True)
    return str(path)


def _rank(path: str, rank: int, world: int, formats: set[str]):
    """Rank ``rank``'s plan and weights through its deferred GGUF tensors (the engine's path)."""
    if world == 1:  # load_model keeps one rank on the whole (cached) path: defer explicitly
        lazy = _decode_gguf(path, resolve_source(path)[1], (0, 1))
    else:
        lazy = load_model(path, part=(rank, world), lazy=True)
    assert all(isinstance(w, GgufTensor) for n, w in lazy.weights.items() if "kv_b_proj" not in n)
    return rank_weights(lazy.weights, lazy.config, rank, world, formats, None)


def _check_ranks(path: str, world: int, formats: set[str]) -> None:
    whole = load_model(path)  # every tensor dequantized at once (today's path), then sliced
    units = mlp_units(whole.weights, whole.config, formats, None) if world > 1 else (1, 1)
    for rank in range(world):
        plan = make_plan(whole.config, rank, world, *units)
        want = shard_weights(whole.weights, whole.config, plan, formats)
        got_plan, got = _rank(path, rank, world, formats)
        assert got_plan == plan
        assert sorted(got) == sorted(want)
        for name in want:
            same_weights(got[name], want[name], name)


@pytest.mark.parametrize("formats", FORMATS, ids=["fp32", "fp8+int4"])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_dense_gguf_ranks_equal_the_whole_files_slices(dense_gguf, world, formats):
    whole = load_model(dense_gguf)
    assert isinstance(whole.weights["model.layers.0.self_attn.q_proj.weight"], Int4Weight)
    _check_ranks(dense_gguf, world, formats)


@pytest.mark.parametrize("formats", FORMATS, ids=["fp32", "fp8+int4"])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_moe_gguf_ranks_equal_the_whole_files_slices(moe_gguf, world, formats):
    _check_ranks(moe_gguf, world, formats)


@pytest.mark.parametrize("formats", [{"fp32"}, {"fp8"}], ids=["fp32", "fp8"])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_deepseek2_gguf_ranks_equal_the_whole_files_slices(deepseek2_gguf, world, formats):
    _check_ranks(deepseek2_gguf, world, formats)


def _record_raw(monkeypatch) -> list[tuple[str, int]]:
    """(tensor key, bytes of the stored array handed to dequantization) of every GGUF read."""
    reads: list[tuple[str, int]] = []
    real = GgufTensor.raw

    def raw(self):
        arr, off = real(self)
        reads.append((self.key, int(arr.nbytes)))
        return arr, off

    monkeypatch.setattr(GgufTensor, "raw", raw)
    return reads


@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_dequantizes_only_its_experts_and_slices(moe_gguf, monkeypatch, world):
    import gguf

    reader = gguf.GGUFReader(moe_gguf)
    stored = {t.name: t for t in reader.tensors}
    total = sum(int(t.data.nbytes) for t in stored.values())
    for rank in range(world):
        reads = _record_raw(monkeypatch)
        plan, _ = _rank(moe_gguf, rank, world, {"fp32"})
        e0, e1 = plan.experts
        assert e1 - e0 == EXPERTS // world
        by_key: dict[str, int] = {}
        for key, n in reads:
            by_key[key] = by_key.get(key, 0) + n
        for name, t in stored.items():
            if "_exps" not in name:
                continue
            mine = {k for k in by_key if k.startswith(f"{name}[")}
            assert mine == {f"{name}[{e}]" for e in range(e0, e1)}, name  # its experts, no other
            assert sum(by_key[k] for k in mine) == int(t.data[e0:e1].nbytes) == int(t.data.nbytes) // world
        # vocab rows and head / MLP slices: every split tensor a world-th, replicated norms beside
        assert by_key["output.weight"] <= -(-VOCAB // world) * int(stored["output.weight"].data[0].nbytes)
        assert sum(by_key.values()) < 1.1 * total / world + sum(
            int(t.data.nbytes) for n, t in stored.items() if "norm" in n or "gate_inp" in n
        )


def test_column_slices_off_the_block_boundaries_are_logged(dense_gguf, caplog):
    """Q4_K's 256-value blocks: o_proj's halves (128 columns) dequantize whole rows and say so; the
    down_proj halves (256 of 512) are whole blocks and do not."""
    with caplog.at_level(logging.INFO, logger="pagoda.loader"):
        _rank(dense_gguf, 1, 2, {"fp32"})
    lines = [r.getMessage() for r in caplog.records if "block boundaries" in r.getMessage()]
    assert any(line.startswith("blk.1.attn_output.weight: columns [128, 256)") for line in lines), lines
    assert not any("ffn_down" in line for line in lines), lines


def test_an_int4_column_slice_inside_a_group_is_refused_like_the_whole_path():
    bounds = ((0, 4), (0, 64))
    t = GgufTensor("f.gguf", "blk.0.attn_output.weight", torch.float32, bounds, True, (4, 64), int4=True)
    assert t[:, 32:64].shape == (4, 32)
    from pagoda.node_agent.models.config import ModelLoadError

    with pytest.raises(ModelLoadError, match="splits the stored INT4 groups of 32"):
        t[:, 16:64]
