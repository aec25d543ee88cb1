"""The KV handoff between processes: a framed binary protocol over TCP with a checksum per page.

Wire format (version 2, integers little-endian). Every frame is::

    magic "PGKV" (4 bytes) | version u8 (=2) | type u8 | reserved u16 | length u32 | body | crc32(body) u32

The sender opens one connection per handoff and sends, in order:

1. ``HEADER`` (type 1): a 32-byte HMAC-SHA256 of the JSON that follows, under a key derived from
   the internal token (internal_auth.py), then UTF-8 JSON: ``ticket`` (names the waiting request on
   the receiver; single-use), ``request_id``, ``prompt_token_ids``, ``first_token``, ``page_size``,
   ``kv_format``, ``num_pages``, ``num_layers``, ``components`` (e.g. ``["k", "v"]``), ``dtype``
   (torch dtype name of the pages), ``page_shape`` (per component, one page:
   ``[page_size, heads, dim]``), ``has_scales``, ``scale_shape``, ``generator_state_len``,
   ``num_cached_tokens``, and optionally ``page_scales`` (the FP8 components whose scales are per
   token, e.g. ``["k"]``; absent means none).
2. ``PAGE`` (type 2), one per page: ``page_index u32`` then, for every layer in order, every
   component in header order, the page's elements in C order, then the page's per-token scales
   (bfloat16 ``[page_size, heads]``) of each ``page_scales`` component. The frame's CRC32 is that
   page's checksum (scales included); the receiver verifies it on arrival and fails the whole
   handoff on a mismatch.
3. ``SCALES`` (type 3, when ``has_scales``): float32 per-head FP8 scales of the components not in
   ``page_scales``, layer by layer, component by component.
4. ``GENSTATE`` (type 4, when ``generator_state_len`` > 0): the sampling generator's state bytes.
5. ``END`` (type 5): ``num_pages u32``, the count the receiver must have seen.

The receiver answers with one ``ACK`` frame (type 6): JSON ``{"ok": true}`` once the decode
engine accepted the sequence, or ``{"ok": false, "error": "..."}``.

The receiver trusts nothing before it checked it (kv_limits.py): the header's MAC first, then its
ticket (claimed once: a second handoff for a ticket is refused), then every field against the
decode pool's limits, before anything is allocated. Until the MAC verifies, a connection holds no
handoff slot, ticket or page: it must verify within ``auth_timeout_s``; over ``max_connections``
open a new one is closed at once; over ``max_unauthenticated`` (in all, or per peer address)
waiting for their MAC, the oldest waiting one that has not yet sent a frame prefix and a MAC's
worth of bytes is closed, else the oldest (a legitimate sender sends its whole header at once, so
a flood of silent or trickling connections, even from its own address, closes theirs). Pages are refused when they hold NaN,
infinities or values beyond ``max_abs_value`` (one batched pass in the assembly, finite.py). Each frame's length is bounded by what the
header announced (one page, the scales, the generator state) before its body is read; pages are
staged as they arrive and assembled off the event loop. A frame must arrive within
``frame_timeout_s`` and the handoff within ``handoff_deadline_s``; at most ``max_handoffs``
authenticated handoffs are served at once (one more is answered "busy" at once). Every failure is answered
with a refusing ACK while the socket allows and reported to ``on_error(reason, message, ticket)``
(ticket: only once it was claimed, so the waiting request fails at once).

``KVSender``/``KVReceiver`` are the transport interface; TCP is the one implementation here, so an
RDMA transport can be added beside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import struct
import time
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from pagoda.node_agent.engine.handoff import KVPayload
from pagoda.node_agent.kv.finite import NON_FINITE, bad_values
from pagoda.node_agent.kv.layout import PageLayout
from pagoda.node_agent.kv.storage import is_page_scale_key
from pagoda.node_agent.serving.api.internal_auth import MAC_BYTES, InternalAuth
from pagoda.node_agent.serving.worker.kv_limits import (
    HeaderError,
    KVLimits,
    NoRoom,
    check_header,
    header_page_scales,
    header_static_scales,
    torch_dtype,
)

log = logging.getLogger("pagoda.kv_transport")

MAGIC = b"PGKV"
VERSION = 2
HEADER, PAGE, SCALES, GENSTATE, END, ACK = 1, 2, 3, 4, 5, 6
_PREFIX = struct.Struct("<4sBBHI")  # magic, version, type, reserved, length
PROGRESS_BYTES = _PREFIX.size + MAC_BYTES  # sent before its MAC verifies: evicted last
_CRC = struct.Struct("<I")
_U32 = struct.Struct("<I")
MAX_ACK = 1 << 16
MAX_ERROR_CHARS = 500
CRC_IN_THREAD = 1 << 16  # frames at least this big are checksummed off the event loop
LINGER_S = 2.0  # after a refusal, how long the receiver drains what the sender still sends
LINGER_BYTES = 64 << 20  # ... and how much of it, so the refusing ACK is read before any reset


class TransferError(RuntimeError):
    """A KV handoff that failed; ``reason`` labels it in ``pagoda_kv_transfer_failures_total``."""

    def __init__(self, message: str, reason: str = "framing") -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class TransferStats:
    pages: int
    bytes: int
    seconds: float


def encode_frame(ftype: int, body: bytes) -> bytes:
    return _PREFIX.pack(MAGIC, VERSION, ftype, 0, len(body)) + body + _CRC.pack(zlib.crc32(body))


async def read_frame(
    reader: asyncio.StreamReader, max_len: Callable[[int], int], timeout: float | None = None
) -> tuple[int, bytes]:
    """One frame. ``max_len(type)`` bounds its body before it is read (negative: type not allowed
    here). TransferError on bad magic/version/type/length/checksum, a closed connection or a frame
    slower than ``timeout`` seconds."""
    try:
        async with asyncio.timeout(timeout):
            magic, version, ftype, _, length = _PREFIX.unpack(await reader.readexactly(_PREFIX.size))
            if magic != MAGIC or version != VERSION:
                raise TransferError(f"not a pagoda KV frame (magic {magic!r}, version {version})")
            limit = max_len(ftype)
            if limit < 0:
                raise TransferError(f"unexpected KV frame type {ftype} here")
            if length > limit:
                raise TransferError(f"KV frame type {ftype} of {length} bytes exceeds its limit of {limit}")
            body = await reader.readexactly(length)
            (crc,) = _CRC.unpack(await reader.readexactly(_CRC.size))
    except asyncio.IncompleteReadError as exc:
        raise TransferError("the connection closed inside a KV frame", "closed") from exc
    except TimeoutError as exc:
        raise TransferError(f"no complete KV frame within {timeout}s", "timeout") from exc
    actual = await asyncio.to_thread(zlib.crc32, body) if length >= CRC_IN_THREAD else zlib.crc32(body)
    if actual != crc:
        kind = "page" if ftype == PAGE else f"frame type {ftype}"
        where = f" {_U32.unpack_from(body)[0]}" if ftype == PAGE and len(body) >= 4 else ""
        raise TransferError(f"checksum mismatch in KV {kind}{where}", "checksum")
    return ftype, body


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def header_of(ticket: str, p: KVPayload, gen_len: int) -> dict[str, Any]:
    layout = PageLayout.of_pages(p.layers, p.scales)
    comps = list(layout.components)
    first = p.layers[0][comps[0]] if comps else None
    header = {
        "ticket": ticket,
        "request_id": p.request_id,
        "prompt_token_ids": p.prompt_token_ids,
        "first_token": p.first_token,
        "page_size": p.page_size,
        "kv_format": p.kv_format,
        "num_pages": p.num_pages,
        "num_layers": len(p.layers),
        "components": comps,
        "dtype": str(first.dtype).removeprefix("torch.") if first is not None else "float32",
        "page_shape": {c: list(p.layers[0][c].shape[1:]) for c in comps},
        "has_scales": p.scales is not None,
        "scale_shape": {c: list(p.scales[0][c].shape) for c in layout.static_scaled} if p.scales else {},
        "generator_state_len": gen_len,
        "num_cached_tokens": p.num_cached_tokens,
    }
    if layout.page_scaled:
        header["page_scales"] = list(layout.page_scaled)
    return header


def header_frame(auth: InternalAuth, header: dict[str, Any]) -> bytes:
    """A HEADER frame: the JSON's MAC, then the JSON."""
    raw = json.dumps(header).encode()
    return encode_frame(HEADER, auth.kv_mac(raw) + raw)


