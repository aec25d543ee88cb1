"""Engine configuration: model, precision, KV budget, batching limits, per-phase formats."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads only when a model does: `pagoda serve --role router` never needs it
    import torch

from pagoda.vocabulary import (
    DEFAULT_INT4_COMPUTE,
    ENGINE_ROLES,
    INT4_COMPUTES,
    INTEGRITY_MODES,
    KV_CACHE_FORMATS,
    KV_FORMAT_ALIASES,
    PHASE_DEFAULTS,
    SOURCE_DEFAULT,
    WEIGHT_FORMATS,
    handoff_allowed,
)


class ConfigError(ValueError):
    """An engine setting that cannot work, found before anything is loaded."""


@dataclass
class PhaseFormats:
    """Numeric formats per phase: weights and KV cache for prefill and for decode.

    Weights left at ``auto`` (SOURCE_DEFAULT) follow the source, resolved when the engine is built
    (engine/source_formats.py): ``stored`` for a checkpoint released quantized, else fp8 prefill and
    int4 decode (PHASE_DEFAULTS)."""

    prefill_weights: str = SOURCE_DEFAULT
    prefill_kv: str = PHASE_DEFAULTS["prefill"]["kv"]
    decode_weights: str = SOURCE_DEFAULT
    decode_kv: str = PHASE_DEFAULTS["decode"]["kv"]

    @classmethod
    def reference(cls) -> PhaseFormats:
        """Dense weights and KV in the compute dtype for both phases (the transformers-comparable path)."""
        return cls("bf16", "bf16", "bf16", "bf16")

    @classmethod
    def parse(cls, text: str) -> PhaseFormats:
        """'int4/fp8' (decode weights/KV, prefill stays high precision) or 'pw/pkv/dw/dkv'."""
        parts = [p.strip() for p in text.split("/")]
        kv = KV_FORMAT_ALIASES
        if len(parts) == 2:
            f = cls("bf16", "bf16", parts[0], kv.get(parts[1], parts[1]))
        elif len(parts) == 4:
            f = cls(parts[0], kv.get(parts[1], parts[1]), parts[2], kv.get(parts[3], parts[3]))
        else:
            raise ConfigError(f"cannot read formats from {text!r}: use WEIGHTS/KV or PW/PKV/DW/DKV")
        f.validate()
        return f

    def validate(self) -> None:
        for name in ("prefill_weights", "decode_weights"):
            if getattr(self, name) not in (*WEIGHT_FORMATS, SOURCE_DEFAULT):
                raise ConfigError(
                    f"{name.replace('_', '-')} must be one of {', '.join(WEIGHT_FORMATS)} (or "
                    f"{SOURCE_DEFAULT}: the source's default), "
                    f"got {getattr(self, name)!r}"
                )
        for name in ("prefill_kv", "decode_kv"):
            if getattr(self, name) not in KV_CACHE_FORMATS:
                raise ConfigError(
                    f"{name.replace('_', '-')} must be one of {', '.join(KV_CACHE_FORMATS)}, "
                    f"got {getattr(self, name)!r}"
                )
        if not handoff_allowed(self.prefill_kv, self.decode_kv):
            raise ConfigError(
                f"prefill-kv {self.prefill_kv} cannot hand off to decode-kv {self.decode_kv}: 1-byte "
                "pages never widen to bf16 nor change to the other 1-byte format (a second rounding); "
                f"use {self.prefill_kv} for both, or bf16 prefill KV"
            )

    def as_dict(self) -> dict[str, str]:
        return {
            "prefill_weights": self.prefill_weights,
            "prefill_kv": self.prefill_kv,
            "decode_weights": self.decode_weights,
            "decode_kv": self.decode_kv,
        }


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.I)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "kb": 1e3,
    "kib": 2**10,
    "m": 1e6,
    "mb": 1e6,
    "mib": 2**20,
    "g": 1e9,
    "gb": 1e9,
    "gib": 2**30,
    "t": 1e12,
    "tb": 1e12,
    "tib": 2**40,
}


def parse_bytes(text: str | int) -> int:
    """'512MiB' / '2GB' / 1048576 -> bytes."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(text)
    unit = (m.group(2) or "").lower() if m else None
    if not m or unit not in _UNITS:
        raise ConfigError(f"cannot read a byte size from {text!r} (e.g. 512MiB, 2GB)")
    return int(float(m.group(1)) * _UNITS[unit])


