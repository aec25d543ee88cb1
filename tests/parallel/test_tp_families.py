"""Tensor and expert parallelism across the model families: ``pagoda generate --tensor-parallel 2``
(two gloo ranks on the CPU, started by Pagoda) gives the same greedy tokens as one rank, for tiny
random-weight Llama (GQA and a single replicated KV head), Qwen3, Qwen2, Qwen3-MoE, GLM-4.5 MoE and
DeepSeek-V3 (MLA) models and for the built-in model, in the default formats and in the float32
reference formats. Built in this process: each rank's slice of MLA (whole latent, split query heads)
and of a single KV head (replicated), and a column split inside an INT4 group refused at load."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from pagoda.kernels.int4 import Int4Weight
from pagoda.node_agent.engine.config import EngineConfig, PhaseFormats, parse_bytes
from pagoda.node_agent.engine.llm_engine import LLMEngine
from pagoda.node_agent.models.config import ModelLoadError
from pagoda.node_agent.models.parallel import make_plan
from pagoda.node_agent.params import SamplingParams

from ..engine.prompts import CHAT_PROMPTS, PLAIN_PROMPTS
from .conftest import finish, start_generate

FAMILIES = ["llama", "llama_kv1", "qwen3", "qwen2", "qwen3_moe", "glm4_moe", "deepseek_v3"]
# every family in the default formats (what a user runs); the dense float32 reference formats on one
# family per attention and MLP kind (GQA + dense MLP, replicated KV head, MoE with shared experts,
# MLA + MoE), which keeps the suite's wall time in bounds
REFERENCE_FAMILIES = ["llama", "llama_kv1", "glm4_moe", "deepseek_v3"]
CASES = [(f, "default") for f in FAMILIES] + [(f, "reference") for f in REFERENCE_FAMILIES]
PROMPTS = [
    "Once upon a time",
    "The quick brown fox jumps over the lazy dog and keeps running through the forest.",
    "Mixture of experts models route every token to a few experts.",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
]
NEW_TOKENS = 16
TINY_KV = "16MiB"
# The formats a run uses: the defaults (auto is float32 on the CPU: FP8 prefill weights, INT4 decode
# weights, bf16 prefill KV, FP8 decode KV) or float32's reference formats (dense weights and KV).
FORMATS = {"default": [], "reference": ["--dtype", "float32"]}


@pytest.fixture(autouse=True)
def _one_thread():
    """The one-rank references run on one thread, like each of the two ranks (Pagoda gives each CPU
    rank its share of the cores): on a busy 2-core machine a second thread mostly spins (8 prompts
    of the built-in model: 45 s with 2 threads, 7.5 s with 1, under a load of 3)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _engine_config(model: str, formats: str, kv: str, **kw) -> EngineConfig:
    if formats == "reference":
        kw.update(dtype="float32", formats=PhaseFormats.reference())
    return EngineConfig(model=model, kv_memory=parse_bytes(kv), **kw)


def _tp1(model: str, formats: str, prompts: list[str], n: int, kv: str = TINY_KV, **kw) -> list[dict]:
    """One rank, in this process: what ``pagoda generate --json`` prints, as dicts."""
    engine = LLMEngine(_engine_config(model, formats, kv, **kw))
    try:
        params = SamplingParams(max_tokens=n, temperature=0.0)
        rids = [engine.add_request(p, params) for p in prompts]
        final = engine.run_until_done()
    finally:
        engine.close()
    return [{"token_ids": final[r].token_ids, "finish_reason": final[r].finish_reason} for r in rids]


def _tp2(model: str, formats: str, prompts: list[str], n: int, kv: str = TINY_KV, *extra: str):
    """Two ranks: ``pagoda generate --tensor-parallel 2``, started in a fresh process; calling the
    returned function waits for its outputs."""
    args = ["--model", model, "--tensor-parallel", "2", "--kv-memory", kv, "--max-tokens", str(n)]
    args += FORMATS[formats] + list(extra)
    for p in prompts:
        args += ["--prompt", p]
    proc = start_generate(*args)

    def outputs() -> list[dict]:
        code, out, err = finish(proc)
        assert code == 0, err[-3000:]
        lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        assert [o["prompt"] for o in lines] == prompts
        return [{"token_ids": o["token_ids"], "finish_reason": o["finish_reason"]} for o in lines]

    return outputs