def payload_frames(ticket: str, p: KVPayload, auth: InternalAuth) -> list[bytes]:
    """The frames of one handoff (header, pages, scales, generator state, end)."""
    layout = PageLayout.of_pages(p.layers, p.scales)  # per layer: values, then per-token scales
    gen = _bytes(p.generator_state) if p.generator_state is not None else b""
    frames = [header_frame(auth, header_of(ticket, p, len(gen)))]
    for i in range(p.num_pages):
        parts = [_U32.pack(i)] + [_bytes(t[i]) for layer in p.layers for t in layout.layer_tensors(layer)]
        frames.append(encode_frame(PAGE, b"".join(parts)))
    if p.scales is not None:
        static = layout.tensors([], p.scales)  # every layer's static scales, component by component
        frames.append(encode_frame(SCALES, b"".join(_bytes(t.float()) for t in static)))
    if gen:
        frames.append(encode_frame(GENSTATE, gen))
    frames.append(encode_frame(END, _U32.pack(p.num_pages)))
    return frames


_ORDER = {PAGE: 1, SCALES: 2, GENSTATE: 3, END: 4}


class _Assembler:
    """Stages the frames after a checked header (pages as they arrive) and rebuilds the payload."""

    def __init__(self, header: dict[str, Any], limits: KVLimits) -> None:
        self.h = header
        self.limits = limits
        self.n: int = header["num_pages"]
        self.dtype_name: str = header["dtype"]
        self.page_scales: list[str] = header_page_scales(header, limits)
        self.static = header_static_scales(header, limits)
        self.layout = PageLayout(tuple(limits.components), tuple(self.page_scales), tuple(self.static))
        self.page_bytes = limits.page_bytes(self.dtype_name, self.page_scales)
        self.pages: dict[int, bytes] = {}
        self.scales_body: bytes | None = None
        self.gen_body: bytes | None = None
        self.phase = 0

    def max_len(self, ftype: int) -> int:
        """The exact body size a frame of this type must have now; -1 when it is out of order."""
        order = _ORDER.get(ftype)
        if order is None or order < self.phase or (order == self.phase and ftype != PAGE):
            return -1
        if ftype == PAGE:
            return 4 + self.page_bytes
        if ftype == SCALES:
            return self.limits.static_scales_bytes(self.static) if self.h["has_scales"] else -1
        if ftype == GENSTATE:
            return self.h["generator_state_len"] or -1
        return 4

    def add(self, ftype: int, body: bytes) -> bool:
        """Take one frame; True after END."""
        want = self.max_len(ftype)
        if len(body) != want:
            raise TransferError(f"KV frame type {ftype} has {len(body)} bytes, expected {want}")
        self.phase = _ORDER[ftype]
        if ftype == PAGE:
            (idx,) = _U32.unpack_from(body)
            if idx >= self.n or idx in self.pages:
                raise TransferError(f"unexpected KV page index {idx}")
            self.pages[idx] = body
        elif ftype == SCALES:
            self.scales_body = body
        elif ftype == GENSTATE:
            self.gen_body = body
        else:
            (count,) = _U32.unpack(body)
            if count != self.n or len(self.pages) != self.n:
                raise TransferError(
                    f"KV handoff ended with {len(self.pages)} of {self.n} pages (END says {count})"
                )
            if self.h["has_scales"] and self.scales_body is None:
                raise TransferError("KV handoff is missing its FP8 scales")
            if self.h["generator_state_len"] and self.gen_body is None:
                raise TransferError("KV handoff is missing its generator state")
            return True
        return False

    def build(self) -> KVPayload:
        """The payload (run in a worker thread: it copies every page once)."""
        layers = self._pages()
        scales = self._scales()
        gen = None
        if self.gen_body is not None:
            gen = torch.from_numpy(np.frombuffer(self.gen_body, dtype=np.uint8).copy())
            try:
                torch.Generator().set_state(gen)
            except RuntimeError as exc:
                raise TransferError(f"KV generator state is not valid: {exc}", "invalid") from exc
        h = self.h
        return KVPayload(
            h["request_id"],
            list(h["prompt_token_ids"]),
            h["first_token"],
            h["page_size"],
            h["kv_format"],
            layers,
            scales,
            gen,
            h["num_cached_tokens"],
        )

    def _pages(self) -> list[dict[str, torch.Tensor]]:
        """Every layer's page tensors cut out of the PAGE frames, in the layout's order."""
        n, lim = self.n, self.limits
        flat = np.empty((n, self.page_bytes), dtype=np.uint8)
        for i in range(n):
            flat[i] = np.frombuffer(self.pages.pop(i), dtype=np.uint8, offset=4)
        dtype = torch_dtype(self.dtype_name)
        t, off, layers = torch.from_numpy(flat), 0, []
        if not self.page_scales:  # every byte of every page is a value: one batched check
            self._check_values(t.view(dtype))
        for _ in range(lim.num_layers):
            d = {}
            for key in self.layout.page_keys:
                shape = PageLayout.page_shape(key, lim.page_size, lim.component_shapes)
                kd = PageLayout.key_dtype(key, dtype)
                size = math.prod(shape) * kd.itemsize
                d[key] = t[:, off : off + size].contiguous().view(kd).reshape(n, *shape)
                off += size
                if is_page_scale_key(key) and (
                    not bool(torch.isfinite(d[key]).all()) or bool((d[key] < 0).any())
                ):
                    raise TransferError("KV per-token scales must be finite and non-negative", "invalid")
                if self.page_scales and not is_page_scale_key(key):
                    self._check_values(d[key])
            layers.append(d)
        return layers

    def _check_values(self, values: torch.Tensor) -> None:
        """Refuse pages holding NaN, infinities or values beyond the format's sane range."""
        why = bad_values(values, self.limits.max_abs_value)
        if why == NON_FINITE:
            raise TransferError(
                f"KV pages hold non-finite values (NaN or infinity) in {self.dtype_name}", why
            )
        if why is not None:
            bound = f"{self.limits.max_abs_value:g}"
            raise TransferError(f"KV pages hold {self.dtype_name} values beyond +-{bound}", why)

    def _scales(self) -> list[dict[str, torch.Tensor]] | None:
        """Every layer's static per-head scales from the SCALES frame (None: it has none)."""
        if self.scales_body is None:
            return None
        vals = torch.from_numpy(np.frombuffer(self.scales_body, dtype=np.float32).copy())
        if not bool(torch.isfinite(vals).all()) or not bool((vals > 0).all()):
            raise TransferError("KV scales must be finite and positive", "invalid")
        scales, off = [], 0
        for _ in range(self.limits.num_layers):
            d = {}
            for c in self.layout.static_scaled:
                k = self.limits.scale_shape(c)[0]
                d[c] = vals[off : off + k].clone()
                off += k
            scales.append(d)
        return scales


