"""The KV handoff between prefill and decode replicas of different tensor-parallel degrees.

Real ``pagoda serve --tensor-parallel 2`` processes (prefill, decode, both) over the built-in model
with the default formats (prefill bf16 KV, decode fp8 KV), TP=1 workers and the routers live in this
process: a prefill replica of TP=2 gathers every rank's KV heads into the payload, a decode replica
of TP=2 re-shards an arriving payload by head, and ``--role both`` at TP=2 migrates each rank's heads
between its two pools. Greedy text through the router (and from the TP=2 ``both``
server) equals one TP=1 engine with the same formats; a payload shaped for one rank's heads is
refused before allocation; SIGTERM stops every rank process.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from pagoda.node_agent.engine.config import PhaseFormats
from pagoda.node_agent.params import SamplingParams
from pagoda.node_agent.serving.api.internal_auth import InternalAuth
from pagoda.node_agent.serving.api.metrics import metric_sum
from pagoda.node_agent.serving.launch import wait_ready

from ..serving.apps import serve_args
from ..serving.live import LiveServer, free_port, metrics

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
serve = pytest.mark.serve

MODEL = "smollm2-135m"
TOKEN = "tp-disaggregation-test-internal-token"
KV_MEMORY = 48 << 20
ENGINE = ["--kv-memory", "48MiB", "--max-num-seqs", "8", "--max-model-len", "512"]  # default formats
MAX_TOKENS = 10
LONG = "A long shared preamble about lighthouses, keepers, storms and ships at night. " * 6
# in this order on every server: the long prompt spans 6 pages; its second request hits the prefix cache
PROMPTS = ["The capital of France is", "def fibonacci(n):", LONG, LONG]
PAGE_SIZE = 16


@dataclass
class Server:
    """One ``pagoda serve`` process (and, for TP > 1, the rank processes it started)."""

    role: str
    url: str
    proc: subprocess.Popen
    ranks: list[int] = field(default_factory=list)  # pids of its rank processes, once ready


def spawn(role: str, *extra: str) -> Server:
    port = free_port()
    cmd = [sys.executable, "-P", "-m", "pagoda.node_agent.cli.main", "serve", "--role", role]
    cmd += ["--port", str(port), "--tenant-secret", "s", *extra]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PAGODA_INTERNAL_TOKEN": TOKEN}
    for name in ("PAGODA_INTERNAL_TOKEN_FILE", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # one-host replicas: Pagoda starts its ranks itself
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return Server(role, f"http://127.0.0.1:{port}", proc)


def tp2_server(role: str) -> Server:
    """``pagoda serve --role ROLE --tensor-parallel 2``: a process that starts its rank 1 itself."""
    extra = ["--kv-port", str(free_port())] if role == "decode" else []
    return spawn(role, *ENGINE, "--tensor-parallel", "2", *extra)


def in_process(make_engine, token_file: Path, role: str, *flags: str) -> LiveServer:
    """A live TP=1 ``role`` server in this process (an engine over the session's loaded weights)."""
    from pagoda.node_agent.cli.serve import build_app

    engine = None
    if role != "router":
        engine = make_engine(
            role=role, formats=PhaseFormats(), kv_memory=KV_MEMORY, max_num_seqs=8, max_model_len=512
        )
        flags = ("--kv-port", "0", *flags)
    auth = ("--internal-token-file", str(token_file), "--tenant-secret", "s")
    return LiveServer(build_app(serve_args("--role", role, *auth, *flags), engine=engine)).start()


def children(proc: subprocess.Popen) -> list[int]:
    try:
        return [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def rank_processes(pids: list[int]) -> list[int]:
    """Those of ``pids`` that run a tensor-parallel rank (not multiprocessing's resource tracker)."""
    out = []
    for pid in pids:
        try:
            if any("spawn_main" in part for part in psutil.Process(pid).cmdline()):
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def stop(servers: list[Server]) -> list[int]:
    """SIGTERM every server, wait, kill what is left; returns the pids that outlived SIGTERM."""
    for s in servers:
        s.ranks = s.ranks or children(s.proc)
        if s.proc.poll() is None:
            s.proc.send_signal(signal.SIGTERM)
    left = []
    for s in servers:
        try:
            s.proc.wait(30)
        except subprocess.TimeoutExpired:
            left.append(s.proc.pid)
            s.proc.kill()
    deadline = time.monotonic() + 15  # the ranks leave once their rank 0 has stopped them
    pids = [p for s in servers for p in s.ranks]
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    for p in pids:
        if alive(p):
            left.append(p)
            psutil.Process(p).kill()
    return left


def reference_texts(make_engine) -> list[str]:
    """Greedy text of PROMPTS, one after the other, from one TP=1 engine with the servers' formats."""
    engine = make_engine(formats=PhaseFormats(), kv_memory=KV_MEMORY, max_num_seqs=8, max_model_len=512)
    out = []
    for p in PROMPTS:
        rid = engine.add_request(p, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
        out.append(engine.run_until_done()[rid].text)
    return out


@dataclass
class Stack:
    reference: list[str]
    urls: dict[str, str]  # workers by "ROLE-tpN", routers by "tp2->tp1" and "tp1->tp2"
    servers: list[Server]  # the TP=2 processes


@pytest.fixture(scope="module")
def stack(make_engine, tmp_path_factory):
    """The TP=2 servers as processes; the TP=1 workers and the two routers in this process (the same
    serving code, without loading the model twice more)."""
    token_file = tmp_path_factory.mktemp("tp_disagg") / "token"
    token_file.write_text(TOKEN)
    tp2 = {f"{role}-tp2": tp2_server(role) for role in ("prefill", "decode", "both")}
    servers = list(tp2.values())
    live: list[LiveServer] = []
    try:
        reference = reference_texts(make_engine)  # while the servers load
        urls = {name: s.url for name, s in tp2.items()}
        for role in ("prefill", "decode"):
            live.append(in_process(make_engine, token_file, role))
            urls[f"{role}-tp1"] = live[-1].url
        for s in servers:
            wait_ready(s.url, [s.proc for s in servers], 400)
            s.ranks = children(s.proc)
        for route, (pre, dec) in {"tp2->tp1": ("tp2", "tp1"), "tp1->tp2": ("tp1", "tp2")}.items():
            ends = (
                "--prefill-endpoints",
                urls[f"prefill-{pre}"],
                "--decode-endpoints",
                urls[f"decode-{dec}"],
            )
            live.append(in_process(make_engine, token_file, "router", *ends))
            urls[route] = live[-1].url
            wait_ready(urls[route], [s.proc for s in servers], 60)
        yield Stack(reference, urls, servers)
    finally:
        for srv in live:
            srv.stop()
        stop(servers)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)


def completions(url: str) -> tuple[list[str], list[int], int]:
    """(greedy text, cached prompt tokens) of PROMPTS in order, and the pages their prompts span."""
    c = client(url)
    texts, cached, pages = [], [], 0
    for p in PROMPTS:
        r = c.completions.create(model=MODEL, prompt=p, max_tokens=MAX_TOKENS, temperature=0)
        texts.append(r.choices[0].text)
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        pages += -(-r.usage.prompt_tokens // PAGE_SIZE)
    return texts, cached, pages


@serve
def test_each_tp2_server_runs_its_rank_1(stack) -> None:
    for s in stack.servers:
        assert len(rank_processes(s.ranks)) == 1, (s.role, s.ranks)


@serve
@pytest.mark.parametrize("route", ["tp2->tp1", "tp1->tp2"])
def test_handoff_between_degrees_is_token_identical_to_tp1(stack, route) -> None:
    texts, cached, pages = completions(stack.urls[route])
    assert texts == stack.reference
    assert cached[:3] == [0, 0, 0] and cached[3] >= 5 * PAGE_SIZE  # the second LONG: 5 whole pages
    assert pages >= 1 + 1 + 6 + 6  # a handoff carries all of its prompt's pages, cached or not
    pre, dec = route.split("->")
    sent = metrics(stack.urls[f"prefill-{pre}"])
    got = metrics(stack.urls[f"decode-{dec}"])
    assert metric_sum(sent, "pagoda_kv_transfer_pages_total", direction="sent") == pages
    assert metric_sum(got, "pagoda_kv_transfer_pages_total", direction="received") == pages


@serve
def test_role_both_at_tp2_migrates_to_fp8_like_tp1(stack) -> None:
    texts, cached, _ = completions(stack.urls["both-tp2"])
    assert texts == stack.reference
    assert cached[3] >= 5 * PAGE_SIZE


# ------------------------------------------------------------------------ a malformed handoff

AUTH = InternalAuth(TOKEN)
KV_MAGIC, KV_VERSION, HEADER, ACK = b"PGKV", 2, 1, 6


def frame(ftype: int, body: bytes) -> bytes:
    head = struct.pack("<4sBBHI", KV_MAGIC, KV_VERSION, ftype, 0, len(body))
    return head + body + struct.pack("<I", zlib.crc32(body))


def park(decode_url: str, http: httpx.Client) -> tuple[dict, Iterator[str]]:
    """A parked decode request, asked for as the router does: (its first line, its further lines)."""
    body = {"request_id": "malformed-handoff", "params": {"max_tokens": 2, "temperature": 0}}
    req = http.build_request("POST", decode_url + "/internal/decode", json=body)
    req.headers.update(AUTH.headers("POST", "/internal/decode"))
    resp = http.send(req, stream=True)
    assert resp.status_code == 200, resp.read()
    lines = resp.iter_lines()
    return json.loads(next(lines)), lines


def send_header(kv_address: str, header: dict) -> dict:
    """One signed HEADER frame on the KV port; returns the worker's ACK."""
    raw = json.dumps(header).encode()
    host, _, port = kv_address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(frame(HEADER, AUTH.kv_mac(raw) + raw))
        s.shutdown(socket.SHUT_WR)
        buf = b""
        while chunk := s.recv(1 << 16):
            buf += chunk
    assert buf[:4] == KV_MAGIC and buf[5] == ACK, buf[:64]
    (length,) = struct.unpack_from("<I", buf, 8)
    return json.loads(buf[12 : 12 + length])


@serve
def test_a_payload_of_one_ranks_heads_is_refused_before_allocation_at_tp2(stack) -> None:
    """SmolLM2 has 3 KV heads; rank 0 of TP=2 holds 2. A handoff must carry all 3."""
    dec = stack.urls["decode-tp2"]
    shape = [PAGE_SIZE, 2, 64]  # rank 0's share of the heads, not the model's
    used = metric_sum(metrics(dec), "pagoda_kv_pages_used")
    with httpx.Client(timeout=60) as http:
        first, rest = park(dec, http)
        header = {
            "ticket": first["ticket"],
            "request_id": "malformed-handoff",
            "prompt_token_ids": list(range(100, 120)),
            "first_token": 5,
            "page_size": PAGE_SIZE,
            "kv_format": "bf16",
            "num_pages": 2,
            "num_layers": 30,
            "components": ["k", "v"],
            "dtype": "float32",
            "page_shape": {"k": shape, "v": shape},
            "has_scales": False,
            "scale_shape": {},
            "generator_state_len": 0,
            "num_cached_tokens": 0,
        }
        ack = send_header(first["kv_address"], header)
        lines = [json.loads(x) for x in rest if x.strip()]
    assert not ack["ok"]
    assert ack["error"] == "KV header: page_shape[k] must be [16, 3, 64], got [16, 2, 64]"
    assert lines[-1]["error"]["code"] == "kv_transfer_failed"  # the parked request failed at once
    m = metrics(dec)
    assert metric_sum(m, "pagoda_kv_pages_used") == used
    assert metric_sum(m, "pagoda_kv_transfer_failures_total") >= 1
    assert httpx.get(dec + "/ready").status_code == 200  # the replica serves on


@serve
def test_sigterm_stops_every_rank_process(stack) -> None:
    pids = [p for s in stack.servers for p in s.ranks]
    assert len(rank_processes(pids)) == 3
    left = stop(stack.servers)
    assert left == []
    assert not any(alive(p) for p in pids)
    assert [s.proc.returncode for s in stack.servers] == [0] * len(stack.servers)


# ------------------------------------------------------------------------ pages between two ranks


def test_payload_pages_are_split_and_gathered_by_head_between_two_ranks() -> None:
    """SCATTER and GATHER through ParallelDriver and Follower, beyond the servers' default formats:
    float32 and FP8 payloads (per-token K scales, static V scales), 3 KV heads as 2 + 1 and one KV
    head held by both ranks; every rank's pages and the gathered payload equal one whole-head pool."""
    import multiprocessing as mp

    from .page_transfer_ranks import run

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=run, args=(r, port, results)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(10)
            if p.exitcode is None:
                p.kill()
    assert got == {0: [], 1: []}