@pytest.mark.slow
@pytest.mark.parametrize(("family", "formats"), CASES)
def test_two_ranks_equal_one_rank(tiny_model_dir, family, formats):
    path = str(tiny_model_dir(family))
    got = _tp2(path, formats, PROMPTS, NEW_TOKENS)  # runs while one rank runs here
    want = _tp1(path, formats, PROMPTS, NEW_TOKENS)
    # no random token stops these prompts early: all 16 tokens of every prompt are compared
    assert [o["finish_reason"] for o in want] == ["length"] * len(PROMPTS)
    got = got()
    for p, g, w in zip(PROMPTS, got, want, strict=True):
        assert g == w, f"{family} ({formats}) {p!r}: 2 ranks {g['token_ids']} != 1 rank {w['token_ids']}"


@pytest.mark.slow
def test_builtin_model_two_ranks_equal_one_rank(make_engine, builtin_tokenizer, monkeypatch):
    """The transformers-equivalence prompts (4 chat, 4 plain; 32 tokens) in the default formats, in one
    ``pagoda generate`` run: the chat prompts go in already rendered by the chat template.

    Both sides run the torch kernels (the native decode layer serves one rank only, and its float32
    and the native attention's differ from the torch ops' in the last bits, which an FP8 page can
    turn into another token where two candidates nearly tie: with the default kernels, 6 of 8
    prompts were identical over 32 tokens, "The quick brown fox" separating at token 17). What this
    compares is the sharding: the same kernels on one rank and on two.

    The row-parallel sums of two ranks differ from one rank's in the last bits, and a 1-byte KV page
    can round such a difference to the other side of a step. Measured over these 8 prompts x 32
    tokens: float32 pages and fp8_e4m3 pages 8 of 8 identical; int8 pages (the default), whose steps
    near a token's largest values are finer than e4m3's, 6 of 8, separating at tokens 17 ("The quick
    brown fox") and 30. On a CPU without AVX-512 (AVX2 only), "List three uses of copper." separated
    at token 7 (the 7 others identical over 32 tokens). A sharding fault breaks every prompt from its
    first tokens. So: every prompt's first 4 tokens, and at least 6 of 8 over 16 tokens and whole."""
    monkeypatch.setenv("PAGODA_NATIVE_DECODE", "0")  # read here and by the ranks' fresh process
    monkeypatch.setenv("PAGODA_NATIVE_ATTENTION", "0")
    rendered = [
        builtin_tokenizer._tok.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in CHAT_PROMPTS
    ]
    got = _tp2("builtin://smollm2-135m", "default", rendered + PLAIN_PROMPTS, 32, "64MiB")
    engine = make_engine(formats=PhaseFormats(), kv_memory=64 << 20)
    assert engine.model.native is None
    # the rendered text is the prompt --chat (and the transformers-equivalence test) gives the model
    assert [engine.tokenize(r) for r in rendered] == [engine.tokenize(p, chat=True) for p in CHAT_PROMPTS]
    params = SamplingParams(max_tokens=32, temperature=0.0)
    rids = [engine.add_request(p, params) for p in rendered + PLAIN_PROMPTS]
    final = engine.run_until_done()
    want = [{"token_ids": final[r].token_ids, "finish_reason": final[r].finish_reason} for r in rids]
    assert sum(len(o["token_ids"]) for o in want) >= 8 * 16  # most prompts run the full 32 tokens
    got = got()
    for p, g, w in zip(CHAT_PROMPTS + PLAIN_PROMPTS, got, want, strict=True):
        assert g["token_ids"][:4] == w["token_ids"][:4], f"{p!r}: 2 ranks {g} != 1 rank {w}"
    pairs = list(zip(got, want, strict=True))
    print("TP2 vs TP1: first difference per prompt", [_first_difference(g, w) for g, w in pairs])
    assert sum(g["token_ids"][:16] == w["token_ids"][:16] for g, w in pairs) >= 6, (got, want)
    assert sum(g == w for g, w in pairs) >= 6, (got, want)


