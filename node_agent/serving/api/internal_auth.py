"""The shared secret of the internal plane (router <-> prefill/decode workers <-> KV transport).

Where the token comes from, first found wins: ``--internal-token-file FILE``, then the file named by
``$PAGODA_INTERNAL_TOKEN_FILE``, then ``$PAGODA_INTERNAL_TOKEN`` itself. Surrounding whitespace is
stripped; a token shorter than ``MIN_TOKEN_CHARS`` is refused. Roles prefill, decode and router
refuse to start without one (role ``both`` has no internal plane).

The token itself never travels. Everything is an HMAC-SHA256 under a key derived from it, one key
per purpose (``derive``), so a proof of one kind can never stand in for another:

* HTTP requests to ``/internal/*`` carry ``X-Pagoda-Internal-Auth: v1 <unix_ts> <nonce> <mac>``
  where ``mac = HMAC(k_request, "v1\\n" METHOD "\\n" PATH "\\n" ts "\\n" nonce)`` (hex). It is checked
  before the body is read: missing -> 401, malformed, stale (``|now - ts| > WINDOW_S``), wrong or
  replayed (a nonce is accepted once within the window) -> 403. The MAC binds method and path, so a
  captured ``/internal/state`` proof cannot open ``/internal/prefill``.
* The decode worker's grant for a parked request: ``HMAC(k_grant, ticket "\\n" kv_address)``. The
  router forwards it with the ticket and address; the prefill worker verifies it before it computes
  or connects anything, so KV pages only go to an address a decode worker named for that ticket.
* The KV HEADER frame: ``HMAC(k_kv_header, header JSON bytes)`` (see kv_transport.py). The header
  names the ticket, and a ticket is single-use on the receiver, so a header cannot be replayed.

Every comparison is ``hmac.compare_digest`` (constant time).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path

from fastapi import Request
from fastapi.responses import JSONResponse

from pagoda.internal_proof import HEADER, SCHEME, derive, request_header, request_mac
from pagoda.node_agent.serving.api.errors import ApiError
from pagoda.node_agent.serving.api.metrics import ServeMetrics

TOKEN_FILE_ENV = "PAGODA_INTERNAL_TOKEN_FILE"
TOKEN_ENV = "PAGODA_INTERNAL_TOKEN"
MIN_TOKEN_CHARS = 16
WINDOW_S = 300.0  # accepted clock skew between router and workers, and a nonce's lifetime
MAX_NONCES = 200_000  # remembered nonces (only requests with a valid MAC add one)
MAC_BYTES = 32


class TokenError(ValueError):
    """No usable internal token."""


def load_token(token_file: str | None, env: Mapping[str, str] | None = None) -> str | None:
    """The token from the flag's file, ``$PAGODA_INTERNAL_TOKEN_FILE`` or ``$PAGODA_INTERNAL_TOKEN``;
    None when none is set. Raises TokenError on an unreadable file or a too-short token."""
    env = os.environ if env is None else env
    path = token_file or env.get(TOKEN_FILE_ENV)
    if path:
        try:
            token = Path(path).read_text().strip()
        except OSError as exc:
            raise TokenError(f"cannot read the internal token file {path}: {exc}") from exc
        where = f"file {path}"
    elif env.get(TOKEN_ENV):
        token, where = env[TOKEN_ENV].strip(), f"${TOKEN_ENV}"
    else:
        return None
    if len(token) < MIN_TOKEN_CHARS:
        raise TokenError(
            f"the internal token from {where} has {len(token)} characters; use {MIN_TOKEN_CHARS}+"
        )
    return token


def require_token(role: str, token_file: str | None, env: Mapping[str, str] | None = None) -> str:
    """The token a role with an internal plane must have; TokenError naming the three sources."""
    token = load_token(token_file, env)
    if token is None:
        raise TokenError(
            f"--role {role} needs the internal token shared by the router and its workers: pass "
            f"--internal-token-file FILE, or set ${TOKEN_FILE_ENV} (a file) or ${TOKEN_ENV} (the token)"
        )
    return token


class InternalAuth:
    """Signs and verifies internal-plane proofs with keys derived from one token."""

    def __init__(self, token: str, clock=time.time) -> None:
        self._request_key = derive(token, "request")
        self._grant_key = derive(token, "grant")
        self._kv_key = derive(token, "kv-header")
        self._clock = clock
        self._nonces: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ HTTP requests

    def _request_mac(self, method: str, path: str, ts: str, nonce: str) -> str:
        return request_mac(self._request_key, method, path, ts, nonce)

    def headers(self, method: str, path: str) -> dict[str, str]:
        """The header proving the token for one request (``path`` without the query string)."""
        return request_header(self._request_key, method, path, self._clock)

    def check(self, method: str, path: str, value: str | None) -> tuple[int, str, str] | None:
        """None when ``value`` proves the token for this request, else (status, reason, message)."""
        if not value:
            return 401, "missing", f"internal endpoint: the {HEADER} header is missing"
        parts = value.split(" ")
        if len(parts) != 4 or parts[0] != SCHEME or not parts[1].isdigit() or not 8 <= len(parts[2]) <= 64:
            return 403, "malformed", f"internal endpoint: the {HEADER} header is malformed"
        _, ts, nonce, mac = parts
        if not hmac.compare_digest(mac.encode(), self._request_mac(method, path, ts, nonce).encode()):
            return 403, "invalid", "internal endpoint: the internal token proof is wrong"
        now = self._clock()
        if abs(now - int(ts)) > WINDOW_S:
            return 403, "stale", f"internal endpoint: the proof is older than {WINDOW_S:.0f}s (clock skew?)"
        with self._lock:
            while self._nonces and (
                next(iter(self._nonces.values())) < now - WINDOW_S or len(self._nonces) >= MAX_NONCES
            ):
                self._nonces.popitem(last=False)
            if nonce in self._nonces:
                return 403, "replayed", "internal endpoint: this proof was already used"
            self._nonces[nonce] = float(ts)
        return None

    def refuse(self, request: Request, metrics: ServeMetrics) -> JSONResponse | None:
        """None when the request carries a valid proof; else the 401/403 answer (counted)."""
        bad = self.check(request.method, request.url.path, request.headers.get(HEADER))
        if bad is None:
            return None
        status, reason, message = bad
        metrics.auth_failures.labels(metrics.pool, "internal", reason).inc()
        code = "internal_auth_missing" if status == 401 else "internal_auth_invalid"
        err = ApiError(status, message, code=code, type_="authentication_error")
        return JSONResponse(err.body(), status_code=status)

    # ------------------------------------------------------------------ grants and KV headers

    def grant(self, ticket: str, kv_address: str) -> str:
        """The decode worker's grant: KV pages for ``ticket`` may go to ``kv_address``."""
        msg = f"{ticket}\n{kv_address}".encode()
        return hmac.new(self._grant_key, msg, hashlib.sha256).hexdigest()

    def check_grant(self, ticket: str, kv_address: str, grant: str) -> bool:
        return hmac.compare_digest(grant.encode(), self.grant(ticket, kv_address).encode())

    def kv_mac(self, header_json: bytes) -> bytes:
        """The MAC of a KV HEADER frame's JSON (``MAC_BYTES`` raw bytes)."""
        return hmac.new(self._kv_key, header_json, hashlib.sha256).digest()

    def check_kv_mac(self, header_json: bytes, mac: bytes) -> bool:
        return hmac.compare_digest(mac, self.kv_mac(header_json))


def auth_for_role(
    role: str, token_file: str | None, env: Mapping[str, str] | None = None
) -> InternalAuth | None:
    """The internal plane's signer/verifier of a ``pagoda serve`` role (None for role ``both``)."""
    if role == "both":
        return None
    return InternalAuth(require_token(role, token_file, env))
