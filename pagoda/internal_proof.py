"""The pure-HMAC half of the internal plane's request proof, shared by the engine and the operator.

Torch-free and web-framework-free: the engine's verifier (``node_agent/serving/api/internal_auth.py``)
and the operator's quality gate (which calls ``/internal/score`` on engine pods) build the same
``X-Pagoda-Internal-Auth: v1 <unix_ts> <nonce> <mac>`` header from the shared token, where
``mac = HMAC(derive(token, "request"), "v1\\n" METHOD "\\n" PATH "\\n" ts "\\n" nonce)`` (hex).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Callable

HEADER = "X-Pagoda-Internal-Auth"
SCHEME = "v1"


def derive(token: str, purpose: str) -> bytes:
    """A key for one purpose ("request", "grant", "kv-header") from the shared token."""
    return hmac.new(token.encode(), b"pagoda-internal-v1:" + purpose.encode(), hashlib.sha256).digest()


def request_mac(key: bytes, method: str, path: str, ts: str, nonce: str) -> str:
    """The hex MAC binding one request's method, path (no query string), time and nonce."""
    msg = "\n".join((SCHEME, method.upper(), path, ts, nonce)).encode()
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def request_header(
    key: bytes, method: str, path: str, clock: Callable[[], float] = time.time
) -> dict[str, str]:
    """The header proving the token (``key = derive(token, "request")``) for one request."""
    ts, nonce = str(int(clock())), secrets.token_hex(12)
    return {HEADER: f"{SCHEME} {ts} {nonce} {request_mac(key, method, path, ts, nonce)}"}
