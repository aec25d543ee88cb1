"""The KV handoff between processes: a framed binary protocol over TCP with a checksum per page.

Wire format (version 1, integers little-endian). Every frame is::

    magic "PGKV" (4 bytes) | version u8 (=1) | type u8 | reserved u16 | length u32 | body | crc32(body) u32

The sender opens one connection per handoff and sends, in order:

1. ``HEADER`` (type 1): UTF-8 JSON: ``ticket`` (names the waiting request on the receiver),
   ``request_id``, ``prompt_token_ids``, ``first_token``, ``page_size``, ``kv_format``,
   ``num_pages``, ``num_layers``, ``components`` (e.g. ``["k", "v"]``), ``dtype`` (torch dtype name
   of the pages), ``page_shape`` (per component, one page: ``[page_size, heads, dim]``),
   ``has_scales``, ``generator_state_len``, ``num_cached_tokens``.
2. ``PAGE`` (type 2), one per page: ``page_index u32`` then, for every layer in order and every
   component in header order, the page's elements in C order. The frame's CRC32 is that page's
   checksum; the receiver verifies it on arrival and fails the whole handoff on a mismatch.
3. ``SCALES`` (type 3, when ``has_scales``): float32 per-head FP8 scales, layer by layer,
   component by component.
4. ``GENSTATE`` (type 4, when ``generator_state_len`` > 0): the sampling generator's state bytes.
5. ``END`` (type 5): ``num_pages u32``, the count the receiver must have seen.

The receiver answers with one ``ACK`` frame (type 6): JSON ``{"ok": true}`` once the decode
engine accepted the sequence, or ``{"ok": false, "error": "..."}``. Any framing error, checksum
mismatch or missing page is a failed handoff: the request fails, it is never decoded.

``KVSender``/``KVReceiver`` are the transport interface; TCP is the one implementation here, so an
RDMA transport can be added beside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import struct
import time
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from pagoda.node_agent.engine.handoff import KVPayload

log = logging.getLogger("pagoda.kv_transport")

MAGIC = b"PGKV"
VERSION = 1
HEADER, PAGE, SCALES, GENSTATE, END, ACK = 1, 2, 3, 4, 5, 6
_PREFIX = struct.Struct("<4sBBHI")  # magic, version, type, reserved, length
_CRC = struct.Struct("<I")
_U32 = struct.Struct("<I")
MAX_FRAME = 1 << 30


class TransferError(RuntimeError):
    """A KV handoff that failed: bad framing, checksum mismatch, refusal or connection loss."""


@dataclass
class TransferStats:
    pages: int
    bytes: int
    seconds: float


def encode_frame(ftype: int, body: bytes) -> bytes:
    return _PREFIX.pack(MAGIC, VERSION, ftype, 0, len(body)) + body + _CRC.pack(zlib.crc32(body))


async def read_frame(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """One frame; raises TransferError on bad magic, version, length or checksum."""
    try:
        magic, version, ftype, _, length = _PREFIX.unpack(await reader.readexactly(_PREFIX.size))
    except asyncio.IncompleteReadError as exc:
        raise TransferError("connection closed in a frame header") from exc
    if magic != MAGIC or version != VERSION:
        raise TransferError(f"not a pagoda KV frame (magic {magic!r}, version {version})")
    if length > MAX_FRAME:
        raise TransferError(f"frame of {length} bytes exceeds the limit")
    try:
        body = await reader.readexactly(length)
        (crc,) = _CRC.unpack(await reader.readexactly(_CRC.size))
    except asyncio.IncompleteReadError as exc:
        raise TransferError("connection closed in a frame body") from exc
    if zlib.crc32(body) != crc:
        kind = "page" if ftype == PAGE else f"frame type {ftype}"
        where = f" {_U32.unpack_from(body)[0]}" if ftype == PAGE and len(body) >= 4 else ""
        raise TransferError(f"checksum mismatch in KV {kind}{where}")
    return ftype, body


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise TransferError(f"unknown page dtype {name!r}")
    return dt


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def payload_frames(ticket: str, p: KVPayload) -> list[bytes]:
    """The frames of one handoff (header, pages, scales, generator state, end)."""
    comps = list(p.layers[0]) if p.layers else []
    first = p.layers[0][comps[0]] if comps else None
    gen = _bytes(p.generator_state) if p.generator_state is not None else b""
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
        "scale_shape": {c: list(p.scales[0][c].shape) for c in comps} if p.scales else {},
        "generator_state_len": len(gen),
        "num_cached_tokens": p.num_cached_tokens,
    }
    frames = [encode_frame(HEADER, json.dumps(header).encode())]
    for i in range(p.num_pages):
        parts = [_U32.pack(i)] + [_bytes(layer[c][i]) for layer in p.layers for c in comps]
        frames.append(encode_frame(PAGE, b"".join(parts)))
    if p.scales is not None:
        frames.append(encode_frame(SCALES, b"".join(_bytes(s[c].float()) for s in p.scales for c in comps)))
    if gen:
        frames.append(encode_frame(GENSTATE, gen))
    frames.append(encode_frame(END, _U32.pack(p.num_pages)))
    return frames


class _Assembler:
    """Rebuilds a KVPayload from frames, checking order, counts and sizes."""

    def __init__(self, header: dict) -> None:
        self.h = header
        self.comps: list[str] = header["components"]
        self.dtype = _dtype(header["dtype"])
        self.elem = torch.empty((), dtype=self.dtype).element_size()
        self.shapes = {c: tuple(header["page_shape"][c]) for c in self.comps}
        n, layers = int(header["num_pages"]), int(header["num_layers"])
        self.layers = [
            {c: torch.empty((n, *self.shapes[c]), dtype=self.dtype) for c in self.comps}
            for _ in range(layers)
        ]
        self.seen = [False] * n
        self.scales: list[dict[str, torch.Tensor]] | None = None
        self.gen: torch.Tensor | None = None
        sizes = [int(torch.Size(self.shapes[c]).numel()) * self.elem for c in self.comps]
        self.page_bytes = sum(sizes) * layers
        self.sizes = sizes

    def page(self, body: bytes) -> None:
        (idx,) = _U32.unpack_from(body)
        if idx >= len(self.seen) or self.seen[idx]:
            raise TransferError(f"unexpected KV page index {idx}")
        if len(body) - 4 != self.page_bytes:
            raise TransferError(f"KV page {idx} has {len(body) - 4} bytes, expected {self.page_bytes}")
        off = 4
        for layer in self.layers:
            for c, size in zip(self.comps, self.sizes, strict=True):
                raw = torch.frombuffer(bytearray(body[off : off + size]), dtype=torch.uint8)
                layer[c][idx].copy_(raw.view(self.dtype).reshape(self.shapes[c]))
                off += size
        self.seen[idx] = True

    def set_scales(self, body: bytes) -> None:
        shapes = {c: tuple(self.h["scale_shape"][c]) for c in self.comps}
        flat = torch.frombuffer(bytearray(body), dtype=torch.float32)
        need = len(self.layers) * sum(int(torch.Size(s).numel()) for s in shapes.values())
        if flat.numel() != need:
            raise TransferError(f"KV scales have {flat.numel()} values, expected {need}")
        off, out = 0, []
        for _ in self.layers:
            d = {}
            for c in self.comps:
                k = int(torch.Size(shapes[c]).numel())
                d[c] = flat[off : off + k].reshape(shapes[c]).clone()
                off += k
            out.append(d)
        self.scales = out

    def finish(self, end_body: bytes) -> KVPayload:
        (count,) = _U32.unpack(end_body)
        if count != len(self.seen) or not all(self.seen):
            raise TransferError(f"KV handoff ended with {sum(self.seen)} of {len(self.seen)} pages")
        if self.h.get("has_scales") and self.scales is None:
            raise TransferError("KV handoff is missing its FP8 scales")
        return KVPayload(
            self.h["request_id"],
            list(self.h["prompt_token_ids"]),
            int(self.h["first_token"]),
            int(self.h["page_size"]),
            self.h["kv_format"],
            self.layers,
            self.scales,
            self.gen,
            int(self.h.get("num_cached_tokens", 0)),
        )


# ---------------------------------------------------------------------- the transport interface


Handler = Callable[[str, KVPayload], Awaitable[None]]


class KVSender(Protocol):
    async def send(self, address: str, ticket: str, payload: KVPayload) -> TransferStats: ...


class KVReceiver(Protocol):
    address: str

    async def start(self) -> str: ...

    async def stop(self) -> None: ...


# ---------------------------------------------------------------------- TCP


class TcpKVSender:
    """Sends a payload to ``host:port`` and waits for the receiver's ACK."""

    def __init__(self, timeout: float = 60.0) -> None:
        self.timeout = timeout

    async def send(self, address: str, ticket: str, payload: KVPayload) -> TransferStats:
        host, _, port = address.rpartition(":")
        t0 = time.perf_counter()
        frames = await asyncio.to_thread(payload_frames, ticket, payload)
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), self.timeout)
        except (OSError, TimeoutError) as exc:
            raise TransferError(f"cannot connect to the decode worker's KV port {address}: {exc}") from exc
        try:
            for f in frames:
                writer.write(f)
                await writer.drain()
            ftype, body = await asyncio.wait_for(read_frame(reader), self.timeout)
        except (OSError, TimeoutError) as exc:
            raise TransferError(f"KV handoff to {address} failed: {exc!r}") from exc
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
        if ftype != ACK:
            raise TransferError(f"expected an ACK frame, got type {ftype}")
        ack = json.loads(body)
        if not ack.get("ok"):
            raise TransferError(f"the decode worker refused the KV pages: {ack.get('error')}")
        return TransferStats(payload.num_pages, sum(len(f) for f in frames), time.perf_counter() - t0)


