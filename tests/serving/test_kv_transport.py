"""The KV wire format and its receiver: round trip, per-page checksum, the header's MAC and
single-use ticket, every header check before allocation, frame bounds and order, timeouts and the
concurrency cap (an in-process receiver with the limits of a small model)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import torch

from pagoda.node_agent.engine.handoff import KVPayload
from pagoda.node_agent.serving.api.internal_auth import InternalAuth
from pagoda.node_agent.serving.worker.kv_limits import KVLimits
from pagoda.node_agent.serving.worker.kv_transport import (
    ACK,
    END,
    GENSTATE,
    HEADER,
    MAGIC,
    PAGE,
    PROGRESS_BYTES,
    SCALES,
    TcpKVReceiver,
    TcpKVSender,
    TransferError,
    encode_frame,
    header_frame,
    header_of,
    payload_frames,
    read_frame,
)

pytestmark = pytest.mark.timeout(30)

AUTH = InternalAuth("test-internal-token-0123456789")
GEN_LEN = int(torch.Generator().get_state().numel())


def payload(dtype=torch.float32, scales=False, pages=3, seed: bool = True) -> KVPayload:
    g = torch.Generator().manual_seed(0)
    layers = [{c: torch.randn(pages, 4, 2, 8, generator=g).to(dtype) for c in ("k", "v")} for _ in range(2)]
    sc = [{"k": torch.rand(2) + 0.5, "v": torch.rand(2) + 0.5} for _ in range(2)] if scales else None
    gen = torch.Generator().manual_seed(7).get_state() if seed else None
    fmt = "fp8_e4m3" if scales else "bf16"
    return KVPayload("req-1", list(range(4 * pages - 2)), 42, 4, fmt, layers, sc, gen, 4)


def limits(**kw: Any) -> KVLimits:
    kw.setdefault("free_pages", lambda: 1000)
    return KVLimits(
        num_layers=2,
        page_size=4,
        component_shapes=kw.pop("component_shapes", {"k": (2, 8), "v": (2, 8)}),
        vocab_size=100,
        max_model_len=64,
        generator_state_len=GEN_LEN,
        **kw,
    )


class Rig:
    """A receiver whose parked tickets, payloads, refusals and auth failures the test can see."""

    def __init__(self, refuse: bool = False, **limit_kw: Any) -> None:
        self.parked: set[str] = {"t1", "t2"}
        self.claimed: set[str] = set()
        self.got: dict[str, KVPayload] = {}
        self.errors: list[tuple[str, str, str | None]] = []
        self.auth_failures: list[str] = []
        self.refuse = refuse
        self.rx = TcpKVReceiver(
            "127.0.0.1",
            0,
            self.handler,
            AUTH,
            limits(**limit_kw),
            self.claim,
            on_error=lambda r, m, t: self.errors.append((r, m, t)),
            on_auth_failure=self.auth_failures.append,
        )
        self.addr = ""

    def claim(self, ticket: str) -> str | None:
        if ticket not in self.parked:
            return "unknown"
        if ticket in self.claimed:
            return "replayed"
        self.claimed.add(ticket)
        return None

    async def handler(self, ticket: str, p: KVPayload) -> None:
        if self.refuse:
            raise RuntimeError("decode KV pool is full")
        self.got[ticket] = p

    async def raw(self, frames: list[bytes], close: bool = False) -> dict[str, Any]:
        """Send raw frames and return the receiver's ACK."""
        host, _, port = self.addr.rpartition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        ack = asyncio.ensure_future(read_frame(reader, lambda t: 1 << 16 if t == ACK else -1, 10))
        try:
            with contextlib.suppress(OSError):
                for f in frames:
                    if ack.done():  # refused early: stop writing into a closed socket
                        break
                    writer.write(f)
                    await writer.drain()
                if close:
                    writer.write_eof()
            ftype, body = await ack
            assert ftype == ACK
            return json.loads(body)
        finally:
            writer.close()

    def reasons(self) -> list[str]:
        return [r for r, _, _ in self.errors]


