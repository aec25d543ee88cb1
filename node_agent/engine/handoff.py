"""Moving a sequence's KV pages between pools: the in-process prefill->decode migration and the
payload a prefill worker hands to a decode worker (the wire framing lives in kv_transport.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagoda.kernels.paged_attention import convert_pages
from pagoda.node_agent.engine.kv_pool import KVPagePool, OutOfPages, PageRef


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


def allocate_pages(pool: KVPagePool, n: int) -> list[PageRef]:
    """n fresh pages, all or none."""
    refs: list[PageRef] = []
    try:
        for _ in range(n):
            refs.append(pool.allocate())
    except OutOfPages:
        pool.release_all(refs)
        raise
    return refs


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
    dst_refs = allocate_pages(dst, len(refs))
    src_idx = torch.tensor([r.page for r in refs], dtype=torch.long, device=src.device)
    convert_into(dst, dst_refs, src.layers, src.scales, src_idx, backend)
    src.release_all(refs)
    return dst_refs


def _dev(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if t is None else t.to(device)