# ---------------------------------------------------------------------- the transport interface


Handler = Callable[[str, KVPayload], Awaitable[None]]
Claim = Callable[[str], str | None]  # ticket -> None (claimed now) or why not ("unknown", "replayed")
OnError = Callable[[str, str, str | None], None]  # reason, message, claimed ticket or None


class KVSender(Protocol):
    async def send(self, address: str, ticket: str, payload: KVPayload) -> TransferStats: ...


class KVReceiver(Protocol):
    address: str

    async def start(self) -> str: ...

    async def stop(self) -> None: ...


# ---------------------------------------------------------------------- TCP


class TcpKVSender:
    """Sends a payload to ``host:port`` and waits for the receiver's ACK."""

    def __init__(self, auth: InternalAuth, timeout: float = 60.0) -> None:
        self.auth = auth
        self.timeout = timeout

    async def send(self, address: str, ticket: str, payload: KVPayload) -> TransferStats:
        host, _, port = address.rpartition(":")
        t0 = time.perf_counter()
        frames = await asyncio.to_thread(payload_frames, ticket, payload, self.auth)
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), self.timeout)
        except (OSError, TimeoutError, ValueError) as exc:
            raise TransferError(f"cannot connect to the decode worker's KV port {address}: {exc}") from exc
        # the ACK is read while sending: a receiver that refuses early answers and closes at once
        ack_task = asyncio.ensure_future(
            read_frame(reader, lambda t: MAX_ACK if t == ACK else -1, self.timeout)
        )
        try:
            try:
                for f in frames:
                    if ack_task.done():
                        break
                    writer.write(f)
                    await writer.drain()
            except OSError:
                pass  # its ACK says why
            ftype, body = await ack_task
            ack = json.loads(body)
        except (OSError, ValueError) as exc:
            raise TransferError(f"KV handoff to {address} failed: {exc!r}") from exc
        except TransferError as exc:
            raise TransferError(f"KV handoff to {address} failed: {exc}", exc.reason) from exc
        finally:
            ack_task.cancel()
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
        if not isinstance(ack, dict) or not ack.get("ok"):
            err = ack.get("error") if isinstance(ack, dict) else ack
            reason = "busy" if isinstance(ack, dict) and ack.get("reason") == "busy" else "refused"
            raise TransferError(f"the decode worker refused the KV pages: {err}", reason)
        return TransferStats(payload.num_pages, sum(len(f) for f in frames), time.perf_counter() - t0)