MAX_TENSOR_PARALLEL = 64
ITL_TARGET_AUTO = 0.0  # EngineConfig.itl_target_ms: derive the target from the device's decode step


@dataclass
class ParallelConfig:
    """One model replica over several ranks (torch.distributed): tensor parallelism for attention
    and dense MLPs, expert parallelism for routed experts (engine/parallel/group.py)."""

    tensor_parallel: int = 1  # ranks of the replica, all hosts together
    nodes: int = 1  # hosts of the replica, each running tensor_parallel / nodes ranks
    dist_addr: str | None = None  # rank 0's host (default: $MASTER_ADDR, $LWS_LEADER_ADDRESS, local)
    dist_port: int | None = None  # rank 0's rendezvous port (default: $MASTER_PORT, or a free port locally)
    dist_timeout: float = 60.0  # seconds a collective may take before the replica fails

    def validate(self) -> None:
        tp, n = self.tensor_parallel, self.nodes
        if not 1 <= tp <= MAX_TENSOR_PARALLEL:
            raise ConfigError(f"tensor parallel must be 1..{MAX_TENSOR_PARALLEL}, got {tp}")
        if n < 1 or n > tp or tp % n:
            raise ConfigError(f"nodes ({n}) must divide tensor parallel ({tp})")
        if not self.dist_timeout > 0:
            raise ConfigError(f"dist timeout must be > 0 seconds, got {self.dist_timeout}")
        if self.dist_port is not None and not 0 < self.dist_port < 65536:
            raise ConfigError(f"dist port must be 1..65535, got {self.dist_port}")


# FP8 KV scales: K per token and head (V static per head), static per head, or one static per tensor
# (int8 KV pages always scale K and V per token and head)
KV_SCALE_GRANULARITIES = ("per-token-k", "per-head", "per-tensor")
# The decode phase's LM head: auto (int8 where that holds it exactly on a CPU, else dense), or as named
DECODE_LM_HEADS = ("auto", "dense", "int8", "int4")