@contextlib.asynccontextmanager
async def rig(**kw: Any) -> AsyncIterator[Rig]:
    r = Rig(**kw)
    r.addr = await r.rx.start()
    try:
        yield r
    finally:
        await r.rx.stop()


def run(coro_fn: Callable[..., Any], **kw: Any) -> Any:
    async def main() -> Any:
        async with rig(**kw) as r:
            return await coro_fn(r), r

    return asyncio.run(main())


@pytest.mark.parametrize(
    "dtype,scales", [(torch.float32, False), (torch.bfloat16, False), (torch.float8_e4m3fn, True)]
)
def test_payload_round_trips_bit_exact(dtype, scales) -> None:
    p = payload(dtype, scales)
    stats, r = run(lambda r: TcpKVSender(AUTH, timeout=10).send(r.addr, "t1", p))
    q = r.got["t1"]
    assert stats.pages == 3 and not r.errors and r.rx.reserved_pages == 0 and r.rx.active == 0
    assert (
        q.request_id,
        q.prompt_token_ids,
        q.first_token,
        q.page_size,
        q.kv_format,
        q.num_cached_tokens,
    ) == (p.request_id, p.prompt_token_ids, p.first_token, p.page_size, p.kv_format, p.num_cached_tokens)
    for a, b in zip(p.layers, q.layers, strict=True):
        for c in ("k", "v"):
            assert b[c].dtype == dtype and torch.equal(a[c].view(torch.uint8), b[c].view(torch.uint8))
    if scales:
        assert all(
            torch.equal(a[c], b[c]) for a, b in zip(p.scales, q.scales, strict=True) for c in ("k", "v")
        )
    assert torch.equal(q.generator_state, p.generator_state)


def test_a_corrupted_page_fails_the_handoff_and_its_parked_request() -> None:
    frames = payload_frames("t1", payload(), AUTH)
    bad = bytearray(frames[2])  # page 1
    bad[40] ^= 0x01
    frames[2] = bytes(bad)
    ack, r = run(lambda r: r.raw(frames))
    assert not ack["ok"] and "checksum mismatch in KV page 1" in ack["error"]
    assert not r.got, "a page that fails its checksum must never reach the engine"
    assert r.errors[0][0] == "checksum" and r.errors[0][2] == "t1"  # the claimed ticket fails at once


def test_a_refusal_by_the_decode_engine_reaches_the_sender() -> None:
    with pytest.raises(TransferError, match="pool is full"):
        run(lambda r: TcpKVSender(AUTH, timeout=10).send(r.addr, "t1", payload()), refuse=True)


def test_no_receiver_is_a_transfer_error() -> None:
    from .live import free_port

    with pytest.raises(TransferError, match="cannot connect"):
        asyncio.run(TcpKVSender(AUTH, timeout=5).send(f"127.0.0.1:{free_port()}", "t", payload()))


# ---------------------------------------------------------------------- MAC and ticket


def test_a_header_under_another_token_is_refused_before_anything() -> None:
    other = InternalAuth("another-token-entirely-different")
    ack, r = run(lambda r: r.raw(payload_frames("t1", payload(), other)))
    assert not ack["ok"] and "MAC" in ack["error"]
    assert r.auth_failures == ["bad_mac"] and r.errors == [("auth", r.errors[0][1], None)]
    assert not r.claimed, "an unauthenticated header must not consume the ticket"


def test_a_header_with_its_mac_stripped_or_truncated_is_refused() -> None:
    raw = json.dumps(header_of("t1", payload(), GEN_LEN)).encode()

    async def go(r: Rig) -> list[dict]:
        return [await r.raw([encode_frame(HEADER, body)]) for body in (raw, raw[:10], b"")]

    acks, r = run(go)
    assert all(not a["ok"] for a in acks) and r.auth_failures == ["bad_mac"] * 3 and not r.claimed


