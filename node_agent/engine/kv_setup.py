"""Sizing the KV page pools from the memory budget, and calibrating FP8 page scales at start-up."""

from __future__ import annotations

import logging

import torch

from pagoda.kernels.paged_attention import (
    RECOMMENDED_KV_HEADROOM,
    calibrate_head_scales,
    calibrate_tensor_scales,
)
from pagoda.node_agent.engine.calibration import CALIBRATION_TEXT
from pagoda.node_agent.engine.config import EngineConfig
from pagoda.node_agent.engine.memory import check_pool_fits
from pagoda.node_agent.engine.model_runner import ModelRunner
from pagoda.node_agent.kv import formats as kv_formats
from pagoda.node_agent.kv.pool import KVPagePool, storage_dtype
from pagoda.node_agent.models.config import ModelConfig
from pagoda.node_agent.models.tokenizer import Tokenizer

log = logging.getLogger("pagoda.engine")


def kv_components(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """What one token stores per layer: K and V per KV head (GQA), or for multi-head latent attention
    (DeepSeek-V3) one shared "head" of the compressed latent and one of the rope key (models/mla.py)."""
    if cfg.mla is not None:
        return {"latent": (1, cfg.mla.kv_lora_rank), "rope_k": (1, cfg.mla.qk_rope_head_dim)}
    return {"k": (cfg.num_kv_heads, cfg.head_dim), "v": (cfg.num_kv_heads, cfg.head_dim)}


def token_scaled_components(
    kv_format: str, granularity: str, components: dict[str, tuple[int, ...]]
) -> tuple[str, ...]:
    """The components whose scales are per token, as the KV format says (kv/formats.py): all of
    them in int8 pages; in fp8_e4m3 pages K under "per-token-k" (a GQA model's "k"; MLA's latent and
    rope key keep their static per-layer scales), none otherwise."""
    return kv_formats.get(kv_format).token_scaled(components, granularity)


def kv_budget_bytes(config: EngineConfig, device: torch.device) -> int:
    """Bytes for all KV pools: the configured size, a share of free GPU memory, or the CPU default."""
    if config.kv_memory is not None:
        return config.kv_memory
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * config.kv_memory_fraction)
    return config.cpu_kv_default


class PoolBuilder:
    """Builds a worker's KV pools for one model, dtype and device; FP8 pools with static scales are
    calibrated."""

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        runner: ModelRunner,
        tokenizer: Tokenizer,
        max_model_len: int,
        sizing: dict[str, tuple[int, ...]] | None = None,
        reduce_max=None,
    ) -> None:
        """``model_config``: this rank's slice under tensor parallelism; ``sizing``: the per-token
        components of the largest rank's slice (every rank gets as many pages as that one can
        hold); ``reduce_max``: the maximum of a tensor over the ranks (per-tensor FP8 scales)."""
        self.config = config
        self.model_config = model_config
        self.dtype = dtype
        self.device = device
        self.runner = runner
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.components = kv_components(model_config)
        self.sizing = sizing or self.components
        self.reduce_max = reduce_max

    def pools(self) -> tuple[KVPagePool, KVPagePool]:
        """(prefill pool, decode pool): one shared pool when both phases use the same KV format."""
        f = self.config.formats
        budget = kv_budget_bytes(self.config, self.device)
        only = {"prefill": f.prefill_kv, "decode": f.decode_kv}.get(self.config.role)
        if only or f.prefill_kv == f.decode_kv:
            pool = self.pool(only or f.decode_kv, budget, "kv")
            return pool, pool
        pre = int(budget * self.config.prefill_kv_fraction)
        return (
            self.pool(f.prefill_kv, pre, "prefill-kv"),
            self.pool(f.decode_kv, budget - pre, "decode-kv"),
        )

    def must_hold_sequence(self) -> bool:
        """A budget the engine chose (a share of free GPU memory, or the CPU default under an explicit
        max_model_len) must hold one max-length sequence; a configured kv_memory need only hold a page."""
        return self.config.kv_memory is None and (
            self.device.type == "cuda" or self.config.max_model_len is not None
        )

    def pool(self, kv_format: str, budget: int, name: str) -> KVPagePool:
        """As many pages of ``kv_format`` as ``budget`` bytes hold (scales calibrated for FP8)."""
        dt = storage_dtype(kv_format, self.dtype)
        n = self.model_config.num_layers
        tok = token_scaled_components(kv_format, self.config.kv_scale_granularity, self.components)
        pages = KVPagePool.pages_for_budget(budget, n, self.config.page_size, self.sizing, dt, tok, kv_format)
        check_pool_fits(
            name=name,
            kv_format=kv_format,
            budget=budget,
            pages=pages,
            page_size=self.config.page_size,
            bytes_per_page=KVPagePool.bytes_per_page(
                n, self.config.page_size, self.sizing, dt, tok, kv_format
            ),
            num_layers=n,
            max_model_len=self.max_model_len,
            must_hold_sequence=self.must_hold_sequence(),
        )
        pool = KVPagePool(
            n,
            pages,
            self.config.page_size,
            self.components,
            dt,
            self.device,
            kv_format=kv_format,
            name=name,
            token_scaled=tok,
        )
        if pool.static_scales is not None and any(pool.static_scales):
            self.calibrate(pool)
        return pool

    @torch.inference_mode()
    def calibrate(self, pool: KVPagePool) -> None:
        """Static FP8 scales per layer and component (per KV head, or one per tensor; the one MLA
        head) from the cache contents of a short built-in text. Per-token scales need none."""
        ids = self.tokenizer.encode(CALIBRATION_TEXT)[: self.max_model_len]
        n = len(ids)
        tmp = KVPagePool(
            self.model_config.num_layers,
            -(-n // self.config.page_size),
            self.config.page_size,
            self.components,
            self.dtype,
            self.device,
            name="calibration",
        )
        self.runner.score(ids, tmp, phase="prefill")
        per_tensor = self.config.kv_scale_granularity == "per-tensor"
        calibrate = calibrate_tensor_scales if per_tensor else calibrate_head_scales
        for layer, scales in zip(tmp.layers, pool.static_scales, strict=True):
            for c, scale in scales.items():
                found = calibrate(layer[c].flatten(0, 1)[:n], RECOMMENDED_KV_HEADROOM)
                if per_tensor and self.reduce_max is not None:  # one scale over every rank's heads
                    found = torch.full_like(found, float(self.reduce_max(found.max().reshape(1))))
                scale.copy_(found)
        log.info(
            "calibrated FP8 KV scales (%s) of %s on %d tokens", self.config.kv_scale_granularity, pool.name, n
        )