class TcpKVReceiver:
    """Accepts handoffs on a TCP port; each verified payload goes to ``handler(ticket, payload)``,
    whose exception (or a framing/checksum error) is answered as a refusal."""

    def __init__(
        self,
        host: str,
        port: int,
        handler: Handler,
        advertise_host: str | None = None,
        on_error: Callable[[str, str | None], None] | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.handler = handler
        self.advertise_host = advertise_host or host
        self.on_error = on_error
        self.address = ""
        self._server: asyncio.base_events.Server | None = None

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._conn, self.host, self.port)
        port = self._server.sockets[0].getsockname()[1]
        self.address = f"{self.advertise_host}:{port}"
        return self.address

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        ticket: str | None = None
        try:
            try:
                ftype, body = await read_frame(reader)
                if ftype != HEADER:
                    raise TransferError(f"a KV handoff must start with a header, got type {ftype}")
                header = json.loads(body)
                ticket = str(header["ticket"])
                asm = _Assembler(header)
                while True:
                    ftype, body = await read_frame(reader)
                    if ftype == PAGE:
                        asm.page(body)
                    elif ftype == SCALES:
                        asm.set_scales(body)
                    elif ftype == GENSTATE:
                        asm.gen = torch.frombuffer(bytearray(body), dtype=torch.uint8).clone()
                    elif ftype == END:
                        payload = asm.finish(body)
                        break
                    else:
                        raise TransferError(f"unexpected frame type {ftype}")
            except (TransferError, KeyError, ValueError, TypeError) as exc:
                log.warning("KV handoff refused (ticket %s): %s", ticket, exc)
                if self.on_error:
                    self.on_error(str(exc), ticket)
                writer.write(encode_frame(ACK, json.dumps({"ok": False, "error": str(exc)}).encode()))
                await writer.drain()
                return
            try:
                await self.handler(ticket, payload)
            except Exception as exc:
                writer.write(encode_frame(ACK, json.dumps({"ok": False, "error": str(exc)}).encode()))
            else:
                writer.write(encode_frame(ACK, b'{"ok": true}'))
            await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