def test_a_ticket_is_single_use_and_unknown_tickets_are_refused() -> None:
    frames = payload_frames("t1", payload(), AUTH)

    async def go(r: Rig) -> tuple[dict, dict, dict]:
        return await r.raw(frames), await r.raw(frames), await r.raw(payload_frames("nope", payload(), AUTH))

    (first, replay, unknown), r = run(go)
    assert first["ok"] and not replay["ok"] and "replayed" in replay["error"]
    assert not unknown["ok"] and "unknown" in unknown["error"]
    assert r.auth_failures == ["replayed_ticket", "unknown_ticket"] and list(r.got) == ["t1"]


def test_a_header_cannot_be_moved_to_another_ticket() -> None:
    """Editing the ticket of a MAC'd header breaks its MAC."""
    frames = payload_frames("t1", payload(), AUTH)
    body = frames[0][12:-4].replace(b'"ticket": "t1"', b'"ticket": "t2"')
    frames[0] = encode_frame(HEADER, body)
    ack, r = run(lambda r: r.raw(frames))
    assert not ack["ok"] and r.auth_failures == ["bad_mac"] and not r.claimed


# ---------------------------------------------------------------------- header checks


def _set(key: str, value: Any) -> Callable[[dict], None]:
    return lambda h: h.__setitem__(key, value)


HEADER_CASES: dict[str, tuple[Callable[[dict], None], str]] = {
    "huge num_pages": (_set("num_pages", 300_000_000), "num_pages"),
    "float num_pages": (_set("num_pages", 3e8), "num_pages must be an integer"),
    "negative num_pages": (_set("num_pages", -1), "num_pages"),
    "bool num_pages": (_set("num_pages", True), "num_pages must be an integer"),
    "string num_pages": (_set("num_pages", "3"), "num_pages must be an integer"),
    "num_pages inconsistent with tokens": (_set("num_pages", 2), "need 3 pages"),
    "token outside the vocabulary": (_set("prompt_token_ids", [1, 2, 100]), "not a token id"),
    "negative token": (_set("prompt_token_ids", [1, -2, 3]), "not a token id"),
    "float token": (_set("prompt_token_ids", [1, 2.0, 3]), "not a token id"),
    "bool token": (_set("prompt_token_ids", [True, 2, 3]), "not a token id"),
    "no tokens": (_set("prompt_token_ids", []), "prompt_token_ids"),
    "tokens beyond max_model_len": (_set("prompt_token_ids", list(range(64))), "prompt_token_ids"),
    "tokens not a list": (_set("prompt_token_ids", "1 2 3"), "prompt_token_ids"),
    "first token outside the vocabulary": (_set("first_token", 100), "first_token"),
    "first token null": (_set("first_token", None), "first_token must be an integer"),
    "page size": (_set("page_size", 8), "page_size"),
    "layer count": (_set("num_layers", 3), "num_layers"),
    "components": (_set("components", ["k"]), "components"),
    "page dtype": (_set("dtype", "int64"), "not accepted"),
    "format without handoff": (_set("kv_format", "fp32"), "not accepted"),
    "format/dtype mismatch": (_set("dtype", "float8_e4m3fn"), "not accepted"),
    "float8 pages without scales": (
        lambda h: h.update(kv_format="fp8_e4m3", dtype="float8_e4m3fn"),
        "has_scales",
    ),
    "page shape": (_set("page_shape", {"k": [4, 2, 9], "v": [4, 2, 8]}), "page_shape[k]"),
    "page shape of strings": (_set("page_shape", {"k": ["4", 2, 8], "v": [4, 2, 8]}), "page_shape[k]"),
    "page shape not a dict": (_set("page_shape", [4, 2, 8]), "page_shape"),
    "scales on float pages": (_set("has_scales", True), "has_scales"),
    "scale shape on float pages": (_set("scale_shape", {"k": [2], "v": [2]}), "scale_shape"),
    "generator state size": (_set("generator_state_len", 7), "generator_state_len"),
    "cached beyond the prompt": (_set("num_cached_tokens", 11), "num_cached_tokens"),
    "request id not a string": (_set("request_id", 5), "request_id"),
    "request id too long": (_set("request_id", "r" * 300), "request_id"),
    "unknown field": (_set("evil", 1), "unknown"),
    "missing field": (lambda h: h.pop("num_layers"), "missing"),
}


