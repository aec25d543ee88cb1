"""Chained content hashes of full KV pages, salted per tenant so prefixes never cross tenants."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator


def root_hash(salt: str) -> bytes:
    """The chain's starting value: different for every cache salt (tenant)."""
    return hashlib.blake2b(b"pagoda-prefix:" + salt.encode(), digest_size=16).digest()


def page_hashes(
    token_ids: list[int], page_size: int, salt: str = "", parent: bytes | None = None
) -> Iterator[bytes]:
    """Yield one hash per full page: H(parent hash, the page's token ids), starting at ``parent``."""
    parent = root_hash(salt) if parent is None else parent
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(",".join(map(str, token_ids[start : start + page_size])).encode())
        parent = h.digest()
        yield parent
