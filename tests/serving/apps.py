"""Live single-process servers with their own flags (for tests that need other flags than ``stack``)."""

from __future__ import annotations

import argparse
import socket
from collections.abc import Iterator
from contextlib import contextmanager

from .live import LiveServer


def serve_args(*flags: str) -> argparse.Namespace:
    """``pagoda serve`` arguments over the built-in model, plus ``flags``."""
    from pagoda.node_agent.cli.serve import add_serve_args

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin://smollm2-135m")
    ap.add_argument("--no-prefix-caching", action="store_true")
    add_serve_args(ap)
    return ap.parse_args(list(flags))


@contextmanager
def live_app(make_engine, *flags: str, **engine_kw) -> Iterator[tuple[LiveServer, object]]:
    """A live server (role both) over a fresh engine on the shared weights; yields (server, app)."""
    from pagoda.node_agent.cli.serve import build_app

    engine_kw.setdefault("kv_memory", 16 << 20)
    engine_kw.setdefault("max_num_seqs", 8)
    engine_kw.setdefault("max_model_len", 512)
    app = build_app(serve_args(*flags), engine=make_engine(**engine_kw))
    server = LiveServer(app).start()
    try:
        yield server, app
    finally:
        server.stop()


def read_response(s: socket.socket) -> str:
    """One whole HTTP response (headers and a Content-Length body) from a raw socket."""
    data = b""
    while b"\r\n\r\n" not in data:
        got = s.recv(65536)
        if not got:
            return data.decode("latin-1")
        data += got
    head, _, body = data.partition(b"\r\n\r\n")
    fields = [line.split(b":", 1) for line in head.split(b"\r\n")[1:] if b":" in line]
    length = next((int(v) for k, v in fields if k.strip().lower() == b"content-length"), 0)
    while len(body) < length:
        more = s.recv(65536)
        if not more:
            break
        body += more
    return (head + b"\r\n\r\n" + body).decode("latin-1")