@pytest.mark.parametrize("case", list(HEADER_CASES))
def test_every_header_field_is_checked_before_allocation(case: str) -> None:
    mutate, want = HEADER_CASES[case]
    h = header_of("t1", payload(), GEN_LEN)
    mutate(h)
    ack, r = run(lambda r: r.raw([header_frame(AUTH, h)]))
    assert not ack["ok"] and want in ack["error"], ack
    assert r.errors[0][0] == "invalid" and r.errors[0][2] == "t1"  # the parked request fails at once
    assert r.rx.reserved_pages == 0 and not r.got


def test_non_object_and_non_json_headers_are_refused() -> None:
    async def go(r: Rig) -> list[dict]:
        out = []
        for raw in (b"[1, 2]", b"not json", b'{"ticket": 5}', b"[" * 5000):
            out.append(await r.raw([encode_frame(HEADER, AUTH.kv_mac(raw) + raw)]))
        return out

    acks, r = run(go)
    assert all(not a["ok"] for a in acks) and r.reasons() == ["invalid"] * 4 and not r.claimed


def test_more_pages_than_the_decode_pool_has_free_is_busy() -> None:
    ack, r = run(lambda r: r.raw(payload_frames("t1", payload(), AUTH)), free_pages=lambda: 2)
    assert not ack["ok"] and "do not fit" in ack["error"] and r.reasons() == ["busy"]
    assert ack["reason"] == "busy"


def test_the_sender_learns_that_a_refusal_was_for_room() -> None:
    """A busy refusal reaches the prefill worker as such, so it answers 429 (retry), not 502."""
    with pytest.raises(TransferError) as busy:
        run(lambda r: TcpKVSender(AUTH, timeout=10).send(r.addr, "t1", payload()), free_pages=lambda: 2)
    assert busy.value.reason == "busy"
    with pytest.raises(TransferError) as refused:
        run(lambda r: TcpKVSender(AUTH, timeout=10).send(r.addr, "t1", payload()), refuse=True)
    assert refused.value.reason == "refused"


def test_a_refusal_of_a_large_handoff_is_read_by_the_sender_not_lost_in_a_reset() -> None:
    """Megabytes still on their way when the header is refused: the receiver drains them after its
    ACK instead of resetting the connection, so even a sender that writes everything before it
    reads learns the reason (and the real sender reports it as busy)."""
    g = torch.Generator().manual_seed(0)
    big = payload(pages=15)
    big.layers = [{c: torch.randn(15, 4, 64, 128, generator=g) for c in ("k", "v")} for _ in range(2)]
    shapes = {"k": (64, 128), "v": (64, 128)}
    frames = payload_frames("t1", big, AUTH)
    assert sum(map(len, frames)) > 4 << 20

    async def write_all_then_read(r: Rig) -> dict[str, Any]:
        host, _, port = r.addr.rpartition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            for f in frames:
                writer.write(f)
                await writer.drain()
            ftype, body = await read_frame(reader, lambda t: 1 << 16 if t == ACK else -1, 10)
            assert ftype == ACK
            return json.loads(body)
        finally:
            writer.close()

    ack, r = run(write_all_then_read, free_pages=lambda: 2, component_shapes=shapes)
    assert not ack["ok"] and ack["reason"] == "busy" and r.reasons() == ["busy"]
    with pytest.raises(TransferError) as busy:
        run(
            lambda r: TcpKVSender(AUTH, timeout=10).send(r.addr, "t1", big),
            free_pages=lambda: 2,
            component_shapes=shapes,
        )
    assert busy.value.reason == "busy" and "do not fit" in str(busy.value)


