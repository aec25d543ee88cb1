"""API keys of the public API: who a caller is (its tenant), from ``Authorization: Bearer KEY``.

The keys file has one key per line, ``TENANT KEY`` or ``TENANT sha256:HEX`` (the hex SHA-256 of
the key, so the file need not hold the key itself); ``#`` starts a comment, blank lines are
skipped. A tenant may have several keys (rotation); one key may not belong to two tenants. Only
SHA-256 digests are kept in memory and a lookup compares the digest of the presented key with
every known digest in constant time. The file is re-read when its content changes (checked at
most every ``check_every_s`` seconds, on lookup): a bad new file is logged and the old keys stay
in force. No message or log line ever contains a key, only file names and line numbers.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("pagoda.auth")

ENV_KEYS_FILE = "PAGODA_API_KEYS_FILE"
CHECK_EVERY_S = 2.0
_HEX64 = re.compile(r"[0-9a-fA-F]{64}")
_FORMAT = "expected 'TENANT KEY' or 'TENANT sha256:<64 hex digits>'"


class ApiKeysError(ValueError):
    """A keys file that cannot be used (the message names the file and line, never a key)."""


@dataclass(frozen=True)
class AuthResult:
    """The outcome of checking one request's credentials."""

    tenant: str | None  # the authenticated tenant, or None when refused
    reason: str = ""  # refused: "missing" | "malformed" | "unknown"


def parse_keys(text: str, source: str) -> list[tuple[str, bytes]]:
    """``(tenant, sha256 digest)`` of every key line; raises ApiKeysError naming the bad line."""
    out: list[tuple[str, bytes]] = []
    owner: dict[bytes, tuple[str, int]] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ApiKeysError(f"{source} line {lineno}: {_FORMAT}")
        tenant, key = parts
        if key.startswith("sha256:"):
            hexdigest = key[len("sha256:") :]
            if not _HEX64.fullmatch(hexdigest):
                raise ApiKeysError(f"{source} line {lineno}: {_FORMAT}")
            digest = bytes.fromhex(hexdigest)
        else:
            digest = hashlib.sha256(key.encode()).digest()
        seen = owner.get(digest)
        if seen is not None and seen[0] != tenant:
            raise ApiKeysError(
                f"{source} line {lineno}: the same key is already given to another tenant on line {seen[1]}"
            )
        if seen is None:
            owner[digest] = (tenant, lineno)
            out.append((tenant, digest))
    if not out:
        raise ApiKeysError(f"{source}: no keys (every request would be refused)")
    return out


class ApiKeys:
    """The keys of one file, reloaded when the file changes."""

    def __init__(self, path: str | os.PathLike, check_every_s: float = CHECK_EVERY_S) -> None:
        """Loads ``path`` now; raises ApiKeysError when it is missing or malformed."""
        self.path = Path(path)
        self.check_every_s = check_every_s
        try:
            data = self.path.read_bytes()
        except OSError as exc:
            raise ApiKeysError(f"cannot read the API keys file {self.path}: {exc.strerror}") from exc
        self._entries = self._parse(data)
        self._seen = hashlib.sha256(data).digest()  # content last loaded or rejected
        self._checked = time.monotonic()

    @classmethod
    def from_settings(cls, path: str | None) -> ApiKeys | None:
        """Keys from the flag, else ``$PAGODA_API_KEYS_FILE``, else None (no authentication)."""
        path = path or os.environ.get(ENV_KEYS_FILE) or None
        return cls(path) if path else None

    def _parse(self, data: bytes) -> list[tuple[str, bytes]]:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ApiKeysError(f"{self.path}: not UTF-8 text") from exc
        return parse_keys(text, str(self.path))

    @property
    def tenants(self) -> set[str]:
        return {t for t, _ in self._entries}

    def maybe_reload(self, now: float | None = None) -> None:
        """Re-read the file if ``check_every_s`` has passed and its content changed."""
        now = time.monotonic() if now is None else now
        if now - self._checked < self.check_every_s:
            return
        self._checked = now
        try:
            data = self.path.read_bytes()
        except OSError as exc:
            if self._seen != b"unreadable":  # logged once per change, not at every check
                self._seen = b"unreadable"
                log.error(
                    "API keys file %s cannot be read (%s); keeping the current keys", self.path, exc.strerror
                )
            return
        seen = hashlib.sha256(data).digest()
        if seen == self._seen:
            return
        self._seen = seen
        try:
            entries = self._parse(data)
        except ApiKeysError as exc:
            log.error("API keys file changed but is invalid, keeping the current keys: %s", exc)
            return
        self._entries = entries
        log.warning(
            "API keys reloaded from %s: %d keys, %d tenants", self.path, len(entries), len(self.tenants)
        )

    def lookup(self, key: bytes) -> str | None:
        """The tenant owning ``key``, or None; compares against every digest in constant time."""
        self.maybe_reload()
        digest = hashlib.sha256(key).digest()
        found: str | None = None
        for tenant, known in self._entries:
            if hmac.compare_digest(digest, known) and found is None:
                found = tenant
        return found

    def check(self, authorization: list[bytes]) -> AuthResult:
        """The tenant of a request given its ``Authorization`` header values."""
        if not authorization:
            return AuthResult(None, "missing")
        if len(authorization) > 1:
            return AuthResult(None, "malformed")
        scheme, _, token = authorization[0].strip().partition(b" ")
        token = token.strip()
        if scheme.lower() != b"bearer" or not token or b" " in token:
            return AuthResult(None, "malformed")
        tenant = self.lookup(token)
        return AuthResult(tenant, "" if tenant is not None else "unknown")
