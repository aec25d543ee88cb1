"""Graceful drain on SIGTERM: in a real ``pagoda serve`` process running streams finish, new requests
and the probes get 503 ``draining`` and the process exits 0; in-process servers (the same uvicorn
server, its signal handler called directly) show what is still running at the deadline ending with
an explicit error (an SSE event, a 503, a decode worker's NDJSON line) and a decode worker refusing
new handoffs; a router process exits at once on a second SIGTERM; the ``--disaggregated``
supervisor stops the router first and kills everything on a second signal."""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn

from pagoda.node_agent.cli.supervisor import ChildSpec, RestartPolicy, Supervisor
from pagoda.node_agent.serving.api.drain import DrainingServer
from pagoda.node_agent.serving.api.internal_auth import InternalAuth
from pagoda.node_agent.serving.api.metrics import metric_sum, parse_metrics
from pagoda.node_agent.serving.launch import wait_ready

from .apps import serve_args
from .live import free_port

pytestmark = [pytest.mark.serve, pytest.mark.timeout(300)]
TOKEN = "drain-test-internal-token-000000"

ENGINE = ["--dtype", "float32", "--kv-memory", "64MiB", "--max-num-seqs", "4", "--max-model-len", "1100"]


@contextmanager
def server(*flags: str) -> Iterator[tuple[subprocess.Popen, str]]:
    port = free_port()
    cmd = [sys.executable, "-P", "-m", "pagoda.node_agent.cli.main", "serve", "--port", str(port),
           "--tenant-secret", "s", *ENGINE, *flags]  # fmt: skip
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, [proc], timeout=240)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def body(max_tokens: int) -> dict:
    return {
        "model": "smollm2-135m",
        "prompt": "Once upon a time",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }


def events(lines: Iterator[str]) -> Iterator[dict | str]:
    """The data of each SSE event (``[DONE]`` as the string)."""
    for line in lines:
        if line.startswith("data: "):
            data = line[6:]
            yield data if data == "[DONE]" else json.loads(data)


def wait_draining(url: str, deadline_s: float = 30) -> httpx.Response:
    """/health once the server has taken the signal (it answers 503 from then on)."""
    end = time.monotonic() + deadline_s
    while True:
        r = httpx.get(url + "/health", timeout=5)
        if r.status_code == 503 or time.monotonic() > end:
            return r
        time.sleep(0.02)


