"""Released prequantized checkpoint formats: DeepSeek-V3/Kimi block-scaled FP8 and compressed-tensors
pack-quantized INT4 (W4A16). Tiny random Llama and Qwen3-MoE models from transformers are encoded
here by plain-torch encoders written from the format descriptions, saved with their
quantization_config, loaded by Pagoda and compared with transformers running the dequantized
checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from pagoda.kernels.fp8_block import Fp8BlockWeight
from pagoda.kernels.int4 import Int4Weight
from pagoda.kernels.linear import DenseLinear, Fp8BlockLinear, Int4Linear
from pagoda.node_agent.engine.config import EngineConfig, PhaseFormats
from pagoda.node_agent.engine.llm_engine import LLMEngine
from pagoda.node_agent.models.checkpoint_formats import convert_checkpoint, parse_quantization_config
from pagoda.node_agent.models.config import ModelLoadError
from pagoda.node_agent.models.loader import load_model
from pagoda.node_agent.models.moe import MoeMLP
from tests.tiny_models import TOKENIZER_VOCAB, random_causal_lm

pytestmark = pytest.mark.slow

BLOCK = 128
GROUP = 32
FP8_QC = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "weight_block_size": [BLOCK, BLOCK],
    "activation_scheme": "dynamic",
}
INT4_QC = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "group_0": {
            "weights": {
                "num_bits": 4,
                "type": "int",
                "symmetric": True,
                "strategy": "group",
                "group_size": GROUP,
            },
            "input_activations": None,
            "targets": ["Linear"],
        }
    },
    "ignore": ["lm_head"],
}
# float32 end to end against transformers on the same (dequantized) weights, with the reference
# kernels: only summation order differs (paged attention, grouped expert GEMMs), as in
# tests/engine/test_moe_models.py.
MAX_ABS_LOGIT_DIFF = 1e-3
LLAMA = dict(
    vocab_size=TOKENIZER_VOCAB,
    hidden_size=192,  # 1.5 FP8 blocks: a partial block on both axes
    intermediate_size=320,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=48,
    max_position_embeddings=256,
    initializer_range=0.05,
    tie_word_embeddings=False,
)


def _hf_model(arch: str):
    from transformers import LlamaConfig, Qwen3MoeConfig

    if arch == "llama":
        cfg = LlamaConfig(**LLAMA)
    else:
        cfg = Qwen3MoeConfig(
            **LLAMA, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True
        )

    def draw_routers(model) -> None:
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and getattr(gate, "weight", None) is not None:
                torch.nn.init.normal_(gate.weight, std=0.5)  # routing that depends on the input

    return random_causal_lm(cfg, prepare=draw_routers)


# ---------------------------------------------------------------- independent encoders


def encode_fp8_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (e4m3 [N, K], scale_inv float32 [ceil(N/128), ceil(K/128)]): per 128x128
    block, scale_inv = amax / 448 and value = w / scale_inv (DeepSeek-V3's layout)."""
    n, k = w.shape
    nb, kb = -(-n // BLOCK), -(-k // BLOCK)
    scale_inv = torch.empty(nb, kb, dtype=torch.float32)
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    for i in range(nb):
        for j in range(kb):
            blk = w[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK].float()
            s = max(blk.abs().max().item(), 1e-8) / 448.0
            scale_inv[i, j] = s
            q[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK] = (blk / s).to(torch.float8_e4m3fn)
    return q, scale_inv


def decode_fp8_block(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    s = scale_inv.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:n, :k]
    return q.float() * s


def encode_pack_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (int32 [N, K/8], bf16 scale [N, K/32]): symmetric groups of 32, q in
    [-8, 7] stored as q + 8, value 8c+i of a row in bits 4i.. of word c."""
    n, k = w.shape
    wg = w.float().reshape(n, k // GROUP, GROUP)
    scale = (wg.abs().amax(-1) / 7.0).clamp(min=1e-8).to(torch.bfloat16)
    q = torch.round(wg / scale.float()[..., None]).clamp(-8, 7).reshape(n, k).long() + 8
    words = torch.zeros(n, k // 8, dtype=torch.int64)
    for i in range(8):
        words |= q[:, i::8] << (4 * i)
    words = torch.where(words >= 2**31, words - 2**32, words)  # two's complement into int32
    return words.to(torch.int32), scale


def decode_pack_int4(words: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n = words.shape[0]
    vals = torch.stack([(words.long() >> (4 * i)) & 0xF for i in range(8)], dim=-1).reshape(n, -1)
    q = (vals - 8).float().reshape(n, scale.shape[1], GROUP)
    return (q * scale.float()[..., None]).reshape(n, -1)


def _quantized_name(name: str) -> bool:
    return name.endswith("_proj.weight") and name.startswith("model.layers.")


def _per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' fused expert tensors -> per-expert ``experts.{e}.gate_proj.weight``... (the
    released checkpoints' naming)."""
    out = {}
    for name, t in state.items():
        if name.endswith("experts.gate_up_proj"):
            p, half = name.removesuffix("gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{p}{e}.gate_proj.weight"], out[f"{p}{e}.up_proj.weight"] = t[e, :half], t[e, half:]
        elif name.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                out[f"{name.removesuffix('down_proj')}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


def _fused(state: dict[str, torch.Tensor], like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors back into the fused names of ``like`` (a transformers state dict)."""
    out = {k: v for k, v in state.items() if ".experts." not in k}
    for name, t in like.items():
        if name.endswith("experts.gate_up_proj"):
            p = name.removesuffix("gate_up_proj")
            out[name] = torch.stack(
                [
                    torch.cat([state[f"{p}{e}.gate_proj.weight"], state[f"{p}{e}.up_proj.weight"]])
                    for e in range(t.shape[0])
                ]
            )
        elif name.endswith("experts.down_proj"):
            p = name.removesuffix("down_proj")
            out[name] = torch.stack([state[f"{p}{e}.down_proj.weight"] for e in range(t.shape[0])])
    return out


def write_checkpoint(model, fmt: str, path, tokenizer) -> tuple[dict, dict]:
    """Save ``model`` in ``fmt`` ('fp8' | 'int4'); returns (stored tensors, dequantized state dict
    in transformers' names)."""
    stored, deq = {}, {}
    for name, t in _per_expert(model.state_dict()).items():
        t = t.detach().float().contiguous()
        if not _quantized_name(name):
            stored[name], deq[name] = t, t
            continue
        base = name.removesuffix(".weight")
        if fmt == "fp8":
            q, s = encode_fp8_block(t)
            stored[name], stored[base + ".weight_scale_inv"] = q, s
            deq[name] = decode_fp8_block(q, s)
        else:
            words, s = encode_pack_int4(t)
            stored[base + ".weight_packed"], stored[base + ".weight_scale"] = words, s
            stored[base + ".weight_shape"] = torch.tensor(list(t.shape), dtype=torch.int64)
            deq[name] = decode_pack_int4(words, s)
    deq = _fused(deq, model.state_dict())
    save_file(stored, str(path / "model.safetensors"))
    cfg = model.config.to_dict()
    cfg["quantization_config"] = FP8_QC if fmt == "fp8" else INT4_QC
    (path / "config.json").write_text(json.dumps(cfg))
    tokenizer._tok.save_pretrained(path)
    return stored, deq


@pytest.fixture(scope="module", params=["llama", "qwen3_moe"])
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module", params=["fp8", "int4"])
def checkpoint(request, arch, tmp_path_factory, builtin_tokenizer):
    """(fmt, path, stored tensors, transformers model on the dequantized weights)."""
    fmt = request.param
    model = _hf_model(arch)
    path = tmp_path_factory.mktemp(f"{arch}-{fmt}")
    stored, deq = write_checkpoint(model, fmt, path, builtin_tokenizer)
    return fmt, path, stored, model, deq


# ---------------------------------------------------------------- loading


def test_loader_keeps_the_stored_quantization(checkpoint):
    fmt, path, stored, _, _ = checkpoint
    loaded = load_model(str(path))
    names = [n for n in loaded.weights if _quantized_name(n)]
    assert names and all(n.endswith(".weight") for n in names)
    for name in names:
        w = loaded.weights[name]
        base = name.removesuffix(".weight")
        if fmt == "int4":
            assert isinstance(w, Int4Weight) and w.symmetric and w.group_size == GROUP and w.zeros is None
            # bit for bit: the very int32 words, read as the canonical nibble bytes
            assert torch.equal(w.packed, stored[base + ".weight_packed"].view(torch.uint8))
            assert torch.equal(w.scales, stored[base + ".weight_scale"].float())
        else:  # the very e4m3 bytes and block scales
            assert isinstance(w, Fp8BlockWeight) and w.block == (BLOCK, BLOCK)
            assert torch.equal(w.weight.view(torch.uint8), stored[name].view(torch.uint8))
            assert torch.equal(w.scale, stored[base + ".weight_scale_inv"])
            assert torch.equal(
                w.dequantize(), decode_fp8_block(stored[name], stored[base + ".weight_scale_inv"])
            )
    assert loaded.weights["model.embed_tokens.weight"].dtype == torch.float32


def _engine(path, formats: PhaseFormats) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(path), dtype="float32", formats=formats, kv_memory=8 << 20, kernel_backend="reference"
        )
    )


def _logits(model, state: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    model.load_state_dict(state)
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def test_logits_match_transformers_on_the_dequantized_checkpoint(checkpoint):
    fmt, path, stored, model, deq = checkpoint
    # the native format in one phase, a dense float32 copy in the other
    if fmt == "fp8":
        formats, native, dense = PhaseFormats("fp8", "bf16", "bf16", "bf16"), "prefill", "decode"
    else:
        formats, native, dense = PhaseFormats("bf16", "bf16", "int4", "bf16"), "decode", "prefill"
    engine = _engine(path, formats)
    ids = engine.tokenize("The quick brown fox jumps over the lazy dog and keeps running.")
    want = _logits(model, deq, ids)
    assert want.std().item() > 0.1
    # served from the stored nibbles / e4m3 blocks and their scales: exact up to summation order
    for phase in (native, dense):
        assert (engine.score(ids, phase=phase) - want).abs().max().item() <= MAX_ABS_LOGIT_DIFF, phase

    # the stored weight serves its phase's format as is; the other phase holds a dense copy
    layer = engine.model.layers[0]
    o = layer.o_proj  # never fused with another projection (q/k/v and gate/up may be)
    lin, other = o.by_phase[native], o.by_phase[dense]
    assert isinstance(other, DenseLinear) and other.weight.dtype == torch.float32
    if fmt == "int4":
        assert isinstance(lin, Int4Linear)
        words = stored["model.layers.0.self_attn.o_proj.weight_packed"]
        assert torch.equal(lin.weight.packed, words.view(torch.uint8))
        assert lin.nbytes == words.nbytes + lin.weight.scales.nbytes  # nibbles + float32 scales only
    else:  # e4m3 bytes, one float32 scale per block and an int32 row map
        assert isinstance(lin, Fp8BlockLinear)
        scales = stored["model.layers.0.self_attn.o_proj.weight_scale_inv"]
        assert lin.nbytes == lin.weight.weight.numel() + scales.nbytes + 4 * lin.weight.out_features
    moes = [la.mlp for la in engine.model.layers if isinstance(la.mlp, MoeMLP)]
    for m in moes:
        stack = m.stacks[native]
        assert stack.fmt == {"fp8": "fp8_block"}.get(fmt, fmt) and m.stacks[dense].fmt == "dense"
        if fmt == "int4":
            p = m_prefix(engine, m)
            gate = stored[f"{p}experts.1.gate_proj.weight_packed"].view(torch.uint8)
            up = stored[f"{p}experts.1.up_proj.weight_packed"].view(torch.uint8)
            assert torch.equal(stack.gate_up[1], torch.cat([gate, up]))
            assert stack.symmetric and stack.group_size == GROUP


def m_prefix(engine: LLMEngine, mlp: MoeMLP) -> str:
    idx = [la.mlp for la in engine.model.layers].index(mlp)
    return f"model.layers.{idx}.mlp."


# ---------------------------------------------------------------- errors


def _int4_qc(**weights) -> dict:
    qc = json.loads(json.dumps(INT4_QC))
    qc["config_groups"]["group_0"]["weights"].update(weights)
    return qc


@pytest.mark.parametrize(
    ("qc", "message"),
    [
        (_int4_qc(num_bits=2), "num_bits is 2"),
        (_int4_qc(strategy="channel"), "strategy is 'channel'"),
        (_int4_qc(group_size=48), "group_size is 48"),
        (
            {
                **INT4_QC,
                "config_groups": {"g": {**INT4_QC["config_groups"]["group_0"], "input_activations": {}}},
            },
            "activation quantization is not supported",
        ),
        ({**INT4_QC, "format": "float-quantized"}, "only 'pack-quantized'"),
        ({**FP8_QC, "activation_scheme": "static"}, "activation_scheme 'static'"),
        ({**FP8_QC, "fmt": "e5m2"}, "fmt 'e5m2'"),
        ({**FP8_QC, "weight_block_size": [128]}, "weight_block_size must be two positive integers"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
        ("fp8", "must be an object"),
    ],
)
def test_unsupported_quantization_config_is_a_clear_load_error(qc, message):
    with pytest.raises(ModelLoadError, match=message.replace("(", r"\(")):
        parse_quantization_config({"quantization_config": qc})


def test_loader_reports_unsupported_and_malformed_checkpoints(checkpoint):
    fmt, path, stored, _, _ = checkpoint
    raw = json.loads((path / "config.json").read_text())
    bad = path.parent / f"{path.name}-bad"
    bad.mkdir()
    for f in path.iterdir():
        if f.name != "config.json":
            (bad / f.name).symlink_to(f)
    (bad / "config.json").write_text(json.dumps({**raw, "quantization_config": {"quant_method": "hqq"}}))
    with pytest.raises(ModelLoadError, match="unsupported quantization_config.quant_method 'hqq'"):
        load_model(str(bad))
    # a scale of the wrong shape names the tensor
    (bad / "model.safetensors").unlink()
    key = "model.layers.0.self_attn.q_proj." + ("weight_scale_inv" if fmt == "fp8" else "weight_scale")
    save_file({**stored, key: stored[key][:1].contiguous()}, str(bad / "model.safetensors"))
    (bad / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight"):
        load_model(str(bad))


def test_weights_the_model_reads_as_tensors_come_back_dequantized():
    """Embeddings, LM head, routers and MLA's kv_b_proj are plain tensors to the model: quantized in a
    checkpoint, they load as float32 (the exact block-dequantized values)."""
    torch.manual_seed(1)
    w = torch.randn(160, 96)
    q, s = encode_fp8_block(w)
    names = ["lm_head.weight", "model.layers.0.self_attn.kv_b_proj.weight", "model.layers.0.mlp.gate.weight"]
    stored = {n: q for n in names} | {n.removesuffix("weight") + "weight_scale_inv": s for n in names}
    stored["model.norm.weight"] = torch.ones(96, dtype=torch.bfloat16)
    out = convert_checkpoint(stored, parse_quantization_config({"quantization_config": FP8_QC}))
    want = decode_fp8_block(q, s)
    for n in names:
        assert out[n].dtype == torch.float32 and torch.equal(out[n], want), n
    assert out["model.norm.weight"].dtype == torch.float32
    assert set(out) == {*names, "model.norm.weight"}
