"""Rendezvous (highest-random-weight) hashing: every router replica maps a key to the same member.

Each member gets a score ``hash(key, member)``; the member with the highest score wins. Two routers
that see the same members pick the same one without talking to each other, and a member that
leaves moves only the keys it had won (each to its runner-up); the other keys stay where they were.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def score(key: str, member: str) -> int:
    """The member's weight for ``key``: 64 bits of BLAKE2b over both (length-prefixed, so no two
    different pairs hash the same bytes)."""
    k, m = key.encode(), member.encode()
    data = len(k).to_bytes(4, "big") + k + m
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, person=b"pagoda-hrw").digest(), "big")


def pick(key: str, members: Sequence[T], name: Callable[[T], str]) -> T:
    """The member with the highest score for ``key`` (a tie, vanishingly rare, goes to the greater
    name, so the choice never depends on the members' order)."""
    if not members:
        raise ValueError("rendezvous pick over no members")
    return max(members, key=lambda m: (score(key, name(m)), name(m)))