def _prefix(ftype: int, length: int) -> bytes:
    return struct.pack("<4sBBHI", MAGIC, 2, ftype, 0, length)


def test_frame_bounds_and_order_are_enforced() -> None:
    good = payload_frames("t1", payload(), AUTH)  # header, 3 pages, genstate, end
    cases = {
        "garbage": [b"GET / HTTP/1.1\r\n\r\n" + bytes(20)],
        "a 1 GiB header": [_prefix(HEADER, 1 << 30)],
        "a page before the header": [good[1]],
        "a 1 GiB page": [good[0], _prefix(PAGE, 1 << 30)],
        "a short page": [good[0], encode_frame(PAGE, good[1][12:-4][:-8])],
        "a page index out of range": [good[0], encode_frame(PAGE, struct.pack("<I", 7) + good[1][16:-4])],
        "a page twice": [good[0], good[1], good[1]],
        "scales on float pages": [good[0], *good[1:4], encode_frame(SCALES, bytes(64))],
        "a page after the generator state": [good[0], good[1], good[2], good[4], good[3]],
        "the end too early": [good[0], good[1], encode_frame(END, struct.pack("<I", 3))],
        "an end that miscounts": [good[0], *good[1:5], encode_frame(END, struct.pack("<I", 2))],
        "no generator state": [good[0], *good[1:4], good[5]],
        "a wrong generator state": [good[0], *good[1:4], encode_frame(GENSTATE, bytes(GEN_LEN)), good[5]],
        "an ACK from the sender": [good[0], encode_frame(ACK, b"{}")],
        "a wrong version": [good[0][:4] + b"\x07" + good[0][5:]],
    }

    async def go(r: Rig) -> dict[str, dict]:
        out = {}
        for name, frames in cases.items():
            r.claimed.clear()
            out[name] = await r.raw(frames)
        return out

    acks, r = run(go)
    assert all(not a["ok"] for a in acks.values()), {k: a for k, a in acks.items() if a["ok"]}
    assert not r.got and r.rx.reserved_pages == 0 and r.rx.active == 0
    assert set(r.reasons()) <= {"framing", "invalid"}, r.reasons()


