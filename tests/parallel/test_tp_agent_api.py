"""The agent API on a tensor-parallel replica of two ranks: tool calls, a JSON-schema reply and
logprobs (the driver rank samples, with the grammar's mask, for both)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from pagoda.node_agent.serving.launch import wait_ready

from ..serving.agent_checks import check_agent_api
from ..serving.live import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_the_agent_api_on_a_two_rank_replica(tmp_path) -> None:
    port = free_port()
    cmd = [sys.executable, "-P", "-m", "pagoda.node_agent.cli.main", "serve", "--tenant-secret", "s",
           "--port", str(port), "--kv-memory", "48MiB", "--max-num-seqs", "4", "--max-model-len", "1024",
           "--dtype", "float32", "--tensor-parallel", "2", "--dist-port", str(free_port())]  # fmt: skip
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    log = tmp_path / "serve.log"
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, [proc], timeout=300)
        check_agent_api(url)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0, log.read_text()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