@pytest.mark.slow
def test_sigterm_lets_streams_finish_refuses_new_requests_and_exits_0():
    with server("--drain-timeout", "120") as (proc, url), httpx.Client(base_url=url, timeout=60) as c:
        # "hold" keeps the drain open until the test has looked at the draining server, then leaves
        with c.stream("POST", "/v1/completions", json=body(1000)) as hold:
            hold_events = events(hold.iter_lines())
            assert isinstance(next(hold_events), dict)
            with c.stream("POST", "/v1/completions", json=body(12)) as short:
                short_events = events(short.iter_lines())
                first = next(short_events)
                proc.send_signal(signal.SIGTERM)
                health = wait_draining(url)
                assert health.status_code == 503 and health.json() == {"status": "draining"}
                assert httpx.get(url + "/ready", timeout=5).status_code == 503
                new = httpx.post(url + "/v1/completions", json={**body(4), "stream": False}, timeout=10)
                assert new.status_code == 503
                assert new.json()["error"]["code"] == "draining"
                assert new.headers["retry-after"] == "1"
                m = parse_metrics(httpx.get(url + "/metrics", timeout=5).text)
                assert metric_sum(m, "pagoda_draining") == 1
                rest = list(short_events)
            assert proc.poll() is None  # "hold" still runs, so the server still drains
        # "hold" closed by the client: nothing is left in flight
        assert proc.wait(timeout=60) == 0
    chunks = [first, *rest[:-1]]
    assert rest[-1] == "[DONE]"
    assert all("error" not in e for e in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(1 for e in chunks if e["choices"][0]["text"]) >= 10  # it generated through the drain


class DrainingLive:
    """The server ``pagoda serve`` runs (drain.DrainingServer) in a thread; ``sigterm`` calls its signal
    handler as the signal would (signals reach only the main thread)."""

    def __init__(self, app) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = app
        cfg = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        self.server = DrainingServer(cfg, app.state.drain)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn-drain-test", daemon=True)

    def __enter__(self) -> DrainingLive:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the test server did not start"
            time.sleep(0.05)
        return self

    def sigterm(self) -> None:
        self.server.handle_exit(signal.SIGTERM, None)

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def stopped(self, timeout: float = 30) -> bool:
        self.thread.join(timeout)
        return not self.thread.is_alive()


def test_requests_still_running_at_the_deadline_end_with_an_explicit_error(make_engine, caplog):
    """A stream gets a ``drain_timeout`` error event, a non-streaming request a 503 with that code;
    each cut is one WARNING line naming the request, never a traceback."""
    from pagoda.node_agent.cli.serve import build_app

    caplog.set_level(logging.INFO)

    engine = make_engine(kv_memory=64 << 20, max_num_seqs=4, max_model_len=1100)
    app = build_app(serve_args("--drain-timeout", "1"), engine=engine)
    answers: list[httpx.Response] = []
    with DrainingLive(app) as live, httpx.Client(base_url=live.url, timeout=60) as c:
        waiting = threading.Thread(
            target=lambda: answers.append(c.post("/v1/completions", json={**body(1000), "stream": False}))
        )
        with c.stream("POST", "/v1/completions", json=body(1000)) as long:
            got = events(long.iter_lines())
            assert isinstance(next(got), dict)
            waiting.start()
            while app.state.drain.inflight < 2:  # the non-streaming request has arrived
                time.sleep(0.01)
            live.sigterm()
            rest = list(got)  # ends when the server ends the stream
        waiting.join(60)
        assert live.stopped()
    last = rest[-1]
    assert isinstance(last, dict) and last["error"]["code"] == "drain_timeout"
    assert "drain timeout 1 s" in last["error"]["message"]
    assert all("error" not in e for e in rest[:-1])
    (answer,) = answers
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "drain_timeout"
    assert set(answer.json()["error"]) == {"message", "type", "param", "code"}
    m = parse_metrics(app.state.settings.metrics.render().decode())
    assert metric_sum(m, "pagoda_drain_cut_requests_total") == 2
    gc.collect()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], caplog.text
    cuts = [r.getMessage() for r in caplog.records if "ended at the drain deadline" in r.getMessage()]
    assert len(cuts) == 2 and all("cmpl-" in c for c in cuts), caplog.text


def signed(method: str, url: str, path: str, **kw) -> httpx.Response:
    return httpx.request(
        method, url + path, headers=InternalAuth(TOKEN).headers(method, path), timeout=30, **kw
    )


def test_a_draining_decode_worker_refuses_new_handoffs_and_ends_parked_ones_at_the_deadline(
    make_engine, tmp_path
):
    from pagoda.node_agent.cli.serve import build_app

    token = tmp_path / "token"
    token.write_text(TOKEN)
    engine = make_engine(kv_memory=16 << 20, max_num_seqs=4, max_model_len=256)
    flags = (
        "--role",
        "decode",
        "--internal-token-file",
        str(token),
        "--kv-port",
        "0",
        "--drain-timeout",
        "1",
    )
    app = build_app(serve_args(*flags), engine=engine)
    with DrainingLive(app) as live, httpx.Client(base_url=live.url, timeout=60) as c:
        path = "/internal/decode"
        headers = InternalAuth(TOKEN).headers("POST", path)
        with c.stream("POST", path, json={"params": {"max_tokens": 4}}, headers=headers) as parked:
            lines = parked.iter_lines()
            assert "ticket" in json.loads(next(lines))  # parked, waiting for its KV pages
            live.sigterm()
            assert wait_draining(live.url).json() == {"status": "draining"}
            new = signed("POST", live.url, path, json={"params": {"max_tokens": 4}})
            assert new.status_code == 503 and new.json()["error"]["code"] == "draining"
            state = signed("GET", live.url, "/internal/state")
            assert state.status_code == 503 and state.json()["error"]["code"] == "draining"
            rest = [json.loads(x) for x in lines if x.strip()]
        assert live.stopped()
    assert [r["error"]["code"] for r in rest] == ["drain_timeout"]


