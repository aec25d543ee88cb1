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

from pagoda.node_agent.kv import formats as kv_formats
from pagoda.node_agent.kv.finite import DEFAULT_MAX_ABS
from pagoda.node_agent.kv.formats import TOKEN_SCALE_BYTES
from pagoda.node_agent.kv.layout import LayoutError, check_page_set

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
    # (kv_format, page dtype name) pairs a prefill worker may send (kv/formats.py): "bf16" pages
    # follow the sender's compute dtype (bfloat16, or float32 with --dtype float32)
    formats: frozenset[tuple[str, str]] = field(default_factory=kv_formats.wire_pairs)
    frame_timeout_s: float = 10.0  # one frame must arrive within this
    handoff_deadline_s: float = 60.0  # the whole handoff must arrive within this
    max_handoffs: int = 8  # authenticated handoffs at once; more are answered "busy" at once
    # before a connection's HEADER MAC verifies it holds no handoff slot, ticket or page, and:
    auth_timeout_s: float = 5.0  # its HEADER frame must arrive and verify within this, or it is closed
    max_connections: int = 256  # open connections in all (authenticated or not); more are closed at once
    max_unauthenticated: int = 128  # connections still before their MAC; over it the oldest is closed
    max_unauthenticated_per_peer: int = 32  # ... from one peer address; over it its oldest is closed
    max_abs_value: float = DEFAULT_MAX_ABS  # floating page values beyond +-this are refused (finite.py)

    @classmethod
    def for_engine(cls, engine: Any, **kw: Any) -> KVLimits:
        """The limits of an LLMEngine's decode pool."""
        pool = engine.decode_pool
        return cls(
            num_layers=pool.num_layers,
            page_size=pool.page_size,
            component_shapes={c: tuple(s) for c, s in pool.replica_components.items()},
            vocab_size=engine.model_config.vocab_size,
            max_model_len=engine.max_model_len,
            generator_state_len=int(torch.Generator().get_state().numel()),
            free_pages=lambda: pool.num_free,
            formats=frozenset(
                f for f in kv_formats.wire_pairs() if kv_formats.handoff_allowed(f[0], pool.kv_format)
            ),
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
        elem = kv_formats.wire_dtype(dtype).itemsize
        per = sum(math.prod(self.page_shape(c)) for c in self.components) * elem
        per += sum(self.page_size * self.component_shapes[c][0] for c in page_scales) * TOKEN_SCALE_BYTES
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
        pages = max(self.page_bytes(dt, self.components if _scaled(f) else ()) for f, dt in self.formats) + 4
        return max(self.max_header_bytes, pages, self.scales_bytes, self.generator_state_len)


def _scaled(kv_format: str) -> bool:
    """Whether pages of ``kv_format`` may carry per-token scales (the largest PAGE frame has them)."""
    fmt = kv_formats.find(kv_format)
    return fmt is not None and fmt.token_scales != kv_formats.NO_TOKEN_SCALES


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
    static = header_static_scales(h, limits)
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


# how a header words the page-set rules of kv/layout.py (tests pin these texts)
_HEADER_RULES = {
    LayoutError.DTYPE: "KV header: kv_format/dtype {fmt}/{dtype} is not accepted",
    LayoutError.UNSCALED: "KV header: page_scales are for float8 and int8 pages only",
    LayoutError.EVERY: "KV header: {fmt} pages need page_scales for every component {comps}",
}


def header_static_scales(h: dict[str, Any], limits: KVLimits) -> list[str]:
    """The components whose scales the header's SCALES frame carries (after its page_scales are
    checked against the format's rules)."""
    page_scales = header_page_scales(h, limits)
    try:
        layout = check_page_set(h["kv_format"], h["dtype"], limits.components, page_scales)
    except LayoutError as exc:
        msg = _HEADER_RULES[exc.rule]
        raise HeaderError(
            msg.format(fmt=exc.format.name, dtype=h["dtype"], comps=limits.components)
        ) from None
    return list(layout.static_scaled)


def header_page_scales(h: dict[str, Any], limits: KVLimits) -> list[str]:
    """The header's ``page_scales`` (absent: none): distinct components of this model."""
    v = h.get("page_scales", [])
    if type(v) is not list or any(type(c) is not str for c in v) or len(set(v)) != len(v):
        raise HeaderError("KV header: page_scales must be a list of distinct component names")
    if not set(v) <= set(limits.components):
        raise HeaderError(f"KV header: page_scales must name components of {limits.components}")
    return [c for c in limits.components if c in v]


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a page dtype name on the wire (kv/formats.py)."""
    return kv_formats.wire_dtype(name)
