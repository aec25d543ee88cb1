"""Per-pod worker discovery for the router: DNS names resolved to one backend per address.

``--prefill-dns`` / ``--decode-dns`` take ``HOST:PORT[,HOST:PORT...]``; every A/AAAA record of
HOST (a Kubernetes headless Service lists one per ready pod) is one worker ``http://IP:PORT``
(IPv6 in brackets). ``DnsWatch`` re-resolves the names off the request path; a name that fails to
resolve keeps the addresses it last had (the failure is reported to a callback, which logs and
counts it), so a DNS outage never empties the router.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

MAX_TARGETS = 64  # names per flag
_LABEL = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?$")


@dataclass(frozen=True)
class DnsTarget:
    """One ``HOST:PORT`` of a ``--*-dns`` flag."""

    host: str  # a DNS name or an IP literal (IPv6 without brackets)
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


Resolver = Callable[[DnsTarget], Awaitable[set[str]]]


def parse_dns_targets(value: str, flag: str) -> list[DnsTarget]:
    """``HOST:PORT[,HOST:PORT...]`` (empty: none); ValueError naming ``flag`` and the bad entry."""
    if not value.strip():
        return []
    role = flag.removeprefix("--").removesuffix("-dns")
    usage = f"expected HOST:PORT[,HOST:PORT...], e.g. {flag} my-model-{role}.NAMESPACE.svc.cluster.local:8000"
    items = [x.strip() for x in value.split(",")]
    if len(items) > MAX_TARGETS:
        raise ValueError(f"{flag}: {len(items)} names, at most {MAX_TARGETS}")
    out: list[DnsTarget] = []
    for item in items:
        if not item:
            raise ValueError(f"{flag}: an empty entry in {value!r}; {usage}")
        if "://" in item or "/" in item:
            raise ValueError(
                f"{flag}: {item!r} is a URL, not HOST:PORT (static worker URLs go in "
                f"{flag.replace('-dns', '-endpoints')}); {usage}"
            )
        host, sep, port = item.rpartition(":")
        if not sep or not port:
            raise ValueError(f"{flag}: {item!r} has no port; {usage}")
        if not host:
            raise ValueError(f"{flag}: {item!r} has no host; {usage}")
        if not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ValueError(f"{flag}: {item!r}: the port must be a number in 1..65535")
        out.append(DnsTarget(_host(host, item, flag), int(port)))
    return list(dict.fromkeys(out))


def _host(host: str, item: str, flag: str) -> str:
    if host.startswith("[") and host.endswith("]"):
        try:
            return str(ipaddress.IPv6Address(host[1:-1]))
        except ValueError:
            raise ValueError(f"{flag}: {item!r}: {host} is not an IPv6 address") from None
    if ":" in host:
        raise ValueError(f"{flag}: {item!r}: write an IPv6 address in brackets, e.g. [::1]:8000")
    name = host[:-1] if host.endswith(".") else host
    if len(name) > 253 or not all(_LABEL.match(label) for label in name.split(".")):
        raise ValueError(f"{flag}: {item!r}: {host!r} is not a valid DNS name")
    return host


def backend_url(ip: str, port: int) -> str:
    """``http://IP:PORT``, an IPv6 address in brackets (a zone index, never routable here, dropped)."""
    ip = ip.split("%", 1)[0]
    return f"http://[{ip}]:{port}" if ":" in ip else f"http://{ip}:{port}"


async def resolve(target: DnsTarget) -> set[str]:
    """Every A/AAAA record of the target as a backend URL, with the event loop's ``getaddrinfo``;
    OSError when the name does not resolve or has no address."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
    urls = {
        backend_url(str(addr[0]), target.port)
        for family, _, _, _, addr in infos
        if family in (socket.AF_INET, socket.AF_INET6)
    }
    if not urls:
        raise OSError(f"{target.host} has no A or AAAA record")
    return urls


class DnsWatch:
    """The backends behind each role's names, re-resolved by ``refresh``; a failure keeps the last
    known addresses of that name and is passed to ``on_error(role, target, exc)``."""

    def __init__(
        self,
        targets: dict[str, list[DnsTarget]],
        on_error: Callable[[str, DnsTarget, Exception], None],
        resolver: Resolver = resolve,
        timeout_s: float = 10.0,
    ) -> None:
        self.targets = targets
        self.on_error = on_error
        self.resolver = resolver
        self.timeout_s = timeout_s
        self.known: dict[tuple[str, DnsTarget], set[str]] = {}

    async def refresh(self) -> dict[str, set[str]]:
        """Resolve every name at once; each role's backends (the union of its names' addresses)."""
        pairs = [(role, t) for role, ts in self.targets.items() for t in ts]
        results = await asyncio.gather(*(self._one(t) for _, t in pairs), return_exceptions=True)
        for (role, t), got in zip(pairs, results, strict=True):
            if isinstance(got, Exception):
                self.on_error(role, t, got)
            elif isinstance(got, BaseException):
                raise got
            else:
                self.known[(role, t)] = got
        out: dict[str, set[str]] = {role: set() for role in self.targets}
        for (role, _), urls in self.known.items():
            out[role] |= urls
        return out

    async def _one(self, target: DnsTarget) -> set[str]:
        async with asyncio.timeout(self.timeout_s):
            return await self.resolver(target)