def _first_difference(got: dict, want: dict) -> int | None:
    a, b = got["token_ids"], want["token_ids"]
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


# ------------------------------------------------------------------ INT4 groups at shard boundaries


def _build_rank(loaded, rank: int, **kw):
    """Rank ``rank`` of 2's model, built in this process (building calls no collective)."""
    from types import SimpleNamespace

    from pagoda.node_agent.engine.model_runner import build_model
    from pagoda.node_agent.engine.source_formats import resolve_weight_formats

    config = resolve_weight_formats(EngineConfig(model=loaded.source, **kw))  # as build_parts does
    group = SimpleNamespace(rank=rank, world=2, data=None)
    return build_model(config, loaded, torch.float32, torch.device("cpu"), group)


def _o_proj_int4(model) -> Int4Weight:
    return model.layers[0].o_proj.by_phase["decode"].weight


@pytest.fixture(scope="module")
def narrow(tiny_model_dir):
    """A tiny Llama whose o_proj input is 128 wide (4 heads x 32): 64 columns per rank."""
    from pagoda.node_agent.models.loader import load_model

    path = tiny_model_dir("llama_narrow")
    return path, load_model(str(path))


def test_converted_int4_group_inside_a_column_slice_is_refused(narrow):
    _, loaded = narrow
    with pytest.raises(ModelLoadError, match=r"splits an INT4 group of 128 \(input width 128\)"):
        _build_rank(loaded, 0)  # the default group is 128: each rank's 64 columns would cut it
    for group in (64, 32):  # groups that divide a rank's slice: the whole row's groups, sliced
        w = _o_proj_int4(_build_rank(loaded, 1, int4_group_size=group))
        assert (w.in_features, w.group_size) == (64, group)


def test_stored_int4_group_inside_a_column_slice_is_refused(narrow, tmp_path):
    from pagoda.node_agent.models.loader import load_model
    from pagoda.node_agent.models.quantize import quantize_checkpoint

    path, _ = narrow
    # auto groups: the largest of 128/64/32 dividing each input width (o_proj's 128: one group per row)
    quantize_checkpoint(str(path), "int4", tmp_path / "auto", group_size=None, progress=False)
    quantize_checkpoint(str(path), "int4", tmp_path / "64", group_size=64, progress=False)
    stored128 = load_model(str(tmp_path / "auto"))
    msg = r"model\.layers\.0\.self_attn\.o_proj\.weight: .*\[0, 64\) splits the stored INT4 groups of 128"
    with pytest.raises(ModelLoadError, match=msg):
        _build_rank(stored128, 0, int4_group_size=32)  # a stored group is what it is: no flag fixes it
    stored64 = load_model(str(tmp_path / "64"))
    whole = stored64.weights["model.layers.0.self_attn.o_proj.weight"]
    w = _o_proj_int4(_build_rank(stored64, 1))
    assert (w.in_features, w.group_size) == (64, 64)
    assert torch.equal(w.dequantize(), whole.dequantize()[:, 64:])  # rank 1's columns, bit for bit


def test_mlp_width_split_inside_an_int4_group_is_refused(narrow):
    _, loaded = narrow
    cfg = dataclasses.replace(loaded.config, intermediate_size=128)
    with pytest.raises(
        ModelLoadError, match="MLP width of 128 cannot be split over 2 ranks at INT4 group boundaries of 128"
    ):
        make_plan(cfg, 0, 2, mlp_unit=128)
    assert [make_plan(cfg, r, 2, mlp_unit=64).intermediate for r in (0, 1)] == [(0, 64), (64, 128)]


@pytest.mark.slow
def test_two_ranks_with_a_fitting_int4_group_equal_one_rank(narrow):
    path, _ = narrow
    got = _tp2(str(path), "default", PROMPTS[:2], NEW_TOKENS, TINY_KV, "--int4-group-size", "64")
    want = _tp1(str(path), "default", PROMPTS[:2], NEW_TOKENS, int4_group_size=64)
    assert [o["finish_reason"] for o in want] == ["length"] * 2
    assert got() == want