def test_a_second_sigterm_exits_at_once():
    """A router process with a request in flight (its body still arriving) drains on the first
    SIGTERM and exits at once, code 128 + 15, on the second."""
    port = free_port()
    cmd = [sys.executable, "-P", "-m", "pagoda.node_agent.cli.main", "serve", "--role", "router",
           "--port", str(port), "--prefill-endpoints", "http://127.0.0.1:9", "--decode-endpoints",
           "http://127.0.0.1:9", "--drain-timeout", "600"]  # fmt: skip
    env = {**os.environ, "PAGODA_INTERNAL_TOKEN": TOKEN}
    env.pop("PAGODA_INTERNAL_TOKEN_FILE", None)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < end, "the router did not start"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.1)
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{")  # fmt: skip
            time.sleep(0.2)  # let the server start reading it
            proc.send_signal(signal.SIGTERM)
            assert wait_draining(url).status_code == 503
            assert proc.poll() is None  # the request keeps it draining
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        assert b"exiting now" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------------- the --disaggregated supervisor

# records "NAME term MONOTONIC" in argv[1] on SIGTERM, then exits after argv[3] seconds (its drain)
CHILD = (
    "import signal, sys, time\n"
    "def term(*_):\n"
    "    open(sys.argv[1], 'a').write(f'{sys.argv[2]} term {time.monotonic()}\\n')\n"
    "    time.sleep(float(sys.argv[3]))\n"
    "    open(sys.argv[1], 'a').write(f'{sys.argv[2]} exit {time.monotonic()}\\n')\n"
    "    sys.exit(0)\n"
    "signal.signal(signal.SIGTERM, term)\n"
    "open(sys.argv[1], 'a').write(f'{sys.argv[2]} up 0\\n')\n"
    "while True:\n"
    "    time.sleep(0.05)\n"
)


def run_supervisor(log: Path, drain_s: float, signals: int) -> tuple[int, list[list[str]]]:
    children = [
        ChildSpec("prefill", [sys.executable, "-c", CHILD, str(log), "prefill", "0"], stage=1),
        ChildSpec("router", [sys.executable, "-c", CHILD, str(log), "router", str(drain_s)], stage=0),
        ChildSpec("decode", [sys.executable, "-c", CHILD, str(log), "decode", "0"], stage=1),
    ]
    sup = Supervisor(children, policy=RestartPolicy(stop_timeout_s=120), out=open(os.devnull, "w"))
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(sup.run()))
    thread.start()
    end = time.monotonic() + 60
    while not (log.exists() and log.read_text().count(" up ") == 3):
        assert time.monotonic() < end and thread.is_alive(), "the children did not start"
        time.sleep(0.05)
    for _ in range(signals):
        sup.request_stop()
        if signals > 1:
            while "router term" not in log.read_text():
                time.sleep(0.05)
    thread.join(60)
    assert not thread.is_alive()
    return result[0], [line.split() for line in log.read_text().splitlines()]


def test_the_supervisor_drains_the_router_before_the_workers(tmp_path):
    code, lines = run_supervisor(tmp_path / "log", drain_s=0.5, signals=1)
    assert code == 0
    events_ = [(name, what) for name, what, _ in lines if what != "up"]
    router_exit = events_.index(("router", "exit"))
    assert events_[0] == ("router", "term")
    assert {e for e in events_[router_exit + 1 :]} == {
        (n, w) for n in ("prefill", "decode") for w in ("term", "exit")
    }


def test_a_second_stop_request_kills_the_children_at_once(tmp_path):
    code, lines = run_supervisor(tmp_path / "log", drain_s=600, signals=2)
    assert code == 0
    names = [(name, what) for name, what, _ in lines if what != "up"]
    assert ("router", "exit") not in names  # killed while draining, not waited for
