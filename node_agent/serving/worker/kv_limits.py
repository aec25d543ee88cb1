"""What a valid KV handoff looks like for one decode worker, and the check of a HEADER against it.

The decode worker builds ``KVLimits`` from its engine (model shape, vocabulary, context length,
page size, generator-state size, a callable giving its decode pool's free pages). The receiver
checks every header field, types included, before it allocates anything for the handoff: a JSON
``true``, a float, a string or a negative number where a count is expected is a refusal.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pagoda.vocabulary import handoff_allowed

# (kv_format, page dtype) pairs a prefill worker may send: "bf16" pages follow the prefill
# worker's compute dtype (bfloat16, or float32 with --dtype float32), "fp8_e4m3" pages carry scales
# (static or per token), "int8" pages per-token scales for every component
ALLOWED_FORMATS: frozenset[tuple[str, str]] = frozenset(
    {("bf16", "bfloat16"), ("bf16", "float32"), ("fp8_e4m3", "float8_e4m3fn"), ("int8", "int8")}
)
FP8 = "float8_e4m3fn"
INT8 = "int8"
_ELEM = {"bfloat16": 2, "float32": 4, "float8_e4m3fn": 1, "int8": 1}
_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "int8": torch.int8,
}
HEADER_KEYS = frozenset(
    {
        "ticket",
        "request_id",
        "prompt_token_ids",
        "first_token",
        "page_size",
        "kv_format",
        "num_pages",
        "num_layers",
        "components",
        "dtype",
        "page_shape",
        "has_scales",
        "scale_shape",
        "generator_state_len",
        "num_cached_tokens",
    }
)
# Optional: the components whose scales are per token (bfloat16 [page_size, heads] per page and
# layer, sent inside each PAGE frame after the values); absent or [] when every scale is static.
# int8 pages must name every component.
OPTIONAL_HEADER_KEYS = frozenset({"page_scales"})
PAGE_SCALE_ELEM = 2  # bfloat16
MAX_ID_CHARS = 256  # ticket and request id
HEADER_SLACK = 8192  # bytes of a header besides its token ids


class HeaderError(ValueError):
    """A KV HEADER that does not describe a handoff this worker can take."""


class NoRoom(HeaderError):
    """A valid header whose pages do not fit the decode pool now."""


@dataclass(frozen=True)
class KVLimits:
    """The shape of a valid handoff into one decode pool, and the receiver's time and size limits."""

    num_layers: int
    page_size: int
    component_shapes: dict[str, tuple[int, ...]]  # per token, e.g. {"k": (heads, dim), "v": ...}
    vocab_size: int
    max_model_len: int
    generator_state_len: int  # bytes of a torch CPU generator state
    free_pages: Callable[[], int] = field(compare=False)
    formats: frozenset[tuple[str, str]] = ALLOWED_FORMATS
    frame_timeout_s: float = 10.0  # one frame must arrive within this
    handoff_deadline_s: float = 60.0  # the whole handoff must arrive within this
    max_handoffs: int = 8  # concurrent connections; more are answered "busy" at once

    @classmethod
    def for_engine(cls, engine: Any, **kw: Any) -> KVLimits:
        """The limits of an LLMEngine's decode pool."""
        pool = engine.pool
        return cls(
            num_layers=pool.num_layers,
            page_size=pool.page_size,
            component_shapes={c: tuple(s) for c, s in pool.replica_components.items()},
            vocab_size=engine.model_config.vocab_size,
            max_model_len=engine.max_model_len,
            generator_state_len=int(torch.Generator().get_state().numel()),
            free_pages=lambda: pool.num_free,
            formats=frozenset(f for f in ALLOWED_FORMATS if handoff_allowed(f[0], pool.kv_format)),
            **kw,
        )

    @property
    def components(self) -> list[str]:
        return list(self.component_shapes)

    def page_shape(self, c: str) -> list[int]:
        return [self.page_size, *self.component_shapes[c]]

    def page_bytes(self, dtype: str, page_scales: list[str] | tuple[str, ...] = ()) -> int:
        """Bytes of one PAGE frame's data (every layer and component) in ``dtype``, with the
        per-token scales of the ``page_scales`` components."""
        per = sum(math.prod(self.page_shape(c)) for c in self.components) * _ELEM[dtype]
        per += sum(self.page_size * self.component_shapes[c][0] for c in page_scales) * PAGE_SCALE_ELEM
        return self.num_layers * per

    def page_scale_shape(self, c: str) -> list[int]:
        """One page's per-token scales of component ``c``: [page_size, heads]."""
        return [self.page_size, self.component_shapes[c][0]]

    def scale_shape(self, c: str) -> list[int]:
        return [self.component_shapes[c][0]]

    def static_scales_bytes(self, comps: list[str]) -> int:
        """The SCALES frame's size when ``comps`` take static float32 per-head scales."""
        return self.num_layers * sum(self.scale_shape(c)[0] for c in comps) * 4

    @property
    def scales_bytes(self) -> int:
        return self.static_scales_bytes(self.components)

    @property
    def max_header_bytes(self) -> int:
        """A header holds at most max_model_len token ids (``", "`` separated), the rest is small."""
        return HEADER_SLACK + self.max_model_len * (len(str(self.vocab_size)) + 2)

    @property
    def max_frame(self) -> int:
        pages = (
            max(self.page_bytes(dt, self.components if dt in (FP8, INT8) else ()) for _, dt in self.formats)
            + 4
        )
        return max(self.max_header_bytes, pages, self.scales_bytes, self.generator_state_len)


