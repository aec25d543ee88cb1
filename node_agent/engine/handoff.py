"""Moving a sequence's KV pages between pools: the in-process prefill->decode migration and the
payload a prefill worker hands to a decode worker (the wire framing lives in kv_transport.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pagoda.kernels.fp8_format import TOKEN_SCALE_DTYPE
from pagoda.node_agent.engine.sequence import Sequence
from pagoda.node_agent.kv import formats
from pagoda.node_agent.kv.layout import LayoutError, PageLayout, check_page_set
from pagoda.node_agent.kv.pool import KVPagePool, PageRef, is_page_scale_key, page_scale_key
from pagoda.node_agent.kv.storage import component_of
from pagoda.node_agent.params import PROMPT, RequestError, SamplingParams, is_int


@dataclass
class KVPayload:
    """A prefilled sequence: its tokens, first sampled token and KV pages in the sender's format."""

    request_id: str
    prompt_token_ids: list[int]
    first_token: int
    page_size: int
    kv_format: str
    # per layer {component: [n, page, H, D]} on the CPU: "k"/"v", or MLA's "latent"/"rope_k"; FP8
    # components with per-token scales carry them as pages too: "k.scale" [n, page, H] bfloat16
    layers: list[dict[str, torch.Tensor]]
    scales: list[dict[str, torch.Tensor]] | None = None  # FP8 static per-head scales of the sender
    generator_state: torch.Tensor | None = None  # seeded sampling continues where it stopped
    num_cached_tokens: int = 0
    meta: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        """Tokens whose KV the pages hold (the prompt; the first token has no KV yet)."""
        return len(self.prompt_token_ids)

    @property
    def num_pages(self) -> int:
        """Pages the payload holds per layer (as sent; check_payload checks it against the tokens)."""
        return next(iter(self.layers[0].values())).shape[0] if self.layers and self.layers[0] else 0


def extract_pages(
    pool: KVPagePool, refs: list[PageRef]
) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]] | None]:
    """Copy the pages' contents (every layer, per-token scales included) out of a pool, to the CPU."""
    idx = torch.tensor([r.page for r in refs], dtype=torch.long, device=pool.device)
    return PageLayout.of_pool(pool).select(pool.layers, pool.static_scales, idx)


def convert_into(
    dst: KVPagePool,
    dst_refs: list[PageRef],
    src_layers: list[dict[str, torch.Tensor]],
    src_scales: list[dict[str, torch.Tensor]] | None,
    src_idx: torch.Tensor | None = None,
    backend: str | None = None,
) -> None:
    """Write source pages (any KV format and scale granularity) into ``dst_refs``, converting to the
    destination's format and scales (per-token scale rows travel with their pages)."""
    dst_idx = torch.tensor([r.page for r in dst_refs], dtype=torch.long, device=dst.device)
    idx = src_idx if src_idx is not None else torch.arange(len(dst_refs), device=dst.device)
    src = PageLayout.of_pages(src_layers, src_scales)
    for li, (d, s) in enumerate(zip(dst.layers, src_layers, strict=True)):
        ss = src_scales[li] if src.static_scaled else {}
        ds = dst.layer_scales(li)
        for c in PageLayout.of_pool(dst).components:  # K and V, or an MLA latent and rope key
            s_scale = s[page_scale_key(c)] if c in src.page_scaled else ss.get(c)
            dst.format.convert(
                s[c].to(dst.device), d[c], idx, dst_idx, ds.get(c), _dev(s_scale, dst.device), backend
            )


def migrate(
    src: KVPagePool,
    dst: KVPagePool,
    refs: list[PageRef],
    backend: str | None = None,
    mirror: Callable[[KVPagePool, KVPagePool, list[PageRef], list[PageRef]], None] | None = None,
) -> list[PageRef]:
    """Move pages from one pool to another (fresh tagged pages, converted); raises OutOfPages.
    ``mirror(src, dst, refs, dst_refs)``: the other tensor-parallel ranks copy their heads too."""
    dst_refs = dst.allocate_pages(len(refs))
    try:
        src_idx = torch.tensor([r.page for r in refs], dtype=torch.long, device=src.device)
        convert_into(dst, dst_refs, src.layers, src.static_scales, src_idx, backend)
        if mirror is not None:
            mirror(src, dst, refs, dst_refs)
    except BaseException:
        dst.release_all(dst_refs)  # the source pages stay the sequence's
        raise
    src.release_all(refs)
    return dst_refs