@dataclass(eq=False)
class _Conn:
    """One connection to the receiver, and what it holds."""

    peer: str
    writer: asyncio.StreamWriter
    ticket: str | None = None  # claimed (after the MAC verified)
    pages: int = 0  # reserved (after the header checked)
    slot: bool = False  # a handoff slot (after the MAC verified)
    evicted: str | None = None  # why it was closed before its MAC verified
    reader: _TrackedReader | None = None

    @property
    def progressed(self) -> bool:
        """Whether it sent at least a frame prefix and a MAC (a legitimate sender, at once)."""
        return self.reader is not None and self.reader.received >= PROGRESS_BYTES


class _TrackedReader(asyncio.StreamReader):
    """A StreamReader that counts the bytes its connection delivered (read or not)."""

    received = 0

    def feed_data(self, data: bytes) -> None:
        self.received += len(data)
        super().feed_data(data)


def _peer(writer: asyncio.StreamWriter) -> str:
    name = writer.get_extra_info("peername")
    return str(name[0]) if isinstance(name, tuple) and name else str(name)


class TcpKVReceiver:
    """Accepts handoffs on a TCP port; each verified payload goes to ``handler(ticket, payload)``,
    whose exception (or any refusal before it) is answered as a refusing ACK."""

    def __init__(
        self,
        host: str,
        port: int,
        handler: Handler,
        auth: InternalAuth,
        limits: KVLimits,
        claim: Claim,
        advertise_host: str | None = None,
        on_error: OnError | None = None,
        on_auth_failure: Callable[[str], None] | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.handler = handler
        self.auth = auth
        self.limits = limits
        self.claim = claim
        self.advertise_host = advertise_host or host
        self.on_error = on_error
        self.on_auth_failure = on_auth_failure
        self.address = ""
        self.active = 0  # authenticated handoffs holding a slot (at most limits.max_handoffs)
        self.connections = 0  # open connections, authenticated or not
        self.reserved_pages = 0  # pages announced by the handoffs in flight
        self._unauth: dict[int, _Conn] = {}  # connections before their MAC, oldest first
        self._per_peer: dict[str, int] = {}  # ... counted per peer address
        self._server: asyncio.base_events.Server | None = None
        self._last_log = 0.0
        self._quiet = 0

    async def start(self) -> str:
        loop = asyncio.get_running_loop()

        def protocol() -> asyncio.StreamReaderProtocol:  # asyncio.start_server, with a counting reader
            return asyncio.StreamReaderProtocol(_TrackedReader(loop=loop), self._conn, loop=loop)

        self._server = await loop.create_server(protocol, self.host, self.port)
        port = self._server.sockets[0].getsockname()[1]
        self.address = f"{self.advertise_host}:{port}"
        return self.address

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)

    def _refused(self, reason: str, message: str, ticket: str | None) -> None:
        now = time.monotonic()
        if now - self._last_log >= 1.0:  # a flood of bad connections must not flood the log
            more = f" (+{self._quiet} more refusals)" if self._quiet else ""
            log.warning("KV handoff refused (%s, ticket %s): %s%s", reason, ticket, message, more)
            self._last_log, self._quiet = now, 0
        else:
            self._quiet += 1
        if self.on_error:
            self.on_error(reason, message, ticket)

    def counts(self) -> dict[str, int]:
        """What the receiver holds now (all 0 when idle): open connections, those before their
        MAC, handoff slots taken, decode pages reserved."""
        return {
            "connections": self.connections,
            "unauthenticated": self.unauthenticated,
            "handoffs": self.active,
            "reserved_pages": self.reserved_pages,
        }

    @property
    def unauthenticated(self) -> int:
        """Connections open whose HEADER MAC has not verified yet."""
        return len(self._unauth)

    def _admit(self, conn: _Conn) -> None:
        """Track a new connection as unauthenticated; over a cap, the oldest one goes (a legitimate
        sender sends its header at once, so it is the newest, not the oldest, when a flood comes)."""
        self._unauth[id(conn)] = conn
        self._per_peer[conn.peer] = self._per_peer.get(conn.peer, 0) + 1
        lim = self.limits
        if self._per_peer[conn.peer] > lim.max_unauthenticated_per_peer:
            victim = self._victim([c for c in self._unauth.values() if c.peer == conn.peer])
            self._evict(victim, f"over {lim.max_unauthenticated_per_peer} unauthenticated from {conn.peer}")
        if len(self._unauth) > lim.max_unauthenticated:
            victim = self._victim(list(self._unauth.values()))
            self._evict(victim, f"over {lim.max_unauthenticated} unauthenticated")

    @staticmethod
    def _victim(waiting: list[_Conn]) -> _Conn:
        """Of ``waiting`` (oldest first, the new connection last): the oldest that has not sent a
        frame prefix and a MAC yet, the new one spared; if every older one has, the oldest."""
        return next((c for c in waiting[:-1] if not c.progressed), waiting[0])

    def _authenticated(self, conn: _Conn) -> None:
        if self._unauth.pop(id(conn), None) is not None:
            self._per_peer[conn.peer] -= 1
            if not self._per_peer[conn.peer]:
                del self._per_peer[conn.peer]

    def _evict(self, conn: _Conn, why: str) -> None:
        self._authenticated(conn)  # no longer counted as waiting
        conn.evicted = why
        conn.writer.transport.abort()  # its read ends at once; _conn releases what it held

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        lim = self.limits
        if self.connections >= lim.max_connections:
            self._refused("conn_limit", f"{lim.max_connections} KV connections are open", None)
            writer.transport.abort()
            return
        conn = _Conn(_peer(writer), writer, reader=reader if isinstance(reader, _TrackedReader) else None)
        self.connections += 1
        self._admit(conn)
        ack: dict[str, Any] = {"ok": True}
        try:
            try:
                try:
                    async with asyncio.timeout(lim.handoff_deadline_s):
                        payload = await self._receive(reader, conn)
                except TimeoutError as exc:
                    msg = f"the KV handoff took longer than {lim.handoff_deadline_s}s"
                    raise TransferError(msg, "timeout") from exc
                try:
                    await self.handler(conn.ticket, payload)
                except TransferError:
                    raise
                except Exception as exc:
                    raise TransferError(str(exc), "refused") from exc
            except TransferError as exc:
                reason = "evicted" if conn.evicted else exc.reason
                ack = {"ok": False, "error": str(exc)[:MAX_ERROR_CHARS], "reason": reason}
                self._refused(reason, conn.evicted or str(exc), conn.ticket)
            except (OSError, EOFError) as exc:
                ack = {"ok": False, "error": f"connection lost: {exc!r}"[:MAX_ERROR_CHARS]}
                self._refused("evicted" if conn.evicted else "closed", repr(exc), conn.ticket)
            except Exception as exc:  # a bug must still be answered, counted and fail the request
                log.exception("KV receiver error")
                ack = {"ok": False, "error": f"internal error: {type(exc).__name__}"}
                self._refused("internal", f"{type(exc).__name__}: {exc}", conn.ticket)
            if not conn.evicted:
                with contextlib.suppress(Exception):
                    writer.write(encode_frame(ACK, json.dumps(ack).encode()))
                    await asyncio.wait_for(writer.drain(), lim.frame_timeout_s)
                    if not ack["ok"] and ack.get("reason") != "auth_timeout":
                        await _linger(reader, writer)
        finally:
            self._authenticated(conn)
            self.connections -= 1
            self.active -= 1 if conn.slot else 0
            self.reserved_pages -= conn.pages
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 1)

    async def _header(self, reader: asyncio.StreamReader) -> bytes:
        """The HEADER frame's JSON once its MAC verified, within ``auth_timeout_s`` (and
        ``frame_timeout_s``) of the connect."""
        lim = self.limits
        header_max = MAC_BYTES + lim.max_header_bytes
        deadline = min(lim.auth_timeout_s, lim.frame_timeout_s)  # the header is a frame too
        try:
            _, body = await read_frame(reader, lambda t: header_max if t == HEADER else -1, deadline)
        except TransferError as exc:
            if exc.reason != "timeout":
                raise
            self._auth_failure("auth_timeout")
            msg = f"no verified KV header within {deadline}s of connecting"
            raise TransferError(msg, "auth_timeout") from exc
        raw = body[MAC_BYTES:]
        if len(body) < MAC_BYTES or not self.auth.check_kv_mac(raw, body[:MAC_BYTES]):
            self._auth_failure("bad_mac")
            raise TransferError("the KV header's MAC is wrong (internal token mismatch?)", "auth")
        return raw

    async def _receive(self, reader: asyncio.StreamReader, conn: _Conn) -> KVPayload:
        """Header (MAC; then a handoff slot, the ticket, the fields), then the frames it announced;
        the assembled payload. Nothing is held for the connection before its MAC verified."""
        lim = self.limits
        raw = await self._header(reader)
        self._authenticated(conn)
        if self.active >= lim.max_handoffs:
            raise TransferError(f"busy: {lim.max_handoffs} KV handoffs in flight", "busy")
        self.active += 1
        conn.slot = True
        try:
            header = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise TransferError(f"the KV header is not JSON: {exc}", "invalid") from exc
        ticket = header.get("ticket") if isinstance(header, dict) else None
        if not isinstance(ticket, str):
            raise TransferError("the KV header names no ticket", "invalid")
        why = self.claim(ticket)
        if why is not None:
            self._auth_failure(f"{why}_ticket")
            raise TransferError(f"KV ticket refused: {why}", "auth")
        conn.ticket = ticket
        try:
            check_header(header, lim, lim.free_pages() - self.reserved_pages)
        except NoRoom as exc:
            raise TransferError(str(exc), "busy") from exc
        except HeaderError as exc:
            raise TransferError(str(exc), "invalid") from exc
        conn.pages = header["num_pages"]
        self.reserved_pages += conn.pages
        asm = _Assembler(header, lim)
        while True:
            ftype, body = await read_frame(reader, asm.max_len, lim.frame_timeout_s)
            if asm.add(ftype, body):
                break
        return await asyncio.to_thread(asm.build)

    def _auth_failure(self, reason: str) -> None:
        if self.on_auth_failure:
            self.on_auth_failure(reason)


async def _linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """After a refusing ACK: half-close, then read and drop what the sender still sends (bounded in
    time and bytes) until it closes. Closing at once with unread data would reset the connection,
    and a reset can destroy the ACK before the sender reads why it was refused."""
    with contextlib.suppress(Exception):
        writer.write_eof()
        async with asyncio.timeout(LINGER_S):
            dropped = 0
            while dropped < LINGER_BYTES:
                chunk = await reader.read(1 << 16)
                if not chunk:
                    return
                dropped += len(chunk)
