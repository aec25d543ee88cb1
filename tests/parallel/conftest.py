"""Tiny random-weight models of every supported family, saved once per session by transformers, with
widths a tensor-parallel degree of 2 can split at the default INT4 group (128): attention widths
(query heads x head dim) and MLP widths of 256, so each rank's column slice keeps whole groups."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.tiny_models import TOKENIZER_VOCAB, save_random_model

# Weights N(0, 0.05) from seed 0: logits with a standard deviation of 0.4 (0.8 for the wider qwen2).
# Along the compared greedy paths (one rank) the smallest top-1 over top-2 logit margin per family
# and formats measures 1e-4 (llama, default formats) to 7e-3. Two ranks change only the float32
# summation order of o_proj, down_proj and the embedding (relative 1e-7, so about 1e-7 of a logit,
# estimated, not measured), three orders of magnitude below the smallest margin.
INIT_STD = 0.05
SEED = 0

_BASE = dict(
    vocab_size=TOKENIZER_VOCAB,
    hidden_size=64,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=INIT_STD,
    tie_word_embeddings=False,
)
_MOE = dict(
    _BASE,
    num_hidden_layers=3,
    moe_intermediate_size=128,
    num_experts_per_tok=2,
    norm_topk_prob=True,
)
_ROUTED_FIRST_DENSE = dict(
    n_routed_experts=8, n_shared_experts=2, first_k_dense_replace=1, routed_scaling_factor=2.5
)


def _hf_config(family: str):
    """The transformers config of ``family`` (4 query heads; KV heads 2, or 1 for ``llama_kv1``)."""
    import transformers as tf

    if family == "llama":  # GQA: 2 KV heads, one per rank
        return tf.LlamaConfig(**_BASE, head_dim=64, rope_theta=10000.0)
    if family == "llama_kv1":  # 1 KV head < 2 ranks: the KV head is replicated, its queries split
        return tf.LlamaConfig(**{**_BASE, "num_key_value_heads": 1}, head_dim=64, rope_theta=10000.0)
    if family == "llama_narrow":  # o_proj input width 128: the default INT4 group (128) cannot split
        return tf.LlamaConfig(**_BASE, head_dim=32, rope_theta=10000.0)
    if family == "qwen3":  # q/k RMSNorm per head
        return tf.Qwen3Config(**_BASE, head_dim=64, rope_theta=1000000.0)
    if family == "qwen2":  # q/k/v biases
        return tf.Qwen2Config(**{**_BASE, "hidden_size": 256, "tie_word_embeddings": True}, rope_theta=1e6)
    if family == "qwen3_moe":  # layer 1 dense through mlp_only_layers
        return tf.Qwen3MoeConfig(
            **_MOE, head_dim=64, num_experts=8, decoder_sparse_step=1, mlp_only_layers=[1]
        )
    if family == "glm4_moe":  # shared experts, sigmoid routing over groups, partial RoPE, q/k norm
        return tf.Glm4MoeConfig(
            **_MOE,
            **_ROUTED_FIRST_DENSE,
            head_dim=64,
            n_group=4,
            topk_group=2,
            attention_bias=True,
            use_qk_norm=True,
            partial_rotary_factor=0.5,
        )
    if family == "deepseek_v3":  # MLA with a q LoRA, the first layer dense, grouped sigmoid MoE
        return tf.DeepseekV3Config(
            **{**_MOE, "num_key_value_heads": 4},
            **_ROUTED_FIRST_DENSE,
            n_group=2,
            topk_group=1,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=64,
            rope_theta=10000.0,
        )
    raise KeyError(family)


def _make_params_matter(model: torch.nn.Module) -> None:
    """Routers, routing biases and attention biases that transformers zero-initialises, drawn."""
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if isinstance(getattr(gate, "weight", None), torch.Tensor) and gate.weight.dim() == 2:
            torch.nn.init.normal_(gate.weight, std=0.5)
        bias = getattr(gate, "e_score_correction_bias", None)
        if isinstance(bias, torch.Tensor):
            bias.normal_(std=0.2)
        for name in ("q_proj", "k_proj", "v_proj"):
            proj = getattr(layer.self_attn, name, None)
            if getattr(proj, "bias", None) is not None:
                torch.nn.init.normal_(proj.bias, std=0.5)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, builtin_tokenizer):
    """``tiny_model_dir(family)``: the directory of that family's tiny model (saved on first use)."""
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            path = tmp_path_factory.mktemp(f"tp_{family}")
            _, made[family] = save_random_model(
                _hf_config(family), path, builtin_tokenizer, seed=SEED, prepare=_make_params_matter
            )
        return made[family]

    return get


_RUNNING: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _no_leftover_generate():
    """A test that fails before reading its ``pagoda generate`` leaves no process behind."""
    yield
    while _RUNNING:
        proc = _RUNNING.pop()
        if proc.poll() is None:
            proc.terminate()  # rank 0; the rank it started exits when the group is lost
            try:
                proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()


def start_generate(*args: str) -> subprocess.Popen:
    """``pagoda generate --json ARGS`` in a fresh process (one line of JSON per prompt on stdout),
    started now so that the caller's own work overlaps its start-up."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "PAGODA_NODE_RANK"):
        env.pop(name, None)  # a single-host replica: Pagoda starts its ranks itself
    cmd = [sys.executable, "-m", "pagoda.node_agent.cli.main", "generate", "--json", *args]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _RUNNING.append(proc)
    return proc


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of a started process; killed (and the test failed) past ``timeout``."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"pagoda generate did not finish within {timeout}s: {err[-3000:]}")
    return proc.returncode, out, err
