"""The KV wire format: round trip, per-page checksum verified on arrival, refusals."""

from __future__ import annotations

import asyncio
import struct

import pytest
import torch

from pagoda.node_agent.engine.handoff import KVPayload
from pagoda.node_agent.serving.kv_transport import (
    PAGE,
    TcpKVReceiver,
    TcpKVSender,
    TransferError,
    payload_frames,
)

pytestmark = pytest.mark.timeout(30)


def payload(dtype=torch.float32, scales=False, pages=3) -> KVPayload:
    g = torch.Generator().manual_seed(0)
    layers = [{c: torch.randn(pages, 4, 2, 8, generator=g).to(dtype) for c in ("k", "v")} for _ in range(2)]
    sc = [{"k": torch.rand(2) + 0.5, "v": torch.rand(2) + 0.5} for _ in range(2)] if scales else None
    gen = torch.Generator().manual_seed(7).get_state()
    return KVPayload("req-1", list(range(10)), 42, 4, "fp8_e4m3" if scales else "bf16", layers, sc, gen, 4)


async def roundtrip(p: KVPayload, corrupt_page: int | None = None, refuse: bool = False):
    got: dict = {}
    errors: list[str] = []

    async def handler(ticket: str, pl: KVPayload) -> None:
        if refuse:
            raise RuntimeError("decode KV pool is full")
        got[ticket] = pl

    rx = TcpKVReceiver("127.0.0.1", 0, handler, on_error=lambda e, t: errors.append(e))
    addr = await rx.start()
    try:
        if corrupt_page is None:
            return await TcpKVSender(timeout=10).send(addr, "t1", p), got, errors
        # flip one byte inside one page's data, after its checksum was computed
        frames = payload_frames("t1", p)
        host, _, port = addr.rpartition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        for f in frames:
            if f[5] == PAGE and struct.unpack_from("<I", f, 12)[0] == corrupt_page:
                f = bytearray(f)
                f[40] ^= 0x01
                f = bytes(f)
            writer.write(f)
        await writer.drain()
        from pagoda.node_agent.serving.kv_transport import read_frame

        ftype, body = await asyncio.wait_for(read_frame(reader), 10)
        writer.close()
        return body, got, errors
    finally:
        await rx.stop()


@pytest.mark.parametrize(
    "dtype,scales", [(torch.float32, False), (torch.bfloat16, False), (torch.float8_e4m3fn, True)]
)
def test_payload_round_trips_bit_exact(dtype, scales) -> None:
    p = payload(dtype, scales)
    stats, got, errors = asyncio.run(roundtrip(p))
    q = got["t1"]
    assert stats.pages == 3 and not errors
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


def test_a_corrupted_page_fails_the_handoff() -> None:
    body, got, errors = asyncio.run(roundtrip(payload(), corrupt_page=1))
    assert b'"ok": false' in body and b"checksum mismatch in KV page 1" in body
    assert not got, "a page that fails its checksum must never reach the engine"
    assert errors and "checksum" in errors[0]


def test_a_refusal_by_the_decode_engine_reaches_the_sender() -> None:
    with pytest.raises(TransferError, match="pool is full"):
        asyncio.run(roundtrip(payload(), refuse=True))


def test_no_receiver_is_a_transfer_error() -> None:
    from .live import free_port

    with pytest.raises(TransferError, match="cannot connect"):
        asyncio.run(TcpKVSender(timeout=5).send(f"127.0.0.1:{free_port()}", "t", payload()))