def _dev(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if t is None else t.to(device)


def payload_of(
    seq: Sequence,
    pool: KVPagePool,
    meta_of: Callable[[list[dict[str, torch.Tensor]]], dict],
    extract: Callable = extract_pages,
) -> KVPayload:
    """The handoff of a prefilled sequence: its pages (copied out of ``pool`` by ``extract``: every
    rank's heads under tensor parallelism), sampling state and ``meta_of(pages)`` (the integrity
    tracker's per-page metadata)."""
    layers, scales = extract(pool, seq.block_table)
    gen = seq.generator.get_state() if seq.generator is not None else None
    return KVPayload(
        seq.request_id,
        list(seq.prompt_token_ids),
        seq.output_token_ids[0],
        pool.page_size,
        pool.kv_format,
        layers,
        scales,
        gen,
        seq.num_cached_tokens,
        meta=meta_of(layers),
    )


MAX_REQUEST_ID_CHARS = 256
# Sequences sample with a CPU generator on every device (sequence.py): its state is what a payload carries.
GENERATOR_STATE_BYTES = int(torch.Generator().get_state().numel())


def check_request_id(rid: object, what: str = "request id", param: str | None = PROMPT) -> str:
    """A non-empty printable string of at most MAX_REQUEST_ID_CHARS characters; raises RequestError
    (about ``param``)."""
    if not isinstance(rid, str) or not rid or len(rid) > MAX_REQUEST_ID_CHARS or not rid.isprintable():
        shown = repr(rid) if isinstance(rid, str) and len(rid) <= 64 else type(rid).__name__
        raise RequestError(
            f"{what} must be a printable string of 1..{MAX_REQUEST_ID_CHARS} characters, got {shown}", param
        )
    return rid


def check_payload(payload: KVPayload, pool: KVPagePool, vocab_size: int, max_model_len: int) -> int:
    """Raise RequestError (naming the field) unless ``payload`` can go into ``pool`` as it is: every
    field, tensor dtype and shape is checked before anything is allocated. Returns its page count.
    (int8 pages need per-token scales for every component.)

    Accepted pages: a ``kv_format`` that may hand off to the pool's (vocabulary.HANDOFFS); per layer
    exactly the pool's components, each a dense ``[num_pages, page_size, *shape]`` tensor on the CPU
    or the pool's device, all in one wire dtype of that format (kv/formats.py); FP8 pages come with
    scales per layer and component: finite positive float32 ``[heads]`` in ``scales``, or finite
    non-negative bfloat16 per-token scales ``[num_pages, page_size, heads]`` beside the pages
    (``layers[l]["k.scale"]``); others with none.
    ``generator_state`` is None or a CPU generator's state (GENERATOR_STATE_BYTES uint8 values that
    a scratch CPU generator accepts): sequences sample with CPU generators on every device."""
    if not isinstance(payload, KVPayload):
        raise RequestError(f"KV payload must be a KVPayload, got {type(payload).__name__}")
    check_request_id(payload.request_id, "KV payload request_id", None)
    ids = payload.prompt_token_ids
    if not isinstance(ids, list) or not ids:
        raise RequestError("KV payload prompt_token_ids must be a non-empty list of token ids", PROMPT)
    if not all(is_int(t) and 0 <= t < vocab_size for t in ids):
        bad = [t for t in ids if not (is_int(t) and 0 <= t < vocab_size)][:5]
        raise RequestError(
            f"KV payload prompt_token_ids: ids must be integers in [0, {vocab_size}), got {bad}", PROMPT
        )
    tok = payload.first_token
    if not is_int(tok) or not 0 <= tok < vocab_size:
        raise RequestError(f"KV payload first_token must be an integer in [0, {vocab_size}), got {tok!r}")
    if len(ids) + 1 > max_model_len:
        raise RequestError(
            f"KV payload prompt_token_ids: {len(ids)} tokens + the first token exceed the model length "
            f"{max_model_len}",
            PROMPT,
        )
    cached = payload.num_cached_tokens
    if not is_int(cached) or not 0 <= cached <= len(ids):
        raise RequestError(
            f"KV payload num_cached_tokens must be an integer in [0, {len(ids)}], got {cached!r}"
        )
    ps = pool.page_size
    if not is_int(payload.page_size) or payload.page_size != ps:
        raise RequestError(f"KV payload page_size {payload.page_size!r} != this worker's {ps}")
    num_pages = -(-len(ids) // ps)
    dtype = _check_layers(payload, pool, num_pages)
    static = _check_page_scales(payload, pool, num_pages, dtype)
    _check_scales(payload.scales, pool, static)
    _check_generator_state(payload.generator_state)
    meta = payload.meta
    if not isinstance(meta, dict):
        raise RequestError(f"KV payload meta must be a dict, got {type(meta).__name__}")
    sums = meta.get("page_checksums")
    if sums is not None and (not isinstance(sums, list) or not all(is_int(c) for c in sums)):
        raise RequestError("KV payload meta.page_checksums must be a list of integers")
    return num_pages


def _check_layers(payload: KVPayload, pool: KVPagePool, num_pages: int) -> torch.dtype:
    """Layer count, component names, dtypes and shapes of the pages; returns their (single) dtype."""
    fmt = payload.kv_format
    if not isinstance(fmt, str) or fmt not in formats.names(wire=True):
        raise RequestError(
            f"KV payload kv_format must be one of {sorted(formats.names(wire=True))}, got {fmt!r}"
        )
    if not formats.handoff_allowed(fmt, pool.kv_format):
        raise RequestError(
            f"KV payload kv_format {fmt!r} cannot hand off to this worker's {pool.kv_format!r}"
        )
    layers = payload.layers
    if not isinstance(layers, list) or len(layers) != pool.num_layers:
        n = len(layers) if isinstance(layers, list) else type(layers).__name__
        raise RequestError(f"KV payload layers: {n} layers, this model has {pool.num_layers}")
    names = set(pool.replica_components)
    dtype: torch.dtype | None = None
    for li, layer in enumerate(layers):
        comps = {c for c in layer if not is_page_scale_key(c)} if isinstance(layer, dict) else None
        if comps != names:
            got = sorted(map(str, layer)) if isinstance(layer, dict) else type(layer).__name__
            raise RequestError(f"KV payload layers[{li}]: components {got}, expected {sorted(names)}")
        for c in sorted(comps):
            t = layer[c]
            where = f"KV payload layers[{li}][{c!r}]"
            _check_tensor(t, where, pool)
            want = (num_pages, pool.page_size, *pool.replica_components[c])
            if tuple(t.shape) != want:
                raise RequestError(f"{where}: shape {tuple(t.shape)}, expected {want} for {num_pages} pages")
            if t.dtype not in formats.get(fmt).wire_dtypes or (dtype is not None and t.dtype != dtype):
                raise RequestError(f"{where}: dtype {t.dtype} does not match kv_format {fmt!r}")
            dtype = t.dtype
    assert dtype is not None  # a pool has at least one layer and component
    return dtype


def _check_tensor(t: object, where: str, pool: KVPagePool) -> None:
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
        raise RequestError(f"{where} must be a dense tensor, got {type(t).__name__}")
    if t.device.type not in ("cpu", pool.device.type):
        raise RequestError(f"{where}: tensor on {t.device}, expected the CPU or {pool.device.type}")


# how a payload words the page-set rules of kv/layout.py (tests pin these texts)
_PAYLOAD_RULES = {
    LayoutError.DTYPE: "KV payload layers: dtype {dtype} does not match kv_format {fmt!r}",
    LayoutError.UNSCALED: "KV payload layers: per-token scales present, but the pages are not FP8 or int8",
    LayoutError.EVERY: "KV payload layers[0]: {fmt} pages need per-token scales for every component "
    "({comps}), got {got}",
}


def _check_page_scales(payload: KVPayload, pool: KVPagePool, num_pages: int, dtype: torch.dtype) -> list[str]:
    """Per-token scales beside FP8 or int8 pages: the same components in every layer (all of them
    for int8), each bfloat16 ``[num_pages, page_size, heads]``, finite and non-negative. Returns the
    components that need static scales instead (FP8 components without page scales; none for
    other pages)."""
    first = {c for c in payload.layers[0] if is_page_scale_key(c)}
    try:
        layout = check_page_set(
            payload.kv_format, dtype, list(pool.replica_components), [component_of(k) for k in first]
        )
    except LayoutError as exc:
        raise RequestError(
            _PAYLOAD_RULES[exc.rule].format(
                fmt=exc.format.name,
                dtype=dtype,
                comps=sorted(pool.replica_components),
                got=sorted(map(str, first))[:4],
            )
        ) from None
    for li, layer in enumerate(payload.layers):
        keys = {c for c in layer if is_page_scale_key(c)}
        if keys != first or not keys <= {page_scale_key(c) for c in pool.replica_components}:
            raise RequestError(
                f"KV payload layers[{li}]: per-token scales {sorted(map(str, keys))[:4]} must be "
                f"the same in every layer, for components of {sorted(pool.replica_components)}"
            )
        for key in sorted(keys):
            t = layer[key]
            where = f"KV payload layers[{li}][{key!r}]"
            _check_tensor(t, where, pool)
            want = (num_pages, pool.page_size, pool.replica_components[component_of(key)][0])
            if t.dtype != TOKEN_SCALE_DTYPE or tuple(t.shape) != want:
                raise RequestError(
                    f"{where}: {t.dtype} {tuple(t.shape)}, expected {TOKEN_SCALE_DTYPE} {want}"
                )
            if not bool(torch.isfinite(t).all()) or bool((t < 0).any()):
                raise RequestError(f"{where}: per-token scales must be finite and non-negative")
    return list(layout.static_scaled)


def _check_scales(scales: object, pool: KVPagePool, static: list[str]) -> None:
    """The FP8 components without per-token scales carry finite positive float32 per-head scales per
    layer; when there are none (non-FP8 pages, or every component per token) ``scales`` is None."""
    if not static:
        if scales is not None:
            raise RequestError("KV payload scales: present, but no FP8 component takes static scales")
        return
    if not isinstance(scales, list) or len(scales) != pool.num_layers:
        raise RequestError(f"KV payload scales: FP8 pages need per-head scales for {pool.num_layers} layers")
    for li, layer in enumerate(scales):
        if not isinstance(layer, dict) or set(layer) != set(static):
            raise RequestError(f"KV payload scales[{li}]: components do not match {sorted(static)}")
        for c, t in layer.items():
            where = f"KV payload scales[{li}][{c!r}]"
            _check_tensor(t, where, pool)
            want = (pool.replica_components[c][0],)
            if t.dtype != torch.float32 or tuple(t.shape) != want:
                raise RequestError(f"{where}: {t.dtype} {tuple(t.shape)}, expected torch.float32 {want}")
            if not bool(torch.isfinite(t).all()) or not bool((t > 0).all()):
                raise RequestError(f"{where}: scales must be finite and positive")


def _check_generator_state(state: object) -> None:
    """None, or a CPU generator's state that a fresh CPU generator accepts."""
    if state is None:
        return
    if (
        not isinstance(state, torch.Tensor)
        or state.layout != torch.strided
        or state.device.type != "cpu"
        or state.dtype != torch.uint8
        or tuple(state.shape) != (GENERATOR_STATE_BYTES,)
    ):
        desc = (
            f"{state.dtype} {tuple(state.shape)} on {state.device}"
            if isinstance(state, torch.Tensor)
            else type(state).__name__
        )
        raise RequestError(
            f"KV payload generator_state must be a CPU torch.uint8 tensor of {GENERATOR_STATE_BYTES} "
            f"bytes (a CPU generator's state), got {desc}"
        )
    try:
        torch.Generator().set_state(state)  # the content too: a scratch generator, nothing allocated
    except (RuntimeError, ValueError) as exc:
        raise RequestError(f"KV payload generator_state is not a valid generator state: {exc}") from exc


def receive(
    payload: KVPayload,
    pool: KVPagePool,
    params: SamplingParams,
    request_id: str,
    backend: str | None = None,
    write: Callable | None = None,
) -> Sequence:
    """A decoding Sequence whose prompt KV is the payload's, in fresh tagged pages of ``pool``
    (converted to its format; ``write(pool, refs, layers, scales)`` instead spreads the heads over
    the tensor-parallel ranks). Call check_payload first. Raises OutOfPages when the pool cannot hold
    it; on any error the pages it took are released before the exception propagates."""
    refs = pool.allocate_pages(-(-payload.num_tokens // pool.page_size))
    try:
        if write is not None:
            write(pool, refs, payload.layers, payload.scales)
        else:
            convert_into(pool, refs, payload.layers, payload.scales, backend=backend)
        seq = Sequence(request_id, payload.prompt_token_ids, params)
        if payload.generator_state is not None and seq.generator is not None:
            seq.generator.set_state(payload.generator_state)
    except BaseException:
        pool.release_all(refs)
        raise
    seq.output_token_ids = [payload.first_token]
    seq.block_table = refs
    seq.pool_name = pool.name
    seq.num_computed_tokens = payload.num_tokens
    seq.num_cached_tokens = payload.num_cached_tokens
    return seq