def test_a_sender_that_stalls_mid_frame_is_cut_off_and_its_request_fails() -> None:
    good = payload_frames("t1", payload(), AUTH)

    async def go(r: Rig) -> dict:
        host, _, port = r.addr.rpartition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(good[0] + good[1][: len(good[1]) // 2])  # header, then half a page; then silence
        await writer.drain()
        ftype, body = await read_frame(reader, lambda t: 1 << 16, 10)
        writer.close()
        return json.loads(body)

    ack, r = run(go, frame_timeout_s=0.3)
    assert not ack["ok"] and "within 0.3s" in ack["error"]
    assert r.errors == [("timeout", r.errors[0][1], "t1")] and r.rx.reserved_pages == 0


def test_a_slow_trickle_hits_the_handoff_deadline() -> None:
    good = payload_frames("t1", payload(), AUTH)

    async def go(r: Rig) -> dict:
        host, _, port = r.addr.rpartition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        ack = asyncio.ensure_future(read_frame(reader, lambda t: 1 << 16, 10))
        writer.write(good[0])
        body = good[1]
        for i in range(0, len(body), 64):  # every frame within its timeout, the whole too slow
            if ack.done():
                break
            writer.write(body[i : i + 64])
            await writer.drain()
            await asyncio.sleep(0.05)
        _, raw = await ack
        writer.close()
        return json.loads(raw)

    ack, r = run(go, frame_timeout_s=5, handoff_deadline_s=0.3)
    assert not ack["ok"] and "longer than 0.3s" in ack["error"] and r.reasons() == ["timeout"]


def test_handoffs_beyond_the_cap_are_answered_busy_once_authenticated() -> None:
    """Only a verified header takes a handoff slot; one more authenticated handoff is busy."""

    async def go(r: Rig) -> dict:
        host, _, port = r.addr.rpartition(":")
        held = []
        for _ in range(2):  # two handoffs that verified their MAC, then stall
            rd, w = await asyncio.open_connection(host, int(port))
            w.write(header_frame(AUTH, header_of("t1" if not held else "t2", payload(), GEN_LEN)))
            await w.drain()
            held.append((rd, w))
        while r.rx.active < 2:
            await asyncio.sleep(0.01)
        r.parked.add("t3")
        ack = await r.raw(payload_frames("t3", payload(), AUTH))
        for _, w in held:
            w.close()
        return ack

    ack, r = run(go, max_handoffs=2)
    assert not ack["ok"] and ack["error"].startswith("busy") and "busy" in r.reasons()
    assert "t3" not in r.claimed


async def _idle(r: Rig, n: int) -> list[asyncio.StreamWriter]:
    host, _, port = r.addr.rpartition(":")
    conns = [await asyncio.open_connection(host, int(port)) for _ in range(n)]
    while r.rx.connections < n:
        await asyncio.sleep(0.01)
    return [w for _, w in conns]


def test_idle_unauthenticated_connections_hold_no_slot_and_a_handoff_still_lands() -> None:
    async def go(r: Rig) -> tuple[dict, int, int]:
        idle = await _idle(r, 12)
        held = (r.rx.active, r.rx.unauthenticated)
        ack = await r.raw(payload_frames("t1", payload(), AUTH))
        for w in idle:
            w.close()
        return ack, *held

    (ack, active, waiting), r = run(go, max_handoffs=2)
    assert ack == {"ok": True} and "t1" in r.got
    assert (active, waiting) == (0, 12)


def test_over_the_unauthenticated_caps_the_oldest_connection_is_closed() -> None:
    async def go(r: Rig) -> tuple[dict, int]:
        host, _, port = r.addr.rpartition(":")
        idle = [(await asyncio.open_connection(host, int(port)))[1] for _ in range(6)]
        while r.reasons().count("evicted") < 2:  # 6 from one peer, 4 allowed: the 2 oldest went
            await asyncio.sleep(0.01)
        ack = await r.raw(payload_frames("t1", payload(), AUTH))  # the newest: it evicts, not is evicted
        waiting = r.rx.unauthenticated
        for w in idle:
            w.close()
        return ack, waiting

    (ack, waiting), r = run(go, max_unauthenticated_per_peer=4, max_unauthenticated=8)
    assert ack == {"ok": True} and waiting == 3  # its arrival closed one more of the idle ones
    assert r.reasons().count("evicted") == 3


def test_a_sender_whose_header_is_under_way_is_evicted_after_the_silent_ones() -> None:
    """Over the per-peer cap the oldest *silent* connection goes first: one that already sent a
    frame prefix and a MAC (a legitimate sender's header arriving) is spared while newer silent
    ones come, and its handoff then lands."""
    frames = payload_frames("t1", payload(), AUTH)
    cut = PROGRESS_BYTES + 8

    async def go(r: Rig) -> tuple[dict, int]:
        host, _, port = r.addr.rpartition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(frames[0][:cut])  # its header, begun
        await writer.drain()
        while r.rx.connections < 1:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        idle = [(await asyncio.open_connection(host, int(port)))[1] for _ in range(8)]
        while r.reasons().count("evicted") < 5:  # 9 from one peer, 4 allowed
            await asyncio.sleep(0.01)
        writer.write(frames[0][cut:] + b"".join(frames[1:]))
        await writer.drain()
        ftype, body = await read_frame(reader, lambda t: 1 << 16 if t == ACK else -1, 10)
        writer.close()
        for w in idle:
            w.close()
        return json.loads(body), r.reasons().count("evicted")

    (ack, evicted), r = run(go, max_unauthenticated_per_peer=4, max_unauthenticated=16)
    assert ack == {"ok": True} and "t1" in r.got  # spared: only silent ones were closed
    assert evicted == 5


def test_a_silent_or_slow_peer_is_closed_at_the_auth_deadline_and_releases_everything() -> None:
    frame = header_frame(AUTH, header_of("t1", payload(), GEN_LEN))

    async def go(r: Rig) -> tuple[bytes, bool]:
        host, _, port = r.addr.rpartition(":")
        rd, w = await asyncio.open_connection(host, int(port))  # silent
        _, w2 = await asyncio.open_connection(host, int(port))  # a valid header, one byte a tick
        finished = False
        with contextlib.suppress(OSError):
            for b in frame:
                w2.write(bytes([b]))
                await w2.drain()
                await asyncio.sleep(0.03)
            finished = True
        silent = await asyncio.wait_for(rd.read(), 5)
        w.close()
        w2.close()
        while r.rx.connections:
            await asyncio.sleep(0.01)
        return silent, finished

    (silent, finished), r = run(go, auth_timeout_s=0.3, frame_timeout_s=5)
    assert b"auth_timeout" in silent and not finished  # the trickle was cut off before its end
    assert r.reasons() == ["auth_timeout", "auth_timeout"] and r.auth_failures == ["auth_timeout"] * 2
    assert (r.rx.active, r.rx.unauthenticated, r.rx.connections, r.rx.reserved_pages) == (0, 0, 0, 0)
    assert not r.claimed


def test_connections_beyond_the_total_cap_are_closed_at_once() -> None:
    async def go(r: Rig) -> bytes:
        idle = await _idle(r, 3)
        host, _, port = r.addr.rpartition(":")
        rd, w = await asyncio.open_connection(host, int(port))
        got = await asyncio.wait_for(rd.read(), 5)
        for x in [*idle, w]:
            x.close()
        return got

    got, r = run(go, max_connections=3)
    assert got == b"" and "conn_limit" in r.reasons()


def _poisoned(value: float, dtype=torch.float32) -> KVPayload:
    p = payload(dtype)
    p.layers[1]["v"][2, 1, 0, 3] = value  # one value of the last page of the last layer
    return p


@pytest.mark.parametrize(
    "value,dtype,reason",
    [
        (float("nan"), torch.float32, "non_finite"),
        (float("inf"), torch.bfloat16, "non_finite"),
        (-float("inf"), torch.float32, "non_finite"),
        (3e38, torch.float32, "out_of_range"),
        (3e38, torch.bfloat16, "out_of_range"),
    ],
)
def test_pages_with_non_finite_or_out_of_range_values_are_refused(value, dtype, reason) -> None:
    async def go(r: Rig) -> dict:
        return await r.raw(payload_frames("t1", _poisoned(value, dtype), AUTH))

    ack, r = run(go)
    assert not ack["ok"] and ack["reason"] == reason and "KV pages hold" in ack["error"]
    assert r.errors == [(reason, r.errors[0][1], "t1")] and not r.got and r.rx.reserved_pages == 0


def test_fp8_pages_with_a_nan_encoding_are_refused() -> None:
    p = payload(torch.float8_e4m3fn, scales=True)
    p.layers[0]["k"].view(torch.uint8)[1, 0, 0, 0] = 0xFF  # e4m3fn NaN
    ack, r = run(lambda r: r.raw(payload_frames("t1", p, AUTH)))
    assert not ack["ok"] and ack["reason"] == "non_finite"


def test_limits_bound_every_frame() -> None:
    lim = limits()
    page = 2 * 2 * 4 * 2 * 8 * 4  # layers x components x page x heads x dim x float32
    assert lim.page_bytes("float32") == page and lim.max_frame == max(lim.max_header_bytes, page + 4, GEN_LEN)
    assert lim.max_header_bytes < 10_000