def _int(h: dict[str, Any], key: str, lo: int, hi: int) -> int:
    v = h[key]
    if type(v) is not int:
        raise HeaderError(f"KV header: {key} must be an integer, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise HeaderError(f"KV header: {key} {v} is outside [{lo}, {hi}]")
    return v


def _str(h: dict[str, Any], key: str, max_chars: int = MAX_ID_CHARS) -> str:
    v = h[key]
    if type(v) is not str or not 1 <= len(v) <= max_chars or not v.isprintable():
        raise HeaderError(f"KV header: {key} must be a printable string of 1..{max_chars} characters")
    return v


def _shape(v: Any, want: list[int], what: str) -> None:
    if type(v) is not list or len(v) != len(want) or any(type(x) is not int for x in v) or v != want:
        raise HeaderError(f"KV header: {what} must be {want}, got {str(v)[:80]}")


def check_header(h: Any, limits: KVLimits, available_pages: int) -> None:
    """Raise HeaderError unless ``h`` (the parsed HEADER JSON) is a handoff this pool can take now."""
    if type(h) is not dict:
        raise HeaderError("KV header must be a JSON object")
    keys = set(h) - OPTIONAL_HEADER_KEYS
    if keys != HEADER_KEYS:
        missing, extra = sorted(HEADER_KEYS - keys), sorted(keys - HEADER_KEYS)
        raise HeaderError(f"KV header fields: missing {missing[:5]}, unknown {[k[:40] for k in extra[:5]]}")
    _str(h, "ticket")
    _str(h, "request_id")
    ids = h["prompt_token_ids"]
    if type(ids) is not list or not 1 <= len(ids) < limits.max_model_len:
        raise HeaderError(f"KV header: prompt_token_ids must be a list of 1..{limits.max_model_len - 1} ids")
    vocab = limits.vocab_size
    for t in ids:
        if type(t) is not int or not 0 <= t < vocab:
            raise HeaderError(f"KV header: prompt token {str(t)[:40]} is not a token id of this model")
    _int(h, "first_token", 0, vocab - 1)
    _int(h, "page_size", limits.page_size, limits.page_size)
    _int(h, "num_layers", limits.num_layers, limits.num_layers)
    fmt, dtype = h["kv_format"], h["dtype"]
    if type(fmt) is not str or type(dtype) is not str or (fmt, dtype) not in limits.formats:
        raise HeaderError(f"KV header: kv_format/dtype {str(fmt)[:20]}/{str(dtype)[:20]} is not accepted")
    comps = h["components"]
    if comps != limits.components:
        raise HeaderError(f"KV header: components must be {limits.components}")
    shapes = h["page_shape"]
    if type(shapes) is not dict or set(shapes) != set(limits.components):
        raise HeaderError("KV header: page_shape must name every component")
    for c in limits.components:
        _shape(shapes[c], limits.page_shape(c), f"page_shape[{c}]")
    page_scales = header_page_scales(h, limits)
    if page_scales and dtype not in (FP8, INT8):
        raise HeaderError("KV header: page_scales are for float8 and int8 pages only")
    if dtype == INT8 and page_scales != limits.components:
        raise HeaderError(f"KV header: int8 pages need page_scales for every component {limits.components}")
    static = [c for c in limits.components if c not in page_scales] if dtype == FP8 else []
    has_scales = h["has_scales"]
    if type(has_scales) is not bool or has_scales != bool(static):
        raise HeaderError(
            "KV header: has_scales must be true exactly for float8 pages with a component not in page_scales"
        )
    sshape = h["scale_shape"]
    if type(sshape) is not dict or set(sshape) != set(static):
        raise HeaderError(
            "KV header: scale_shape must name every float8 component without page_scales, and no other"
        )
    for c in sshape:
        _shape(sshape[c], limits.scale_shape(c), f"scale_shape[{c}]")
    gen = h["generator_state_len"]
    if type(gen) is not int or gen not in (0, limits.generator_state_len):
        raise HeaderError(f"KV header: generator_state_len must be 0 or {limits.generator_state_len}")
    _int(h, "num_cached_tokens", 0, len(ids))
    need = -(-len(ids) // limits.page_size)
    n = _int(h, "num_pages", 1, -(-limits.max_model_len // limits.page_size))
    if n != need:
        raise HeaderError(f"KV header: {len(ids)} tokens need {need} pages, not {n}")
    if n > available_pages:
        raise NoRoom(f"KV header: {n} pages do not fit the {available_pages} free decode pages")


def header_page_scales(h: dict[str, Any], limits: KVLimits) -> list[str]:
    """The header's ``page_scales`` (absent: none): distinct components of this model."""
    v = h.get("page_scales", [])
    if type(v) is not list or any(type(c) is not str for c in v) or len(set(v)) != len(v):
        raise HeaderError("KV header: page_scales must be a list of distinct component names")
    if not set(v) <= set(limits.components):
        raise HeaderError(f"KV header: page_scales must name components of {limits.components}")
    return [c for c in limits.components if c in v]


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]
