"""Moving a sequence's KV pages between pools: the in-process prefill->decode migration and the
payload a prefill worker hands to a decode worker (the wire framing lives in kv_transport.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pagoda.kernels.paged_attention import convert_pages
from pagoda.node_agent.engine.kv_pool import KVPagePool, PageRef
from pagoda.node_agent.engine.sequence import RequestError, SamplingParams, Sequence


@dataclass
class KVPayload:
    """A prefilled sequence: its tokens, first sampled token and KV pages in the sender's format."""

    request_id: str
    prompt_token_ids: list[int]
    first_token: int
    page_size: int
    kv_format: str
    layers: list[dict[str, torch.Tensor]]  # per layer {"k": [n, page, H, D], "v": ...} on the CPU
    scales: list[dict[str, torch.Tensor]] | None = None  # FP8 per-head scales of the sender
    generator_state: torch.Tensor | None = None  # seeded sampling continues where it stopped
    num_cached_tokens: int = 0
    meta: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        """Tokens whose KV the pages hold (the prompt; the first token has no KV yet)."""
        return len(self.prompt_token_ids)

    @property
    def num_pages(self) -> int:
        return self.layers[0]["k"].shape[0] if self.layers else 0


def extract_pages(
    pool: KVPagePool, refs: list[PageRef]
) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]] | None]:
    """Copy the pages' contents (every layer) out of a pool, to the CPU."""
    idx = torch.tensor([r.page for r in refs], dtype=torch.long, device=pool.device)
    layers = [{c: t[idx].cpu() for c, t in layer.items()} for layer in pool.layers]
    scales = (
        [{c: s.cpu().clone() for c, s in layer.items()} for layer in pool.scales] if pool.scales else None
    )
    return layers, scales


def convert_into(
    dst: KVPagePool,
    dst_refs: list[PageRef],
    src_layers: list[dict[str, torch.Tensor]],
    src_scales: list[dict[str, torch.Tensor]] | None,
    src_idx: torch.Tensor | None = None,
    backend: str | None = None,
) -> None:
    """Write source pages (any KV format) into ``dst_refs``, converting to the destination format."""
    dst_idx = torch.tensor([r.page for r in dst_refs], dtype=torch.long, device=dst.device)
    for li, (d, s) in enumerate(zip(dst.layers, src_layers, strict=True)):
        sk, sv = s["k"].to(dst.device), s["v"].to(dst.device)
        idx = src_idx if src_idx is not None else torch.arange(len(dst_refs), device=dst.device)
        ss = src_scales[li] if src_scales else {}
        ds = dst.scales[li] if dst.scales else {}
        convert_pages(
            sk,
            sv,
            d["k"],
            d["v"],
            idx,
            dst_idx,
            ds.get("k"),
            ds.get("v"),
            _dev(ss.get("k"), dst.device),
            _dev(ss.get("v"), dst.device),
            backend=backend,
        )


def migrate(
    src: KVPagePool, dst: KVPagePool, refs: list[PageRef], backend: str | None = None
) -> list[PageRef]:
    """Move pages from one pool to another (fresh tagged pages, converted); raises OutOfPages."""
    dst_refs = dst.allocate_pages(len(refs))
    src_idx = torch.tensor([r.page for r in refs], dtype=torch.long, device=src.device)
    convert_into(dst, dst_refs, src.layers, src.scales, src_idx, backend)
    src.release_all(refs)
    return dst_refs


def _dev(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if t is None else t.to(device)


def payload_of(
    seq: Sequence, pool: KVPagePool, meta_of: Callable[[list[dict[str, torch.Tensor]]], dict]
) -> KVPayload:
    """The handoff of a prefilled sequence: its pages (copied out of ``pool``), sampling state and
    ``meta_of(pages)`` (the integrity tracker's per-page metadata)."""
    layers, scales = extract_pages(pool, seq.block_table)
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


def check_payload(payload: KVPayload, pool: KVPagePool) -> None:
    """Raise RequestError when a payload's page size or shape cannot go into ``pool``."""
    ps = pool.page_size
    if payload.page_size != ps:
        raise RequestError(f"KV payload page size {payload.page_size} != this worker's {ps}")
    if payload.num_pages != -(-payload.num_tokens // ps) or len(payload.layers) != len(pool.layers):
        raise RequestError("KV payload shape does not match its token count or this model")


def receive(
    payload: KVPayload, pool: KVPagePool, params: SamplingParams, request_id: str, backend: str | None = None
) -> Sequence:
    """A decoding Sequence whose prompt KV is the payload's, in fresh tagged pages of ``pool``
    (converted to its format); raises OutOfPages when the pool cannot hold it."""
    refs = pool.allocate_pages(payload.num_pages)
    convert_into(pool, refs, payload.layers, payload.scales, backend=backend)
    seq = Sequence(request_id, payload.prompt_token_ids, params)
    if payload.generator_state is not None and seq.generator is not None:
        seq.generator.set_state(payload.generator_state)
    seq.output_token_ids = [payload.first_token]
    seq.block_table = refs
    seq.pool_name = pool.name
    seq.num_computed_tokens = payload.num_tokens
    seq.num_cached_tokens = payload.num_cached_tokens
    return seq
