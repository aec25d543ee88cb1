"""Idle and slow connections held open on some ports, in a process of its own (so its work does not
share the GIL of the client it competes with): ``python hostile_conns.py N PORT=HEXPREFIX ...``.

For each port it keeps N idle connections (sending nothing) and N slow ones (sending the prefix,
then a byte every 0.2 s), reopening any the server closes. It prints ``ready OPEN`` once all are
open, and ``done OPEN REOPENED`` (the connections open at the end, and how many were reopened)
when its stdin closes. Standard library only."""

from __future__ import annotations

import select
import socket
import sys
import time


def main(argv: list[str]) -> int:
    n = int(argv[0])
    prefixes = {int(p): bytes.fromhex(h) for p, _, h in (a.partition("=") for a in argv[1:])}
    socks: dict[tuple[int, str, int], socket.socket | None] = {
        (port, kind, i): None for port in prefixes for kind in ("idle", "slow") for i in range(n)
    }
    reopened = 0

    def open_one(key: tuple[int, str, int]) -> None:
        port, kind, _ = key
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.setblocking(False)
            if kind == "slow":
                s.send(prefixes[port])
            socks[key] = s
        except OSError:
            socks[key] = None

    def count() -> int:
        return sum(s is not None for s in socks.values())

    for key in socks:
        open_one(key)
    print(f"ready {count()}", flush=True)
    while True:
        stdin_ready, _, _ = select.select([sys.stdin], [], [], 0.2)
        if stdin_ready and not sys.stdin.readline():
            break
        for key, s in socks.items():
            if s is None:
                open_one(key)
                continue
            try:
                readable, _, _ = select.select([s], [], [], 0)
                if readable and not s.recv(4096):
                    raise ConnectionError("closed by the server")
                if key[1] == "slow":
                    s.send(b"x")
            except OSError:
                s.close()
                reopened += 1
                open_one(key)
        time.sleep(0)
    print(f"done {count()} {reopened}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
