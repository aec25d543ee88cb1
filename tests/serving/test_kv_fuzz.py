"""Fuzzing a LIVE decode worker's KV port (with a prefill worker and a router serving real traffic).

Over 10,000 generated malformed handoffs (garbage, bad prefixes and sizes, huge counts, wrong types,
truncation, replayed headers, wrong tokens, bad MACs, valid MACs over bad content, wrong frame
order), a fraction of them against real tickets parked through the authenticated /internal/decode
(as a router would), so the deep checks run. Meanwhile concurrent streams go through the router.
Afterwards: every parked request failed at once, no page leaked, the decode process grew by less
than 64 MB, it answered /ready throughout, and the streams' text is what it was before fuzzing.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import tempfile
import threading
import time
import zlib
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagoda.node_agent.serving.api.internal_auth import InternalAuth
from pagoda.node_agent.serving.api.metrics import metric_sum
from pagoda.node_agent.serving.launch import wait_ready

from .conftest import MODEL
from .live import free_port, wait_idle
from .test_disaggregated import TOKEN, client, spawn

pytestmark = [pytest.mark.slow, pytest.mark.serve, pytest.mark.timeout(900)]

AUTH = InternalAuth(TOKEN)
MAGIC, VERSION = b"PGKV", 2
HEADER, PAGE, SCALES, GENSTATE, END, ACK = 1, 2, 3, 4, 5, 6
BATCH = 20  # cases per hypothesis example
EXAMPLES = 520  # x BATCH > 10,000 cases
LEGIT_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "Water boils at"]
MAX_MODEL_LEN = 512
PAGE_SIZE = 16


def frame(ftype: int, body: bytes, version: int = VERSION, crc: int | None = None) -> bytes:
    c = zlib.crc32(body) if crc is None else crc
    return struct.pack("<4sBBHI", MAGIC, version, ftype, 0, len(body)) + body + struct.pack("<I", c)


def signed_header(h: Any) -> bytes:
    raw = json.dumps(h).encode()
    return frame(HEADER, AUTH.kv_mac(raw) + raw)


class Env:
    """The three processes and what a case needs to know about the model."""

    def __init__(self, urls: dict[str, str], procs: dict[str, subprocess.Popen], cfg: Any) -> None:
        self.urls = urls
        self.procs = procs
        self.layers, self.heads, self.dim, self.vocab = (
            cfg.num_layers,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.vocab_size,
        )
        self.kv_addr = ""
        self.http = httpx.Client(timeout=30)
        self.sent = Counter()
        self.replayable: list[bytes] = []  # headers already used once
        self._pages: dict[int, bytes] = {}

    def header(self, ticket: str, ntok: int = 20) -> dict[str, Any]:
        shape = [PAGE_SIZE, self.heads, self.dim]
        return {
            "ticket": ticket,
            "request_id": f"fuzz-{ticket[:8]}",
            "prompt_token_ids": [(i * 7919) % self.vocab for i in range(ntok)],
            "first_token": 5,
            "page_size": PAGE_SIZE,
            "kv_format": "bf16",
            "num_pages": -(-ntok // PAGE_SIZE),
            "num_layers": self.layers,
            "components": ["k", "v"],
            "dtype": "float32",
            "page_shape": {"k": shape, "v": shape},
            "has_scales": False,
            "scale_shape": {},
            "generator_state_len": 0,
            "num_cached_tokens": 0,
        }

    @property
    def page_bytes(self) -> int:
        return self.layers * 2 * PAGE_SIZE * self.heads * self.dim * 4

    def page(self, idx: int) -> bytes:
        """A well-formed PAGE frame of random normal values (made once per index)."""
        if idx not in self._pages:
            import numpy as np

            vals = np.random.default_rng(idx).standard_normal(self.page_bytes // 4)
            self._pages[idx] = frame(PAGE, struct.pack("<I", idx) + vals.astype(np.float32).tobytes())
        return self._pages[idx]

    def park(self, http: httpx.Client | None = None) -> tuple[str, httpx.Response, Iterator[str]]:
        """A real parked ticket, asked for as the router does; the decode stream stays open."""
        http = http or self.http
        body = {"request_id": f"fz{time.monotonic_ns()}", "params": {"max_tokens": 2, "temperature": 0}}
        req = http.build_request("POST", self.urls["decode"] + "/internal/decode", json=body)
        req.headers.update(AUTH.headers("POST", "/internal/decode"))
        resp = http.send(req, stream=True)
        assert resp.status_code == 200, resp.read()
        lines = resp.iter_lines()
        first = json.loads(next(lines))
        self.kv_addr = first["kv_address"]
        return first["ticket"], resp, lines

    def send(self, data: list[bytes], half_close: bool = True) -> dict[str, Any] | None:
        """One connection: the bytes, then the ACK (None when the worker closed without one)."""
        host, _, port = self.kv_addr.rpartition(":")
        with socket.create_connection((host, int(port)), timeout=30) as s:
            try:
                for d in data:
                    s.sendall(d)
                if half_close:
                    s.shutdown(socket.SHUT_WR)
            except OSError:
                pass  # refused early: the ACK is waiting
            buf = b""
            try:
                while True:
                    chunk = s.recv(1 << 16)
                    if not chunk:
                        break
                    buf += chunk
            except OSError:
                pass
        self.sent["connections"] += 1
        if len(buf) < 16 or buf[:4] != MAGIC or buf[5] != ACK:
            return None
        (length,) = struct.unpack_from("<I", buf, 8)
        return json.loads(buf[12 : 12 + length])


# ---------------------------------------------------------------------- the cases

JSON_JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**40), max_value=2**40),
    st.sampled_from([3e8, -1.5, float(2**64), 0.5]),
    st.text(max_size=12),
    st.lists(st.integers(min_value=-5, max_value=60000), max_size=6),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=3),
)
FIELDS = [
    "ticket",
    "request_id",
    "prompt_token_ids",
    "first_token",
    "page_size",
    "kv_format",
    "num_pages",
    "num_layers",
    "components",
    "dtype",
    "page_shape",
    "has_scales",
    "scale_shape",
    "generator_state_len",
    "num_cached_tokens",
]

CASE = st.one_of(
    st.tuples(st.just("garbage"), st.binary(min_size=1, max_size=256)),
    st.tuples(
        st.just("prefix"),
        st.integers(0, 255),  # type
        st.sampled_from([0, 1, 4, 1 << 20, (1 << 30), (1 << 32) - 1]),  # claimed length
        st.integers(0, 3),  # version
    ),
    st.tuples(st.just("bad_mac"), st.binary(min_size=0, max_size=40), st.sampled_from(FIELDS), JSON_JUNK),
    st.tuples(st.just("mac_junk"), st.sampled_from(FIELDS), JSON_JUNK),  # fake ticket: refused at claim
    st.tuples(st.just("mac_nonobject"), JSON_JUNK),
    st.tuples(st.just("truncated"), st.integers(0, 4), st.floats(0, 1)),
    st.tuples(st.just("order"), st.permutations(range(5))),
    st.tuples(st.just("bad_crc"), st.integers(0, 2)),
    st.tuples(st.just("replay")),
    # against a real parked ticket: the deep checks run and the parked request must fail at once
    st.tuples(st.just("real_field"), st.sampled_from(FIELDS[1:]), JSON_JUNK),
    st.tuples(st.just("real_tokens"), st.sampled_from([-1, 49152, 10**9, 2.5, True, "7"])),
    st.tuples(st.just("real_count"), st.sampled_from([0, -3, 300_000_000, 3e8, True, None, "2", 2])),
    st.tuples(st.just("real_frames"), st.integers(0, 6)),
    st.tuples(st.just("real_valid")),
)
REAL_PERCENT = 16  # of the drawn real-ticket cases, those run as such (each costs an HTTP round trip)


def run_case(env: Env, gate: int, case: tuple) -> None:
    kind = case[0]
    if kind.startswith("real") and gate >= REAL_PERCENT:
        kind, case = "mac_junk", ("mac_junk", FIELDS[gate % len(FIELDS)], gate)
    fake = f"fake{os.urandom(6).hex()}"
    h = env.header(fake)
    pages = [env.page(i) for i in range(2)]
    end = frame(END, struct.pack("<I", 2))
    env.sent[kind] += 1
    if kind == "garbage":
        env.send([case[1]])
    elif kind == "prefix":
        _, ftype, length, version = case
        env.send([struct.pack("<4sBBHI", MAGIC, version, ftype, 0, length) + os.urandom(length % 61)])
    elif kind == "bad_mac":
        h[case[2]] = case[3]
        raw = json.dumps(h).encode()
        env.send([frame(HEADER, case[1][:32].ljust(32, b"\0") + raw), *pages, end])
    elif kind == "mac_junk":
        h[case[1]] = case[2]
        ack = env.send([signed_header(h)])  # refused at the header: the ACK always arrives
        assert ack is not None and not ack["ok"]
    elif kind == "mac_nonobject":
        env.send([signed_header(case[1])])
    elif kind == "truncated":
        data = b"".join([signed_header(h), *pages, end])
        cut = int(case[2] * len(data))
        ack = env.send([data[:cut]])
        assert ack is None or not ack["ok"]
    elif kind == "order":
        frames = [signed_header(h), pages[0], pages[1], end, frame(GENSTATE, b"x" * 16)]
        env.send([frames[i] for i in case[1]])
    elif kind == "bad_crc":
        frames = [signed_header(h), *pages, end]
        f = frames[case[1]]
        frames[case[1]] = f[:-4] + struct.pack("<I", zlib.crc32(f[12:-4]) ^ 1)
        env.send(frames)
    elif kind == "replay":
        if env.replayable:
            ack = env.send([env.replayable[len(env.replayable) // 2]])
            assert ack is not None and not ack["ok"] and "ticket" in ack["error"]
    else:
        real_case(env, case)


def real_case(env: Env, case: tuple) -> None:
    ticket, resp, stream = env.park()
    h = env.header(ticket)
    pages = [env.page(i) for i in range(2)]
    end = frame(END, struct.pack("<I", 2))
    kind = case[0]
    if kind == "real_field":
        h[case[1]] = case[2]
        frames = [signed_header(h), *pages, end]
    elif kind == "real_tokens":
        h["prompt_token_ids"][3] = case[1]
        frames = [signed_header(h), *pages, end]
    elif kind == "real_count":
        h["num_pages"] = case[1]
        frames = [signed_header(h), *pages, end]
    elif kind == "real_frames":
        variants = [
            [signed_header(h), pages[0], end],  # a page missing
            [signed_header(h), pages[0], pages[0], end],  # a page twice
            [signed_header(h), pages[1], pages[0], frame(SCALES, b"\0" * 8), end],  # scales on float pages
            [signed_header(h), pages[0][:-100]],  # truncated mid-page
            [signed_header(h), frame(PAGE, b"\0" * 10), end],  # a short page
            [signed_header(h), pages[0], pages[1], frame(END, struct.pack("<I", 9))],  # END miscounts
            [signed_header(h), pages[0], frame(PAGE, b"\xff" * 8 + pages[1][20:-4]), end],  # bad index
        ]
        frames = variants[case[1]]
    else:  # real_valid: a well-formed handoff of random pages is decoded (2 tokens) and ends
        frames = [signed_header(h), *pages, end]
    ack = env.send(frames)
    env.replayable.append(frames[0])
    env.replayable[:] = env.replayable[-50:]
    lines = [json.loads(x) for x in stream if x.strip()]
    resp.close()
    if kind == "real_valid" or (ack is not None and ack["ok"]):
        assert ack is not None and ack["ok"] and lines and "chunk" in lines[-1], (case, ack, lines[-1:])
        assert lines[-1]["chunk"]["finished"]
    else:
        assert ack is None or not ack["ok"], (case, ack)
        # the parked request failed at once (its timeout is 120 s; the read timeout is 30 s)
        assert lines and lines[-1]["error"]["code"] == "kv_transfer_failed", (case, ack, lines)
    env.sent["real"] += 1


# ---------------------------------------------------------------------- the live stack


@pytest.fixture(scope="module")
def fuzz_env(builtin_loaded):
    pp, dp, rp = free_port(), free_port(), free_port()
    log = tempfile.TemporaryFile()  # the decode worker's log: never a pipe that could fill and block it
    kv = ["--kv-port", str(free_port()), "--kv-frame-timeout", "0.5", "--kv-handoff-deadline", "5"]
    procs = {"prefill": spawn("prefill", pp), "decode": spawn("decode", dp, *kv, stderr=log)}
    try:
        wait_ready(f"http://127.0.0.1:{pp}", list(procs.values()), 400)
        wait_ready(f"http://127.0.0.1:{dp}", list(procs.values()), 400)
        ends = [
            "--prefill-endpoints",
            f"http://127.0.0.1:{pp}",
            "--decode-endpoints",
            f"http://127.0.0.1:{dp}",
        ]
        procs["router"] = spawn("router", rp, *ends)
        wait_ready(f"http://127.0.0.1:{rp}", list(procs.values()), 60)
        urls = {
            "router": f"http://127.0.0.1:{rp}",
            "prefill": f"http://127.0.0.1:{pp}",
            "decode": f"http://127.0.0.1:{dp}",
        }
        yield Env(urls, procs, builtin_loaded.config)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
        for p in procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        log.close()


def legit_round(router: str) -> dict[str, str]:
    """The prompts streamed concurrently through the router (greedy)."""

    def one(prompt: str) -> str:
        c = client(router)
        parts = [
            ev.choices[0].text
            for ev in c.completions.create(
                model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True
            )
            if ev.choices
        ]
        return "".join(parts)

    with ThreadPoolExecutor(len(LEGIT_PROMPTS)) as ex:
        return dict(zip(LEGIT_PROMPTS, ex.map(one, LEGIT_PROMPTS), strict=True))


def test_the_decode_worker_survives_kv_fuzzing(fuzz_env: Env) -> None:
    env = fuzz_env
    baseline = legit_round(env.urls["router"])
    env.park()[1].close()  # learns the KV address (that parked request goes away with its stream)
    wait_idle(env.urls["decode"])
    proc = psutil.Process(env.procs["decode"].pid)
    rss0 = proc.memory_info().rss

    stop = threading.Event()
    not_ready: list[int] = []
    legit: list[dict[str, str]] = []
    errors: list[BaseException] = []

    def watch_ready() -> None:
        with httpx.Client(timeout=10) as h:
            while not stop.is_set():
                r = h.get(env.urls["decode"] + "/ready")
                if r.status_code != 200:
                    not_ready.append(r.status_code)
                stop.wait(0.2)

    def traffic() -> None:
        try:
            while not stop.is_set() or not legit:
                legit.append(legit_round(env.urls["router"]))
        except BaseException as exc:
            errors.append(exc)

    def stalls() -> None:  # senders that stop mid-frame: cut off after the frame timeout, one at a time
        try:
            with httpx.Client(timeout=30) as http:
                for i in range(6):
                    if i % 2:  # mid-header, no ticket yet
                        ack = env.send([signed_header(env.header(f"stall{i}"))[:40]], half_close=False)
                        assert ack is not None and not ack["ok"] and "within" in ack["error"]
                        continue
                    ticket, resp, stream = env.park(http)  # mid-page of a real ticket: fails at once
                    ack = env.send([signed_header(env.header(ticket)), env.page(0)[:5000]], half_close=False)
                    assert ack is not None and not ack["ok"] and "within" in ack["error"]
                    lines = [json.loads(x) for x in stream if x.strip()]
                    resp.close()
                    assert lines[-1]["error"]["code"] == "kv_transfer_failed", lines
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=f, daemon=True) for f in (watch_ready, traffic, stalls)]
    for t in threads:
        t.start()
    t0 = time.monotonic()

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.lists(st.tuples(st.integers(0, 99), CASE), min_size=BATCH, max_size=BATCH))
    def fuzz(cases: list[tuple[int, tuple]]) -> None:
        for gate, case in cases:
            run_case(env, gate, case)

    try:
        fuzz()
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    fuzz_s = time.monotonic() - t0
    assert not errors, errors
    m = wait_idle(env.urls["decode"], timeout=30)
    rss1 = proc.memory_info().rss
    print(
        f"\nKV fuzz: {env.sent['connections']} connections ({dict(env.sent)}) in {fuzz_s:.1f}s; "
        f"decode RSS {rss0 / 2**20:.1f} -> {rss1 / 2**20:.1f} MiB ({(rss1 - rss0) / 2**20:+.1f} MiB); "
        f"{len(legit)} rounds of {len(LEGIT_PROMPTS)} legitimate streams"
    )
    assert env.sent["connections"] >= 10_000 and env.sent["real"] >= 100
    assert metric_sum(m, "pagoda_kv_pages_used") == 0, "a refused handoff leaked pages"
    assert rss1 - rss0 < 64 * 2**20
    assert not not_ready, f"the decode worker was not ready {len(not_ready)} times"
    assert legit and all(r == baseline for r in legit), (baseline, legit)
    assert metric_sum(m, "pagoda_auth_failures_total", plane="kv") > 0
    assert metric_sum(m, "pagoda_kv_transfer_failures_total", reason="invalid") > 0
    stalled = sum(
        metric_sum(m, "pagoda_kv_transfer_failures_total", reason=r) for r in ("timeout", "auth_timeout")
    )
    assert stalled >= 6  # mid-page stalls hit the frame timeout, mid-header ones the auth deadline
