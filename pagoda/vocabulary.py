"""The words the node agent, the CLI, the benches and the operator share, declared once.

Pure Python (no torch): the operator image imports it without the engine's dependencies.
"""

from __future__ import annotations

# Per-phase linear weight formats. ``stored``: every layer a checkpoint holds quantized (INT4 groups,
# FP8 blocks, ...) runs in its stored format, layers stored dense in the compute dtype.
STORED = "stored"
WEIGHT_FORMATS = ("bf16", "fp8", "int4", STORED)
# A phase's weights when none are asked for: ``stored`` for a checkpoint a producer released quantized
# (compressed-tensors, GPTQ, AWQ, FP8 blocks), PHASE_DEFAULTS otherwise (GGUF files included: an
# INT4 prefill from a Q4 GGUF would undo the FP8 prefill the phases are built on).
SOURCE_DEFAULT = "auto"
# What a weight format setting (the CLI flags, the CRD enum) may name: a format, or auto.
WEIGHT_FORMAT_CHOICES = (*WEIGHT_FORMATS, SOURCE_DEFAULT)
KV_CACHE_FORMATS = ("bf16", "fp8_e4m3", "int8")  # per-phase KV page formats
INTEGRITY_MODES = ("enforce", "audit", "off")
PHASES = ("prefill", "decode")  # also the operator's pool names
ENGINE_ROLES = ("both", "prefill", "decode")  # which phases one engine process runs
SERVE_ROLES = (*ENGINE_ROLES, "router")  # `pagoda serve --role`

# Default formats per phase: compute-bound prefill keeps precision, memory-bound decode packs.
PHASE_DEFAULTS = {
    "prefill": {"weights": "fp8", "kv": "bf16"},
    "decode": {"weights": "int4", "kv": "int8"},
}

# A prefill KV format may hand off to these decode KV formats (converted on arrival). 1-byte prefill
# pages never widen to a BF16 decode cache (that would store lossy values at twice the memory), nor
# move between the two 1-byte formats (a second rounding).
HANDOFFS = frozenset(
    {("bf16", "bf16"), ("bf16", "fp8_e4m3"), ("bf16", "int8"), ("fp8_e4m3", "fp8_e4m3"), ("int8", "int8")}
)

# Short spellings accepted on the command line for a KV format.
KV_FORMAT_ALIASES = {"fp8": "fp8_e4m3"}


def handoff_allowed(prefill_kv: str, decode_kv: str) -> bool:
    """True when prefill pages in ``prefill_kv`` may continue in a ``decode_kv`` decode pool."""
    return (prefill_kv, decode_kv) in HANDOFFS


# CPU INT4 compute with float32 activations (``--int4-compute``): "float32" runs the exact native
# kernel, "bf16" torch's faster int4pack op with bf16 rounding.
INT4_COMPUTES = ("float32", "bf16")
DEFAULT_INT4_COMPUTE = "float32"
