"""The KV format registry: one entry per KV page format, the only place that knows what a format is.

An entry names the element dtype of the pages (None: the engine's compute dtype), the page dtypes
a sender may hold on the KV wire and in handoff payloads, which components carry per-token scales
(bfloat16 ``[num_pages, page_size, heads]`` beside the pages), whether the others take static
float32 per-head scales, the decode formats it may hand off to (from ``pagoda.vocabulary``), and
its hooks into the kernels. Pool, handoff, wire limits, tensor-parallel transfer, memory sizing and
the CLI ask it; adding a format is one ``register`` call plus the kernels that read its pages.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pagoda.kernels.fp8_format import FP8_DTYPE, TOKEN_SCALE_DTYPE, quantize_fp8, token_scales
from pagoda.kernels.int8_format import INT8_DTYPE, int8_token_scales, quantize_int8
from pagoda.kernels.paged_attention import convert_component_pages
from pagoda.vocabulary import HANDOFFS, KV_CACHE_FORMATS

# which components of a page carry per-token scales
NO_TOKEN_SCALES = "none"
EVERY_COMPONENT = "every"  # every component, whatever the pool's configuration
CONFIGURED = "configured"  # the components the pool's scale granularity names (e.g. per-token-k)
STATIC_SCALE_BYTES = 4  # float32 per layer, component and head
TOKEN_SCALE_BYTES = torch.empty((), dtype=TOKEN_SCALE_DTYPE).element_size()


@dataclass(frozen=True)
class KVFormat:
    """What a KV page format is: element and wire dtypes, scales, handoffs and kernel hooks."""

    name: str
    dtype: torch.dtype | None  # element dtype of the pages; None: the compute dtype
    wire_dtypes: tuple[torch.dtype, ...] = ()  # page dtypes accepted on the wire (): internal only
    token_scales: str = NO_TOKEN_SCALES  # NO_TOKEN_SCALES | EVERY_COMPONENT | CONFIGURED
    static_scales: bool = False  # components without per-token scales take static per-head scales
    handoffs: frozenset[str] = frozenset()  # decode KV formats these pages may continue in
    # kernel hooks: per-token scales of values [..., H, D] -> [..., H]; values and a broadcastable
    # scale -> elements; whole pages of one component copied into this format (paged_attention)
    scale_of: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, compare=False)
    quantize: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = field(default=None, compare=False)
    convert: Callable[..., None] = field(default=convert_component_pages, compare=False)

    @property
    def scaled(self) -> bool:
        """True when the pages dequantize with scales (per token or static)."""
        return self.token_scales != NO_TOKEN_SCALES or self.static_scales

    @property
    def wire_names(self) -> tuple[str, ...]:
        """The wire dtype names (torch's, without the ``torch.`` prefix)."""
        return tuple(dtype_name(d) for d in self.wire_dtypes)

    def storage_dtype(self, compute_dtype: torch.dtype) -> torch.dtype:
        return compute_dtype if self.dtype is None else self.dtype

    def element_bytes(self, compute_dtype: torch.dtype) -> int:
        return torch.empty((), dtype=self.storage_dtype(compute_dtype)).element_size()

    def token_scaled(self, components: dict[str, tuple[int, ...]], granularity: str) -> tuple[str, ...]:
        """The components whose scales are per token: every one, or (CONFIGURED) K under
        "per-token-k" (a GQA model's "k"; MLA's latent and rope key keep static scales), or none."""
        if self.token_scales == EVERY_COMPONENT:
            return tuple(components)
        if self.token_scales == CONFIGURED and granularity == "per-token-k" and "k" in components:
            return ("k",)
        return ()

    def check_token_scaled(
        self, components: dict[str, tuple[int, ...]], token_scaled: tuple[str, ...]
    ) -> None:
        """ValueError unless ``token_scaled`` is a valid per-token scale set for pages of this format."""
        if not set(token_scaled) <= set(components):
            raise ValueError(f"token_scaled {token_scaled} names no component of {sorted(components)}")
        if self.token_scales == EVERY_COMPONENT and set(token_scaled) != set(components):
            raise ValueError(
                f"{self.name} pages scale every component per token, got token_scaled {token_scaled}"
            )

    def handoff_to(self, decode_format: str) -> bool:
        return decode_format in self.handoffs


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float8_e4m3fn`` -> ``"float8_e4m3fn"``: the name the KV wire carries."""
    return str(dtype).removeprefix("torch.")


_REGISTRY: dict[str, KVFormat] = {}


def register(fmt: KVFormat) -> KVFormat:
    """Add a format (ValueError if its name is taken)."""
    if fmt.name in _REGISTRY:
        raise ValueError(f"KV format {fmt.name!r} is already registered")
    _REGISTRY[fmt.name] = fmt
    return fmt


def unregister(name: str) -> None:
    """Remove a format added by ``register`` (tests that add a throwaway one)."""
    _REGISTRY.pop(name, None)


def get(name: str) -> KVFormat:
    """The format called ``name``; ValueError naming the accepted ones otherwise."""
    fmt = _REGISTRY.get(name) if isinstance(name, str) else None
    if fmt is None:
        raise ValueError(f"unknown KV cache format {name!r}; accepted: {', '.join(KV_CACHE_FORMATS)}")
    return fmt


def find(name: object) -> KVFormat | None:
    """The format called ``name``, or None (no error)."""
    return _REGISTRY.get(name) if isinstance(name, str) else None


def names(wire: bool = False) -> tuple[str, ...]:
    """Every registered name (``wire``: only the formats a handoff may carry)."""
    return tuple(n for n, f in _REGISTRY.items() if f.wire_dtypes or not wire)


def by_dtype(dtype: torch.dtype) -> KVFormat | None:
    """The first registered format whose pages are stored in ``dtype`` (None: none is)."""
    return next((f for f in _REGISTRY.values() if f.dtype == dtype), None)


def for_pages(kv_format: str, dtype: torch.dtype) -> KVFormat:
    """The format whose rules pages of ``dtype`` labelled ``kv_format`` follow: that format when
    it stores ``dtype``, else the one registered for ``dtype`` (a scratch or test pool built from
    a dtype alone), else the unscaled compute-dtype format."""
    fmt = find(kv_format)
    if fmt is not None and fmt.dtype == dtype:
        return fmt
    return by_dtype(dtype) or (fmt if fmt is not None and fmt.dtype is None else get("bf16"))


def wire_dtype(name: str) -> torch.dtype:
    """The torch dtype of a wire dtype name some registered format accepts (KeyError otherwise)."""
    for f in _REGISTRY.values():
        for d in f.wire_dtypes:
            if dtype_name(d) == name:
                return d
    raise KeyError(name)


def wire_pairs() -> frozenset[tuple[str, str]]:
    """Every (kv_format, wire dtype name) pair a sender may announce."""
    return frozenset((f.name, d) for f in _REGISTRY.values() for d in f.wire_names)


def handoff_allowed(prefill_kv: str, decode_kv: str) -> bool:
    """True when pages of format ``prefill_kv`` may continue in a ``decode_kv`` pool."""
    fmt = find(prefill_kv)
    return fmt is not None and fmt.handoff_to(decode_kv)


def _vocabulary_handoffs(name: str) -> frozenset[str]:
    return frozenset(dst for src, dst in HANDOFFS if src == name)


def _builtins() -> None:
    register(KVFormat("bf16", None, (torch.bfloat16, torch.float32), handoffs=_vocabulary_handoffs("bf16")))
    register(
        KVFormat(
            "fp8_e4m3",
            FP8_DTYPE,
            (FP8_DTYPE,),
            CONFIGURED,
            static_scales=True,
            handoffs=_vocabulary_handoffs("fp8_e4m3"),
            scale_of=token_scales,
            quantize=quantize_fp8,
        )
    )
    register(
        KVFormat(
            "int8",
            INT8_DTYPE,
            (INT8_DTYPE,),
            EVERY_COMPONENT,
            handoffs=_vocabulary_handoffs("int8"),
            scale_of=int8_token_scales,
            quantize=quantize_int8,
        )
    )
    register(KVFormat("fp32", torch.float32))  # calibration scratch pools only: never on the wire


_builtins()
