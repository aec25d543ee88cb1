"""Building an engine's parts from its config: the replica, the model, the KV pools, the scheduler.

The order matters: the replica's ranks are started before the model loads (each rank loads its own
slice, at its own pace); the weights are checked against device memory before any reaches the
device; the pools are sized and calibrated on every rank at once (calibration runs the model);
only then does rank 0 start driving the other ranks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagoda.node_agent.engine.admission import Admission
from pagoda.node_agent.engine.config import EngineConfig
from pagoda.node_agent.engine.corrupt_layer import corrupt_layer
from pagoda.node_agent.engine.kv_setup import PoolBuilder
from pagoda.node_agent.engine.memory import check_weights_fit, estimate_weight_bytes, phase_weight_formats
from pagoda.node_agent.engine.model_runner import ModelRunner, build_model, context_limit
from pagoda.node_agent.engine.output import StopRules
from pagoda.node_agent.engine.parallel.replica import LocalReplica, make_replica
from pagoda.node_agent.engine.scheduler import Scheduler, SchedulerConfig
from pagoda.node_agent.engine.source_formats import resolve_weight_formats
from pagoda.node_agent.engine.step_budget import StepBudget
from pagoda.node_agent.engine.step_cost import StepCostModel
from pagoda.node_agent.kv.pool import KVPagePool
from pagoda.node_agent.models.config import ModelConfig
from pagoda.node_agent.models.llama import LlamaForCausalLM
from pagoda.node_agent.models.loader import LoadedModel, load_model, resolve_source
from pagoda.node_agent.models.step_ops import enable_compile
from pagoda.node_agent.models.tokenizer import Tokenizer
from pagoda.node_agent.models.tokenizer_code import check_tokenizer_trust

log = logging.getLogger("pagoda.engine")


@dataclass
class EngineParts:
    """What an engine is made of, built by ``build_parts``."""

    config: EngineConfig  # as given, with the weight formats left at auto resolved for the source
    replica: LocalReplica  # this process's part of the model replica (tensor parallel or not)
    model_config: ModelConfig  # the whole model (a rank holds a slice)
    tokenizer: Tokenizer
    model: LlamaForCausalLM
    runner: ModelRunner
    max_model_len: int
    prefill_pool: KVPagePool  # prompt chunks and the prefix cache
    decode_pool: KVPagePool  # decoding sequences (the same pool when the formats match)
    scheduler: Scheduler
    stop_rules: StopRules
    admission: Admission


def build_parts(
    config: EngineConfig,
    loaded: LoadedModel | None,
    tokenizer: Tokenizer | None,
    worker_main: Callable[..., None],
) -> EngineParts:
    """Every part of an engine; ``worker_main`` runs each tensor-parallel rank this process starts."""
    config = resolve_weight_formats(config)
    if tokenizer is None:  # untrusted custom tokenizer code stops the engine before any weight loads
        _check_source_trust(config)
    device, dtype = config.torch_device(), config.torch_dtype()
    replica = make_replica(config, worker_main)  # tensor parallelism: rank 0 drives the others
    loaded = _rank_model(config, loaded, replica)
    mc = loaded.config
    tokenizer = tokenizer or Tokenizer(loaded.tokenizer_dir, loaded.gguf_file, config.trust_remote_code)
    if config.chat_template is not None:
        tokenizer = tokenizer.with_chat_template(config.chat_template_text())
    if device.type == "cuda" and replica.world == 1:  # before any weight reaches the device
        _check_weights_fit(config, loaded, dtype, device)
    model = build_model(config, loaded, dtype, device, replica.group)
    del loaded
    replica.loaded()
    max_model_len = context_limit(config, mc)
    runner = ModelRunner(model, config.kernel_backend, replica)
    local = model.cfg  # this rank's heads
    if config.compile:  # at load, so that the first request does not pay it
        enable_compile(device, dtype, local.num_heads, local.num_kv_heads, local.head_dim)
    builder = PoolBuilder(
        config, local, dtype, device, runner, tokenizer, max_model_len, **replica.pool_args(mc)
    )
    prefill_pool, decode_pool = builder.pools()  # every rank at once (calibration runs the model)
    replica.join(mc, model, prefill_pool, decode_pool)
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_prefix_caching=config.enable_prefix_caching,
        ),
        prefill_pool,
        decode_pool,
        step_budget(config),
    )
    stop_rules = _stop_rules(mc, tokenizer, max_model_len)
    admission = Admission(prefill_pool, decode_pool, max_model_len, mc.vocab_size, config.max_num_seqs)
    return EngineParts(
        config,
        replica,
        mc,
        tokenizer,
        model,
        runner,
        max_model_len,
        prefill_pool,
        decode_pool,
        scheduler,
        stop_rules,
        admission,
    )


def _rank_model(config: EngineConfig, loaded: LoadedModel | None, replica: LocalReplica) -> LoadedModel:
    """This rank's model: it lists its own experts and reads only its slices
    (models/lazy_tensor.py); with the quality drill (fault injection only), one layer corrupted."""
    loaded = loaded or load_model(config.model, part=(replica.rank, replica.world), lazy=True)
    if config.corrupt_layer is not None:
        loaded = corrupt_layer(loaded, config.corrupt_layer, config.corrupt_scale)
    return loaded


def _check_source_trust(config: EngineConfig) -> None:
    kind, path = resolve_source(config.model)
    if kind == "hf-dir":
        check_tokenizer_trust(path, config.trust_remote_code)


def step_budget(config: EngineConfig) -> StepBudget | None:
    """The scheduler's time budget (None when ``itl_target_ms`` is None: tokens alone size steps).
    Under tensor parallelism only rank 0 schedules, so its cost model times the whole replica's step."""
    if config.itl_target_ms is None:
        return None
    f = config.formats
    model = StepCostModel(
        {"prefill": f"{f.prefill_weights}/{f.prefill_kv}", "decode": f"{f.decode_weights}/{f.decode_kv}"}
    )
    target = config.itl_target_ms / 1000 if config.itl_target_ms > 0 else None  # 0: auto
    floor = min(config.min_prefill_tokens, config.max_num_batched_tokens)
    return StepBudget(model, target, floor, config.page_size)


def _check_weights_fit(
    config: EngineConfig, loaded: LoadedModel, dtype: torch.dtype, device: torch.device
) -> None:
    """Refuse a model whose weights (in the phases' formats) cannot fit on the device."""
    est = estimate_weight_bytes(
        loaded.weights,
        phase_weight_formats(config),
        dtype,
        config.int4_group_size,
        int4_compute=config.int4_compute,
        # auto keeps a dense head on CUDA; a prefill worker holds only the dense one
        decode_head_format="dense" if config.role == "prefill" else config.decode_lm_head,
    )
    check_weights_fit(est, device)


def _stop_rules(mc: ModelConfig, tokenizer: Tokenizer, max_model_len: int) -> StopRules:
    eos = set(mc.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return StopRules(frozenset(eos), max_model_len)


def log_ready(parts: EngineParts, dtype: torch.dtype, device: torch.device, t0: float) -> None:
    mc, pool = parts.model_config, parts.decode_pool
    log.info(
        "engine ready in %.1fs: %s, %d layers, dtype %s, KV %d pages x %d tokens (%s), device %s",
        time.perf_counter() - t0,
        mc.arch,
        mc.num_layers,
        dtype,
        pool.num_pages,
        pool.page_size,
        pool.kv_format,
        device,
    )
