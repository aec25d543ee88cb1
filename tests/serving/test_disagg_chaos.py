"""Chaos: kill -9 the decode worker of ``pagoda serve --disaggregated`` mid-stream. Its client gets an
error, the router answers 503 with Retry-After while the supervisor restarts the worker, then requests
succeed again; nobody restarts anything by hand and the router and the prefill worker keep running."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import openai
import psutil
import pytest

from pagoda.node_agent.cli.supervisor import INTERNAL_TOKEN_ENV
from pagoda.node_agent.serving.launch import wait_ready

from .conftest import CHAT, MODEL
from .live import free_port

pytestmark = [pytest.mark.slow, pytest.mark.serve, pytest.mark.timeout(600)]


def by_role(parent: psutil.Process) -> dict[str, psutil.Process]:
    """The supervisor's children by their ``--role`` argument."""
    out = {}
    for p in parent.children():
        cmd = p.cmdline()
        if "--role" in cmd:
            out[cmd[cmd.index("--role") + 1]] = p
    return out


def test_a_killed_decode_worker_is_restarted_and_service_resumes(tmp_path):
    port = free_port()
    router = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-P", "-m", "pagoda.node_agent.cli.main", "serve", "--disaggregated", "--port", str(port),
           "--dtype", "float32", "--kv-memory", "48MiB", "--max-model-len", "512"]  # fmt: skip
    log = tmp_path / "stdout"
    with log.open("w") as out:
        sup = subprocess.Popen(cmd, stdout=out)
    children: list[psutil.Process] = []
    try:
        wait_ready(router, [sup], timeout=400)
        roles = by_role(psutil.Process(sup.pid))
        children = list(roles.values())
        assert set(roles) == {"router", "prefill", "decode"}
        token = roles["decode"].environ()[INTERNAL_TOKEN_ENV]

        c = openai.OpenAI(base_url=router + "/v1", api_key="x", max_retries=0, timeout=60)
        stream = c.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=400,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        it = iter(stream)
        next(it)
        next(it)
        roles["decode"].kill()
        t_kill = time.monotonic()
        with pytest.raises(openai.APIError, match="decode worker"):
            for _ in it:
                pass

        body = {"model": MODEL, "messages": CHAT, "max_tokens": 4, "temperature": 0}
        refused = 0
        deadline = t_kill + 300
        while True:
            r = httpx.post(router + "/v1/chat/completions", json=body, timeout=60)
            if r.status_code == 200:
                break
            assert r.status_code == 503, r.text
            assert int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["code"] in ("no_worker", "worker_failed")
            refused += 1
            assert time.monotonic() < deadline, "the decode worker did not come back"
            time.sleep(0.2)
        restart_s = time.monotonic() - t_kill
        assert refused >= 1, "the first request after the kill was served by a dead worker?"
        assert r.json()["choices"][0]["message"]["content"]
        print(f"\nkill -9 decode -> first success: {restart_s:.1f}s ({refused} answers 503)")

        again = c.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=8, temperature=0, stream=True
        )
        assert "".join(ev.choices[0].delta.content or "" for ev in again if ev.choices)

        now = by_role(psutil.Process(sup.pid))
        children += [now["decode"]]
        assert now["router"].pid == roles["router"].pid and now["prefill"].pid == roles["prefill"].pid
        assert now["decode"].pid != roles["decode"].pid
        assert now["decode"].environ()[INTERNAL_TOKEN_ENV] == token  # same credentials after a restart
        assert sup.poll() is None

        sup.send_signal(signal.SIGTERM)
        assert sup.wait(60) == 0
        _, alive = psutil.wait_procs([now["router"], now["prefill"], now["decode"]], timeout=30)
        assert not alive, f"workers left running: {alive}"
        assert log.read_text().count("restarted decode") == 1
    finally:
        if sup.poll() is None:
            sup.kill()
        for child in children:  # never leave workers behind, even when the test fails
            if child.is_running():
                child.kill()
