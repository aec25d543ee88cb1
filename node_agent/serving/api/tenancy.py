"""Tenant -> prefix-cache salt, derived on the server so tenants never share or probe prefixes.

Who the tenant is, in order:

1. ``--trust-tenant-header`` and the request carries the tenant header (``X-Pagoda-Tenant`` by
   default): the header names the tenant. Only for a server behind a gateway that sets it;
   with API keys too, the key authenticates the caller (the gateway) and the header names the
   tenant the gateway acts for.
2. API keys are configured: the tenant the caller's key belongs to (see auth.py).
3. ``--trust-tenant-header`` without keys and no header: one ``anonymous`` tenant.
4. Neither keys nor trust: single-tenant; every request is the one ``default`` tenant and the
   tenant header is ignored (a client cannot name a tenant it has not proved to be).

The salt is an HMAC of the tenant id under a server secret: a client cannot pick another
tenant's salt, and knowing a salt reveals nothing. Router replicas and workers that must agree
on salts get the same secret (``--tenant-secret``, ``--tenant-secret-file`` or
``$PAGODA_TENANT_SECRET``); without one it is random per process. One shared scope may be
configured; a request opts into it with ``X-Pagoda-Cache-Scope`` and then shares cached prefixes
with every other request of that scope (for a common system prompt), and with nobody else.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pagoda.node_agent.serving.api.errors import ApiError

DEFAULT_TENANT_HEADER = "x-pagoda-tenant"
SCOPE_HEADER = "x-pagoda-cache-scope"
ENV_SECRET = "PAGODA_TENANT_SECRET"
ANONYMOUS = "anonymous"
SINGLE_TENANT = "default"


def load_secret(secret: str | None, secret_file: str | None) -> bytes | None:
    """The salt secret: the flag, else the file's content (stripped), else ``$PAGODA_TENANT_SECRET``."""
    if secret and secret_file:
        raise ValueError("give --tenant-secret or --tenant-secret-file, not both")
    if secret:
        return secret.encode()
    if secret_file:
        try:
            raw = Path(secret_file).read_bytes().strip()
        except OSError as exc:
            raise ValueError(f"cannot read the tenant secret file {secret_file}: {exc.strerror}") from exc
        if not raw:
            raise ValueError(f"the tenant secret file {secret_file} is empty")
        return raw
    env = os.environ.get(ENV_SECRET)
    return env.encode() if env else None


@dataclass
class TenantPolicy:
    """How requests map to cache salts."""

    secret: bytes
    header: str = DEFAULT_TENANT_HEADER
    shared_scope: str | None = None  # the one scope tenants may opt into, or None
    trust_header: bool = False  # the tenant header is set by a trusted gateway
    keyed: bool = False  # callers authenticate with API keys (their tenant comes from the key)

    @classmethod
    def from_settings(
        cls,
        header: str | None,
        secret: str | None,
        shared_scope: str | None,
        *,
        secret_file: str | None = None,
        trust_header: bool = False,
        keyed: bool = False,
    ) -> TenantPolicy:
        """Secret from the flag, the file or ``$PAGODA_TENANT_SECRET``, else random per process."""
        key = load_secret(secret, secret_file) or os.urandom(32)
        hdr = (header or DEFAULT_TENANT_HEADER).lower()
        return cls(key, hdr, shared_scope or None, trust_header, keyed)

    @property
    def single_tenant(self) -> bool:
        return not self.trust_header and not self.keyed

    def describe(self) -> str:
        """One line on how tenants are told apart (logged at startup)."""
        if self.single_tenant:
            return (
                "single-tenant: no --api-keys and no --trust-tenant-header, so every request shares "
                f"one prefix-cache tenant and the {self.header} header is ignored"
            )
        parts = []
        if self.keyed:
            parts.append("the tenant of the caller's API key")
        if self.trust_header:
            parts.insert(0, f"the trusted {self.header} header when present")
        return "multi-tenant: the cache tenant is " + ", else ".join(parts)

    def tenant(self, headers: Mapping[str, str], authenticated: str | None = None) -> str:
        """The tenant id of a request; ``authenticated`` is the tenant of its API key, if any."""
        if self.trust_header:
            value = headers.get(self.header, "").strip()
            if self.header == "authorization" and value.lower().startswith("bearer "):
                value = value[7:].strip()
            if value:
                return value
        if self.keyed:
            if authenticated is None:  # the auth layer refuses such requests before we get here
                raise ApiError(401, "missing API key", code="missing_api_key")
            return authenticated
        return ANONYMOUS if self.trust_header else SINGLE_TENANT

    def salt(self, headers: Mapping[str, str], authenticated: str | None = None) -> str:
        """The cache salt of a request; a bad scope request is answered 400."""
        scope = headers.get(SCOPE_HEADER, "").strip()
        if scope:
            if self.shared_scope is None or scope != self.shared_scope:
                raise ApiError(
                    400,
                    f"{SCOPE_HEADER}: unknown cache scope {scope!r}",
                    param=SCOPE_HEADER,
                    code="bad_scope",
                )
            return self._mac("scope", scope)
        return self._mac("tenant", self.tenant(headers, authenticated))

    def _mac(self, kind: str, ident: str) -> str:
        data = f"{kind}\0{ident}".encode("utf-8", "surrogateescape")
        return hmac.new(self.secret, data, hashlib.sha256).hexdigest()[:32]