# ------------------------------------------------------------------ MLA's scheme


def test_mla_ranks_split_query_heads_and_keep_the_whole_latent(tiny_model_dir):
    """DeepSeek-V3 under 2 ranks: each rank holds 2 of the 4 query heads (q_b and kv_b rows per head,
    o_proj columns per head) and the whole latent (kv_a replicated), so its KV pool stores what one
    rank alone stores: kv_lora_rank + qk_rope_head_dim values per token and layer."""
    from pagoda.node_agent.engine.kv_setup import kv_components
    from pagoda.node_agent.models.loader import load_model

    loaded = load_model(str(tiny_model_dir("deepseek_v3")))
    m, p = loaded.config.mla, "model.layers.1.self_attn."
    full = kv_components(loaded.config)
    assert full == {"latent": (1, 32), "rope_k": (1, 8)}
    kv_b = loaded.weights[p + "kv_b_proj.weight"].view(4, m.qk_nope_head_dim + m.v_head_dim, -1)
    o_proj = loaded.weights[p + "o_proj.weight"]
    for rank in (0, 1):
        model = _build_rank(loaded, rank, dtype="float32", formats=PhaseFormats.reference())
        mla, heads = model.layers[1].mla, slice(2 * rank, 2 * rank + 2)
        assert mla.heads == 2 and kv_components(model.cfg) == full
        assert torch.equal(mla.w_uk, kv_b[heads, : m.qk_nope_head_dim])
        assert torch.equal(mla.w_uv, kv_b[heads, m.qk_nope_head_dim :])
        cols = slice(rank * 2 * m.v_head_dim, (rank + 1) * 2 * m.v_head_dim)
        assert torch.equal(mla.o_proj.by_phase["decode"].weight, o_proj[:, cols])
        kv_a = loaded.weights[p + "kv_a_proj_with_mqa.weight"]
        assert torch.equal(mla.kv_a_proj.by_phase["decode"].weight, kv_a)  # the latent: every rank


def test_fewer_kv_heads_than_ranks_replicate_the_kv_head(tiny_model_dir):
    """One KV head over 2 ranks: both ranks hold it (K and V rows whole) and split its 4 query heads."""
    from pagoda.node_agent.models.loader import load_model

    loaded = load_model(str(tiny_model_dir("llama_kv1")))
    w, p, d = loaded.weights, "model.layers.0.self_attn.", loaded.config.head_dim
    for rank in (0, 1):
        model = _build_rank(loaded, rank, dtype="float32", formats=PhaseFormats.reference())
        assert (model.cfg.num_heads, model.cfg.num_kv_heads) == (2, 1)
        q = w[p + "q_proj.weight"][rank * 2 * d : (rank + 1) * 2 * d]
        want = torch.cat([q, w[p + "k_proj.weight"], w[p + "v_proj.weight"]])
        assert torch.equal(model.layers[0].qkv_proj.by_phase["decode"].weight, want)


@pytest.mark.slow  # about 49 s on 2 cores under a load of 7 (a refused run, then 2 ranks and 1)
def test_kimi_k2_two_ranks_from_the_command_line(tmp_path):
    """The released Kimi-K2 layout (tests/formats/kimi_writer.py) under ``pagoda generate
    --tensor-parallel 2 --trust-remote-code`` in the default formats (``stored`` for this source):
    the flag reaches the second rank, which loads the directory's tokenizer code too, and the tokens
    equal one rank's. Without the flag the command fails, naming it."""
    from tests.formats.kimi_writer import write_kimi_k2

    write_kimi_k2(tmp_path)
    path = str(tmp_path)
    refused = start_generate("--model", path, "--tensor-parallel", "2", "--prompt", PROMPTS[0])
    code, _, err = finish(refused)
    assert code != 0 and "--trust-remote-code" in err, err[-2000:]
    got = _tp2(path, "default", PROMPTS, NEW_TOKENS, TINY_KV, "--trust-remote-code")
    want = _tp1(path, "default", PROMPTS, NEW_TOKENS, trust_remote_code=True)
    assert got() == want
