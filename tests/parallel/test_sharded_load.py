"""Sharded, streaming loading: what a rank reads with the loader's deferred tensors equals the slice
of the whole checkpoint read at once (every tensor, every rank of two, in the default and the
reference formats; a block-scaled FP8 checkpoint too), and a rank reads nothing of another rank's experts nor more of any tensor than
its plan's slice. The greedy tokens of two ranks against one rank (both now loading this way) are
tests/parallel/test_tp_families.py's."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagoda.kernels.fp8_block import Fp8BlockWeight
from pagoda.node_agent.models.lazy_tensor import LazyTensor
from pagoda.node_agent.models.loader import load_model
from pagoda.node_agent.models.parallel import ColumnShard, make_plan, mlp_units, rank_weights, shard_weights

FAMILIES = ["llama", "qwen3_moe", "glm4_moe", "deepseek_v3"]
FORMATS = {"default": {"fp8", "int4"}, "reference": {"fp32"}}


def _same(a: object, b: object, name: str) -> None:
    if isinstance(a, ColumnShard):
        assert isinstance(b, ColumnShard), name
        assert a.full_in == b.full_in, name
        _same(a.weight, b.weight, name)
        if a.row_amax is None:
            assert b.row_amax is None, name
        else:
            assert torch.equal(a.row_amax, b.row_amax), name
        return
    if isinstance(a, Fp8BlockWeight):
        assert isinstance(b, Fp8BlockWeight) and a.block == b.block, name
        assert torch.equal(a.dequantize(), b.dequantize()), name
        return
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), name
    assert a.dtype == b.dtype and a.shape == b.shape, name
    assert torch.equal(a, b), name


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("family", FAMILIES)
def test_rank_reads_equal_the_whole_checkpoints_slice(tiny_model_dir, family, fmt):
    path = str(tiny_model_dir(family))
    whole = load_model(path)  # every tensor read at once, float32
    formats = FORMATS[fmt]
    for rank in range(2):
        units = mlp_units(whole.weights, whole.config, formats, None)
        want = shard_weights(whole.weights, whole.config, make_plan(whole.config, rank, 2, *units), formats)
        lazy = load_model(path, part=(rank, 2), lazy=True)
        assert all(isinstance(w, LazyTensor) for w in lazy.weights.values())
        _, got = rank_weights(lazy.weights, lazy.config, rank, 2, formats, None)
        assert sorted(got) == sorted(want)
        for name in want:
            _same(got[name], want[name], name)


def test_one_rank_reads_the_whole_checkpoint_once(tiny_model_dir, monkeypatch):
    path = str(tiny_model_dir("qwen3_moe"))
    reads = _record_reads(monkeypatch)
    lazy = load_model(path, part=(0, 1), lazy=True)
    _, got = rank_weights(lazy.weights, lazy.config, 0, 1, {"fp32"}, None)
    keys = sorted(k for k, _ in reads)
    whole = load_model(path)
    assert keys == sorted(whole.weights)  # each tensor read once
    for name, w in whole.weights.items():
        _same(got[name], w, name)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_a_rank_reads_only_its_slices(tiny_model_dir, monkeypatch, family):
    path = str(tiny_model_dir(family))
    reads = _record_reads(monkeypatch)
    lazy = load_model(path, part=(1, 2), lazy=True)
    cfg = lazy.config
    experts = cfg.moe.num_experts
    mine = range(experts // 2, experts)
    listed = {int(n.split(".mlp.experts.")[1].split(".")[0]) for n in lazy.weights if ".mlp.experts." in n}
    assert listed == set(mine)  # another rank's experts are not even listed
    plan, got = rank_weights(lazy.weights, cfg, 1, 2, {"fp32"}, None)
    assert plan.experts == (mine.start, mine.stop)
    read_experts = {int(k.split(".mlp.experts.")[1].split(".")[0]) for k, _ in reads if ".mlp.experts." in k}
    assert read_experts == set(mine)
    bounds = dict(reads)
    v0, v1 = plan.vocab
    assert bounds["model.embed_tokens.weight"] == ((v0, v1), (0, cfg.hidden_size))
    rows = [b[0] for k, b in reads if k.endswith(".mlp.gate_proj.weight")]
    assert rows and all(r == plan.intermediate for r in rows)  # the dense MLP's rows of this rank
    assert plan.intermediate[1] - plan.intermediate[0] == cfg.intermediate_size // 2
    whole = sum(t.numel() for t in load_model(path).weights.values())
    held = sum((w.weight if isinstance(w, ColumnShard) else w).numel() for w in got.values())
    assert held < 0.6 * whole  # about half of the checkpoint, the replicated norms and routers beside


def _record_reads(monkeypatch) -> list[tuple[str, tuple]]:
    """Every (key, bounds) a LazyTensor reads from now on."""
    reads: list[tuple[str, tuple]] = []
    real = LazyTensor.read

    def read(self, handle):
        reads.append((self.key, self.bounds))
        return real(self, handle)

    monkeypatch.setattr(LazyTensor, "read", read)
    return reads


@pytest.fixture(scope="module")
def fp8_block_dir(tiny_model_dir, tmp_path_factory):
    """The tiny DeepSeek-V3 with its projections stored as e4m3 blocks of 32 (``weight_scale_inv``)."""
    from tests.formats.test_fp8_block_checkpoint import BLOCK, encode_blocks

    src = tiny_model_dir("deepseek_v3")
    path = tmp_path_factory.mktemp("tp_deepseek_fp8")
    stored = {}
    for f in sorted(src.glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            if name.startswith("model.layers.") and name.endswith(("_proj.weight", "_proj_with_mqa.weight")):
                stored[name], stored[name.removesuffix("weight") + "weight_scale_inv"] = encode_blocks(
                    t.float()
                )
            else:
                stored[name] = t
    save_file(stored, str(path / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "weight_block_size": [BLOCK, BLOCK],
        "activation_scheme": "dynamic",
    }
    (path / "config.json").write_text(json.dumps(cfg))
    for f in src.glob("tokenizer*"):
        shutil.copy(f, path / f.name)
    return path


def test_fp8_block_checkpoint_ranks_read_their_experts_and_dense_slices(fp8_block_dir, monkeypatch):
    """A prequantized checkpoint: its FP8 layers are read as slices of their e4m3 values and scale
    blocks (rows from the start of their first block, columns on block edges) and converted per
    rank, its dense tensors (embeddings, LM head, norms, routers) read as slices, its other rank's
    experts never (its own converted whole: they are not sliced)."""
    from pagoda.node_agent.models.deferred_quant import DeferredQuant
    from tests.formats.test_fp8_block_checkpoint import BLOCK

    path = str(fp8_block_dir)
    whole = load_model(path)
    formats = {"fp8", "int4"}
    for rank in range(2):
        units = mlp_units(whole.weights, whole.config, formats, None)
        want = shard_weights(whole.weights, whole.config, make_plan(whole.config, rank, 2, *units), formats)
        reads = _record_reads(monkeypatch)
        lazy = load_model(path, part=(rank, 2), lazy=True)
        assert isinstance(lazy.weights["model.embed_tokens.weight"], LazyTensor)
        assert isinstance(lazy.weights["model.layers.1.mlp.shared_experts.down_proj.weight"], DeferredQuant)
        assert "model.layers.1.mlp.shared_experts.down_proj.weight_scale_inv" not in lazy.weights
        experts = [w for n, w in lazy.weights.items() if ".mlp.experts." in n and n.endswith("proj.weight")]
        assert experts and all(isinstance(w, Fp8BlockWeight) for w in experts)
        load_reads = list(reads)
        reads.clear()  # the experts' whole reads are the load's; the rest is the plan's
        plan, got = rank_weights(lazy.weights, lazy.config, rank, 2, formats, None)
        assert sorted(got) == sorted(want)
        for name in want:
            _same(got[name], want[name], name)
        bounds = dict(reads)
        assert bounds["lm_head.weight"] == (plan.vocab, (0, lazy.config.hidden_size))
        h, (s0, s1) = lazy.config.hidden_size, plan.shared_intermediate
        down = "model.layers.1.mlp.shared_experts.down_proj.weight"
        assert bounds[down] == ((0, h), (s0, s1))
        assert bounds[down + "_scale_inv"] == ((0, -(-h // BLOCK)), (s0 // BLOCK, -(-s1 // BLOCK)))
        mla = lazy.config.mla
        per = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        q0, q1 = plan.q_heads[0] * per, plan.q_heads[1] * per
        rows = bounds["model.layers.0.self_attn.q_b_proj.weight"][0]
        assert rows == (q0 - q0 % BLOCK, q1)  # from its first block's start: less than a block more
        e0, e1 = plan.experts
        read_experts = {
            int(k.split(".mlp.experts.")[1].split(".")[0])
            for k, _ in load_reads + reads
            if ".mlp.experts." in k
        }
        assert read_experts == set(range(e0, e1))


def test_deferred_slices_compose_and_read_what_they_name(tmp_path):
    """Slices of slices over any leading dimensions read exactly that part, converted to float32;
    an empty range reads nothing; a step or an integer index is refused."""
    from safetensors import safe_open

    t = torch.randn(6, 4, 3).to(torch.bfloat16)
    f = str(tmp_path / "a.safetensors")
    save_file({"x": t}, f)
    lt = LazyTensor.whole(f, "x", [6, 4, 3], "BF16", to_float=True)
    assert lt[2:5][:, 1:3].shape == (3, 2, 3) and lt.dtype == torch.float32
    with safe_open(f, framework="pt") as h:
        assert torch.equal(lt[2:5][:, 1:3].read(h), t[2:5, 1:3].float())
        assert torch.equal(lt[:, :, 1:].read(h), t[:, :, 1:].float())
        assert lt[6:6].read(h).shape == (0, 4, 3)
    with pytest.raises(ValueError, match="step 1"):
        lt[::2]
    with pytest.raises(TypeError, match="slices only"):
        lt[0]


def test_a_multi_shard_checkpoint_reads_file_by_file_with_a_line_per_shard(tmp_path, caplog):
    """bench load's writer, tiny: several shard files; each rank of two equals the whole read's
    slice, and the loader logs one progress line per shard file it reads."""
    import logging

    from pagoda.node_agent.bench.load import checkpoint_config, write_checkpoint

    cfg = checkpoint_config(hidden=64, experts=4, vocab=256, layers=2)
    info = write_checkpoint(tmp_path, cfg, shard_bytes=32 << 10)
    assert info["files"] >= 3
    whole = load_model(str(tmp_path))
    for rank in range(2):
        caplog.clear()
        want = shard_weights(whole.weights, whole.config, make_plan(whole.config, rank, 2), {"fp32"})
        with caplog.at_level(logging.INFO, logger="pagoda.loader"):
            lazy = load_model(str(tmp_path), part=(rank, 2), lazy=True)
            _, got = rank_weights(lazy.weights, lazy.config, rank, 2, {"fp32"}, None)
        assert sorted(got) == sorted(want)
        for name in want:
            _same(got[name], want[name], name)
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("shard ")]
        assert len(lines) == info["files"]  # every shard holds some of each rank's share here
        assert all(f"/{info['files']} model-" in line and "MiB held" in line for line in lines)


def test_the_quality_drill_reads_and_scales_its_deferred_weights(tiny_model_dir):
    from pagoda.node_agent.engine.corrupt_layer import corrupt_layer

    path = str(tiny_model_dir("llama"))
    whole = load_model(path)
    lazy = load_model(path, part=(0, 2), lazy=True)
    out = corrupt_layer(lazy, 1, 1.5)
    for suffix in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
        name = f"model.layers.1.{suffix}"
        assert isinstance(lazy.weights[name], LazyTensor)  # the load itself is left deferred
        assert torch.equal(out.weights[name], whole.weights[name] * 1.5), name
    assert isinstance(out.weights["model.layers.0.self_attn.o_proj.weight"], LazyTensor)
