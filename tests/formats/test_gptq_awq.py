"""GPTQ and AWQ W4A16 checkpoints load into Int4Weight bit-exactly.

The encoders below write each on-disk layout from its definition (AutoGPTQ's qweight [K/8, N] and
qzeros [G, N/8] packed low nibble first, v1 storing zero - 1; AutoAWQ's GEMM words packed along N in
the interleaved order 0 2 4 6 1 3 5 7), independently of the loader; the dequantized weights are
compared element for element with what the test packed."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from pagoda.kernels.int4 import Int4Weight
from pagoda.kernels.linear import Int4Linear
from pagoda.node_agent.engine.config import EngineConfig, PhaseFormats
from pagoda.node_agent.engine.llm_engine import LLMEngine
from pagoda.node_agent.models.checkpoint_formats import convert_checkpoint, parse_quantization_config
from pagoda.node_agent.models.config import ModelLoadError
from pagoda.node_agent.models.loader import load_model
from tests.tiny_models import TOKENIZER_VOCAB, random_causal_lm

AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i of a word holds output column 8c + this[i]
NAME = "model.layers.0.mlp.down_proj"


def _int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit values in int64 -> int32 two's complement (as safetensors stores them)."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _pack_rows_low_first(v: torch.Tensor) -> torch.Tensor:
    """[8R, C] values 0..15 -> [R, C] words: row 8r+i in bits 4i.. of word r (GPTQ's qweight)."""
    words = torch.zeros(v.shape[0] // 8, v.shape[1], dtype=torch.int64)
    for i in range(8):
        words |= v[i::8].long() << (4 * i)
    return _int32(words)


def _pack_cols(v: torch.Tensor, order: list[int]) -> torch.Tensor:
    """[R, 8C] values 0..15 -> [R, C] words: column 8c + order[i] in bits 4i.. of word c."""
    words = torch.zeros(v.shape[0], v.shape[1] // 8, dtype=torch.int64)
    for i in range(8):
        words |= v[:, order[i] :: 8].long() << (4 * i)
    return _int32(words)


def encode_gptq(q, zeros, scales, v1: bool, g_idx=None, name: str = NAME) -> dict[str, torch.Tensor]:
    """q [N, K] 0..15, zeros [N, G] (true zero points), scales float16 [N, G] -> GPTQ tensors."""
    k, g_count = q.shape[1], zeros.shape[1]
    stored = zeros - 1 if v1 else zeros
    assert int(stored.min()) >= 0 and int(stored.max()) <= 15
    if g_idx is None:
        g_idx = torch.arange(k) // (k // g_count)
    return {
        f"{name}.qweight": _pack_rows_low_first(q.t()),
        f"{name}.qzeros": _pack_cols(stored.t(), list(range(8))),
        f"{name}.scales": scales.t().contiguous(),
        f"{name}.g_idx": g_idx.to(torch.int32),
    }


def encode_awq(q, zeros, scales, name: str = NAME) -> dict[str, torch.Tensor]:
    return {
        f"{name}.qweight": _pack_cols(q.t().contiguous(), AWQ_PACK_ORDER),
        f"{name}.qzeros": _pack_cols(zeros.t().contiguous(), AWQ_PACK_ORDER),
        f"{name}.scales": scales.t().contiguous(),
    }


def dequant(q, zeros, scales, g_idx) -> torch.Tensor:
    """The formats' definition: w[n, k] = (q[n, k] - zero[n, g(k)]) * scale[n, g(k)]."""
    gi = g_idx.long()
    return (q.float() - zeros[:, gi].float()) * scales[:, gi].float()


def _random(n: int, k: int, g: int, seed: int, sym: bool = False, v1: bool = False, zero16: bool = False):
    """Random codes, zero points and float16 scales; v1 files cannot store a zero of 0 (zero - 1)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen)
    zeros = (
        torch.full((n, k // g), 8) if sym else torch.randint(1 if v1 else 0, 16, (n, k // g), generator=gen)
    )
    if zero16:
        zeros[0, 0] = 16  # v1 only: stored as nibble 15
    scales = (torch.rand(n, k // g, generator=gen) * 0.02 + 1e-3).half()
    return q, zeros, scales


def _gptq_qc(g: int, **kw) -> dict:
    return {
        "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": g, "desc_act": False, **kw}
    }


def _awq_qc(g: int, **kw) -> dict:
    return {
        "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": g, "zero_point": True, **kw}
    }


def _load(stored: dict, raw: dict) -> Int4Weight:
    out = convert_checkpoint(stored, parse_quantization_config(raw))
    assert set(out) == {f"{NAME}.weight"}  # every stored tensor consumed
    return out[f"{NAME}.weight"]


@pytest.mark.parametrize(
    ("g", "sym", "fmt"),
    [(32, False, "gptq"), (64, True, "gptq"), (128, False, "gptq_v2"), (128, True, "gptq_v2")],
)
def test_gptq_loads_bit_exactly(g, sym, fmt):
    n, k = 48, 256
    q, zeros, scales = _random(n, k, g, seed=g, sym=sym, v1=fmt == "gptq")
    stored = encode_gptq(q, zeros, scales, v1=fmt == "gptq")
    w = _load(stored, _gptq_qc(g, sym=sym, checkpoint_format=fmt))
    assert isinstance(w, Int4Weight) and w.group_size == g and w.symmetric == sym and w.mins is None
    assert torch.equal(w.dequantize(), dequant(q, zeros, scales, torch.arange(k) // g))
    if not sym:
        assert torch.equal(w.zeros, zeros.to(torch.uint8))  # integer zero points kept as integers
    # no unpacking: the packed nibbles are the qweight words' bytes, transposed
    assert torch.equal(w.packed, stored[f"{NAME}.qweight"].t().contiguous().view(torch.uint8))


def test_gptq_v1_zero_of_16_loads_exactly_as_float_offsets():
    q, zeros, scales = _random(16, 64, 32, seed=3, v1=True, zero16=True)
    w = _load(encode_gptq(q, zeros, scales, v1=True), _gptq_qc(32, sym=False))
    assert w.mins is not None and w.zeros is None
    assert torch.equal(w.dequantize(), dequant(q, zeros, scales, torch.arange(64) // 32))


@pytest.mark.parametrize("g", [32, 64, 128])
def test_awq_loads_bit_exactly(g):
    n, k = 40, 256
    q, zeros, scales = _random(n, k, g, seed=100 + g)
    w = _load(encode_awq(q, zeros, scales), _awq_qc(g, version="GEMM"))
    assert isinstance(w, Int4Weight) and w.group_size == g and not w.symmetric
    assert torch.equal(w.zeros, zeros.to(torch.uint8))
    assert torch.equal(w.dequantize(), dequant(q, zeros, scales, torch.arange(k) // g))


def test_act_order_in_contiguous_runs_loads_exactly_a_real_permutation_is_refused():
    n, k, g = 16, 128, 32
    q, zeros, scales = _random(n, k, g, seed=7, v1=True)
    runs = torch.tensor([2, 0, 3, 1]).repeat_interleave(g)  # whole runs of g channels, groups shuffled
    w = _load(encode_gptq(q, zeros, scales, v1=True, g_idx=runs), _gptq_qc(g, sym=False, desc_act=True))
    assert torch.equal(w.dequantize(), dequant(q, zeros, scales, runs))
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(0))
    real = (torch.arange(k) // g)[perm]
    with pytest.raises(
        ModelLoadError, match=r"down_proj\.g_idx is a real act-order \(desc_act\) permutation"
    ):
        _load(encode_gptq(q, zeros, scales, v1=True, g_idx=real), _gptq_qc(g, sym=False, desc_act=True))


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (_gptq_qc(128, bits=8), "gptq quantization_config.bits is 8; only 4-bit"),
        (_gptq_qc(128, bits=3), "bits is 3"),
        (_gptq_qc(-1), "group_size is -1"),
        (_gptq_qc(128, checkpoint_format="marlin"), "checkpoint_format is 'marlin'"),
        (_gptq_qc(128, is_marlin_format=True), "is_marlin_format"),
        (_gptq_qc(128, sym="yes"), "sym must be true or false"),
        (_awq_qc(128, version="gemv"), "awq quantization_config.version is 'gemv'"),
        (_awq_qc(128, version="marlin"), "version is 'marlin'"),
        (_awq_qc(128, zero_point=False), "zero_point is False"),
        (_awq_qc(128, bits=8), "awq quantization_config.bits is 8"),
        (_awq_qc(64, backend="llm-awq"), "backend is 'llm-awq'"),
        ({"quantization_config": {"quant_method": "exl2", "bits": 4}}, "quant_method 'exl2'"),
    ],
)
def test_unsupported_variants_name_the_field(raw, message):
    with pytest.raises(ModelLoadError, match=message):
        parse_quantization_config(raw)


def test_mismatched_tensors_name_the_tensor():
    q, zeros, scales = _random(16, 64, 32, seed=1, v1=True)
    stored = encode_gptq(q, zeros, scales, v1=True)
    with pytest.raises(ModelLoadError, match=r"down_proj\.qzeros: sym is true but zero points"):
        _load(stored, _gptq_qc(32))  # asymmetric zeros under sym: true
    bad = {**stored, f"{NAME}.scales": stored[f"{NAME}.scales"][:1].contiguous()}
    with pytest.raises(ModelLoadError, match=r"down_proj\.scales must be floating point \(2, 16\)"):
        _load(bad, _gptq_qc(32, sym=False))
    with pytest.raises(ModelLoadError, match=r"down_proj\.qweight must be int32 \(64, 2\)"):
        awq = encode_awq(q, zeros, scales)
        _load({**awq, f"{NAME}.qweight": awq[f"{NAME}.qweight"][:, :1].contiguous()}, _awq_qc(32))


# ---------------------------------------------------------------- engine level

TINY = dict(
    vocab_size=TOKENIZER_VOCAB,
    hidden_size=192,
    intermediate_size=320,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=48,
    max_position_embeddings=256,
    initializer_range=0.05,
    tie_word_embeddings=False,
)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# float32 with the reference kernels on the same dequantized weights: only summation order differs
MAX_ABS_LOGIT_DIFF = 1e-3


def _rtn(w: torch.Tensor, g: int, min_zero: int):
    """Asymmetric round to nearest -> (q, zeros, float16 scales), as a GPTQ/AWQ file would hold
    (zeros from ``min_zero``: a GPTQ v1 file stores zero - 1, so it has no zero of 0)."""
    n, k = w.shape
    wg = w.float().reshape(n, k // g, g)
    lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
    scales = ((hi - lo) / 15).clamp(min=1e-6).half()
    zeros = (-lo / scales.float()).round().clamp(min_zero, 15).long()
    q = (torch.round(wg / scales.float()[..., None]) + zeros[..., None]).clamp(0, 15).reshape(n, k).long()
    return q, zeros, scales


@pytest.mark.slow
@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_tiny_llama_serves_the_checkpoint_like_transformers_dequantized(method, tmp_path, builtin_tokenizer):
    from transformers import LlamaConfig

    model = random_causal_lm(LlamaConfig(**TINY))
    g = 64 if method == "gptq" else 32
    stored, deq = {}, {}
    for name, t in model.state_dict().items():
        base = name.removesuffix(".weight")
        if not base.endswith(LINEARS):
            stored[name] = deq[name] = t.detach().float().contiguous()
            continue
        q, zeros, scales = _rtn(t.detach(), g, 1 if method == "gptq" else 0)
        if method == "gptq":
            stored.update(encode_gptq(q, zeros, scales, v1=True, name=base))
        else:
            stored.update(encode_awq(q, zeros, scales, name=base))
        deq[name] = dequant(q, zeros, scales, torch.arange(t.shape[1]) // g)
    save_file(stored, str(tmp_path / "model.safetensors"))
    cfg = model.config.to_dict()
    cfg["quantization_config"] = (_gptq_qc(g, sym=False) if method == "gptq" else _awq_qc(g))[
        "quantization_config"
    ]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    builtin_tokenizer._tok.save_pretrained(tmp_path)

    loaded = load_model(str(tmp_path))
    name = "model.layers.1.self_attn.o_proj.weight"
    w = loaded.weights[name]
    assert isinstance(w, Int4Weight) and torch.equal(w.dequantize(), deq[name])
    engine = LLMEngine(
        EngineConfig(
            model=str(tmp_path),
            dtype="float32",
            formats=PhaseFormats("bf16", "bf16", "int4", "bf16"),
            kv_memory=8 << 20,
            kernel_backend="reference",
        ),
        loaded=loaded,
    )
    lin = engine.model.layers[1].o_proj.by_phase["decode"]
    assert isinstance(lin, Int4Linear)  # served as loaded (a copy), not requantized
    assert torch.equal(lin.weight.dequantize(), deq[name])
    ids = engine.tokenize("The quick brown fox jumps over the lazy dog and keeps running.")
    model.load_state_dict(deq)
    with torch.inference_mode():
        want = model(torch.tensor([ids])).logits[0].float()
    assert want.std().item() > 0.1
    for phase in ("decode", "prefill"):  # int4 as stored; the dense prefill copy is its dequantization
        assert (engine.score(ids, phase=phase) - want).abs().max().item() <= MAX_ABS_LOGIT_DIFF, phase
