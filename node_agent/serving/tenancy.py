"""Tenant -> prefix-cache salt, derived on the server so tenants never share or probe prefixes.

The tenant is read from a configured header (``X-Pagoda-Tenant`` by default, or e.g.
``Authorization`` so each API key is its own tenant). The salt is an HMAC of the tenant id under a
server secret: a client cannot pick another tenant's salt, and knowing a salt reveals nothing. One
shared scope may be configured explicitly; a request opts into it with ``X-Pagoda-Cache-Scope``
and then shares cached prefixes with every other request of that scope (for a common system
prompt), and with nobody else.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping
from dataclasses import dataclass

from pagoda.node_agent.serving.protocol import ApiError

DEFAULT_TENANT_HEADER = "x-pagoda-tenant"
SCOPE_HEADER = "x-pagoda-cache-scope"
ANONYMOUS = "anonymous"


@dataclass
class TenantPolicy:
    """How requests map to cache salts."""

    secret: bytes
    header: str = DEFAULT_TENANT_HEADER
    shared_scope: str | None = None  # the one scope tenants may opt into, or None

    @classmethod
    def from_settings(cls, header: str | None, secret: str | None, shared_scope: str | None) -> TenantPolicy:
        """Secret from the flag, else ``PAGODA_TENANT_SECRET``, else random per process."""
        raw = secret or os.environ.get("PAGODA_TENANT_SECRET")
        key = raw.encode() if raw else os.urandom(32)
        return cls(key, (header or DEFAULT_TENANT_HEADER).lower(), shared_scope or None)

    def tenant(self, headers: Mapping[str, str]) -> str:
        """The tenant id of a request (requests without the header form one anonymous tenant)."""
        value = headers.get(self.header, "").strip()
        if self.header == "authorization" and value.lower().startswith("bearer "):
            value = value[7:].strip()
        return value or ANONYMOUS

    def salt(self, headers: Mapping[str, str]) -> str:
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
        return self._mac("tenant", self.tenant(headers))

    def _mac(self, kind: str, ident: str) -> str:
        return hmac.new(self.secret, f"{kind}\0{ident}".encode(), hashlib.sha256).hexdigest()[:32]