@dataclass
class EngineConfig:
    model: str = "builtin://smollm2-135m"
    dtype: str = "auto"  # float32 | bfloat16 | auto (bf16 on CUDA, float32 on CPU)
    device: str = "auto"
    page_size: int = 16
    kv_memory: int | None = None  # bytes for the KV pool(s); None -> kv_memory_fraction
    kv_memory_fraction: float = 0.9  # of free device memory after weights (CUDA); CPU default below
    cpu_kv_default: int = 1 << 30
    prefill_kv_fraction: float = 0.25  # of the KV budget for the prefill pool when its format differs
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    # the time-budgeted step (engine/step_budget.py): None off (steps sized by tokens alone),
    # ITL_TARGET_AUTO (0) a target derived from the device's decode step, > 0 a target in ms
    itl_target_ms: float | None = None
    min_prefill_tokens: int = (
        32  # the budget's floor (capped at max_num_batched_tokens): prompt tokens every prefill step may take
    )
    max_model_len: int | None = None  # None -> the model's context length
    chat_template: str | None = None  # a Jinja chat template file used instead of the model's
    # run a tokenizer that is custom code in the model directory (a trust decision: its Python runs
    # in the engine; models/tokenizer_code.py); off, such a model is refused naming --trust-remote-code
    trust_remote_code: bool = False
    enable_prefix_caching: bool = True
    formats: PhaseFormats = field(default_factory=PhaseFormats)
    integrity: str = "enforce"
    fault_injection: bool = False  # drills and tests only: exposes engine.faults (never via the API)
    # the quality drill (engine/corrupt_layer.py): this layer's output projections scaled at load
    corrupt_layer: int | None = None
    corrupt_scale: float = 1.0
    int4_group_size: int | None = None  # None: 128 where it divides K, else 64, else 32
    decode_lm_head: str = "auto"  # the decode phase's LM head (DECODE_LM_HEADS; int4 in groups of 32)
    compile: bool = False  # torch.compile the decode glue at load (models/step_ops.py)
    int4_compute: str = DEFAULT_INT4_COMPUTE  # CPU INT4 with float32 activations: float32 (exact) | bf16
    # a native kernel build that fails with a C compiler present falls back instead of failing
    allow_kernel_fallback: bool = False
    kv_scale_granularity: str = "per-token-k"  # FP8 KV scales (KV_SCALE_GRANULARITIES)
    role: str = "both"  # both | prefill | decode: which phases this worker runs
    kernel_backend: str | None = None  # None = dispatch by device; "reference" forces the torch references
    seed: int = 0
    parallel: ParallelConfig = field(default_factory=lambda: ParallelConfig())

    def chat_template_text(self) -> str:
        """The --chat-template file's text (ValueError naming the file when it cannot be read)."""
        assert self.chat_template is not None
        try:
            with open(self.chat_template, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise ValueError(f"--chat-template {self.chat_template}: {exc.strerror or exc}") from exc
        if not text.strip():
            raise ValueError(f"--chat-template {self.chat_template}: the file is empty")
        return text

    def validate(self) -> None:
        self.formats.validate()
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ConfigError(f"dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
        if self.integrity not in INTEGRITY_MODES:
            raise ConfigError(
                f"integrity must be one of {', '.join(INTEGRITY_MODES)}, got {self.integrity!r}"
            )
        if self.role not in ENGINE_ROLES:
            raise ConfigError(f"role must be one of {', '.join(ENGINE_ROLES)}, got {self.role!r}")
        if self.int4_compute not in INT4_COMPUTES:
            raise ConfigError(f"int4 compute must be {' or '.join(INT4_COMPUTES)}, got {self.int4_compute!r}")
        if self.decode_lm_head not in DECODE_LM_HEADS:
            raise ConfigError(
                f"decode LM head must be one of {', '.join(DECODE_LM_HEADS)}, got {self.decode_lm_head!r}"
            )
        if self.kv_scale_granularity not in KV_SCALE_GRANULARITIES:
            raise ConfigError(
                f"kv scale granularity must be one of {', '.join(KV_SCALE_GRANULARITIES)}, "
                f"got {self.kv_scale_granularity!r}"
            )
        if self.corrupt_layer is not None and not self.fault_injection:
            raise ConfigError("corrupting a layer is a drill: it needs fault injection enabled")
        if self.corrupt_layer is not None and (
            self.corrupt_layer < 0 or not 0 <= self.corrupt_scale < float("inf")
        ):
            raise ConfigError("the corrupted layer must be >= 0 and its scale a finite number >= 0")
        if self.int4_group_size is not None and self.int4_group_size not in (32, 64, 128, 256):
            raise ConfigError(f"int4 group size must be 32, 64, 128 or 256, got {self.int4_group_size}")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ConfigError(f"page_size must be a power of two, got {self.page_size}")
        if self.max_num_seqs < 1:
            raise ConfigError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < self.page_size:
            raise ConfigError("max_num_batched_tokens must be at least one page")
        if self.itl_target_ms is not None and not self.itl_target_ms >= 0:
            raise ConfigError(f"itl target must be auto or > 0 ms, got {self.itl_target_ms}")
        if self.min_prefill_tokens < 1:  # above max_num_batched_tokens it is capped there
            raise ConfigError(f"min_prefill_tokens must be at least 1, got {self.min_prefill_tokens}")
        if not 0.0 < self.kv_memory_fraction <= 1.0:
            raise ConfigError("kv_memory_fraction must be in (0, 1]")
        self.parallel.validate()
        if self.parallel.tensor_parallel > 1 and self.integrity == "audit":
            raise ConfigError(
                "integrity audit checksums pages on one rank only: use enforce (tag checks run on every "
                "rank) with --tensor-parallel > 1"
            )

    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self) -> torch.dtype:
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device().type == "cuda" else torch.float32
        return {"float32": torch.float32, "bfloat16": torch.bfloat16}[self.dtype]
