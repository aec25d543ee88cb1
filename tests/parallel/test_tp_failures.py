"""A tensor-parallel replica fails safely: a tag mismatch found on any rank fails that request on all
ranks (the others finish as they would have); a rank that dies or hangs fails the whole replica
within the collective timeout, every request in flight ends with an error naming the rank, the
server turns not ready and exits non-zero."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from pagoda.node_agent.engine.config import ConfigError, EngineConfig, ParallelConfig, PhaseFormats
from pagoda.node_agent.engine.parallel.group import ReplicaFailure
from pagoda.node_agent.params import SamplingParams
from pagoda.node_agent.serving.launch import wait_ready

from ..serving.live import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TIMEOUT_S = 8.0  # --dist-timeout of these replicas
EXIT_BOUND_S = TIMEOUT_S + 20  # the replica has exited within the timeout and start-up slack
PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def tp_engine(make_engine, **kw):
    parallel = ParallelConfig(tensor_parallel=2, dist_timeout=TIMEOUT_S)
    return make_engine(parallel=parallel, kv_memory=64 << 20, **kw)


def tokens(engine, prompts: list[str]) -> dict[str, list[int]]:
    ids = [engine.add_request(p, PARAMS) for p in prompts]
    done = engine.run_until_done()
    return {p: done[i].token_ids for p, i in zip(prompts, ids, strict=True)}


def test_a_tag_mismatch_on_one_rank_fails_that_request_on_every_rank(make_engine):
    prompts = ["The capital of France is", "def fib(n):"]
    reference = tokens(make_engine(), prompts)
    engine = tp_engine(make_engine, fault_injection=True)
    try:
        assert tokens(engine, prompts) == reference  # rank 1 holds the other heads: same tokens
        victim = engine.add_request(prompts[0], PARAMS)
        other = engine.add_request(prompts[1], PARAMS)
        for _ in range(3):
            engine.step()
        fault = engine.faults.drift_rank_tag(victim, rank=1)
        assert fault.kind == "drift_rank_tag"
        before = engine.integrity.counters.mismatches
        done = engine.run_until_done()
        assert done[victim].finish_reason == "error"
        assert "rank 1" in done[victim].error and "failing closed" in done[victim].error
        assert done[other].token_ids == reference[prompts[1]]  # its batch mate is untouched
        assert engine.integrity.counters.mismatches == before + 1
        assert engine.decode_pool.num_used == 0  # the failed request's pages went back on rank 0
        assert tokens(engine, prompts[:1]) == {prompts[0]: reference[prompts[0]]}  # still serving
    finally:
        engine.close()


def test_a_killed_rank_fails_the_replica_naming_it(make_engine):
    engine = tp_engine(make_engine)
    try:
        engine.add_request("Once upon a time", SamplingParams(max_tokens=200, ignore_eos=True))
        for _ in range(3):
            engine.step()
        child = engine.replica.group.children[1]
        os.kill(child.pid, signal.SIGKILL)
        t0 = time.monotonic()
        time.sleep(engine.replica.driver.keepalive_s)
        with pytest.raises(ReplicaFailure) as err:  # the idle loop's keepalive vote finds it
            engine.tick()
        assert time.monotonic() - t0 < TIMEOUT_S + 5
        assert "rank 1" in str(err.value) and "signal 9" in str(err.value)
        with pytest.raises(ReplicaFailure, match="rank 1"):  # and the replica stays failed
            engine.step()
    finally:
        engine.close()


def test_parallel_settings_are_checked_before_anything_starts():
    bad = [
        ParallelConfig(tensor_parallel=0),
        ParallelConfig(tensor_parallel=65),
        ParallelConfig(tensor_parallel=4, nodes=3),
        ParallelConfig(tensor_parallel=2, dist_timeout=0),
    ]
    for pc in bad:
        with pytest.raises(ConfigError):
            EngineConfig(parallel=pc).validate()
    with pytest.raises(ConfigError, match="audit"):
        EngineConfig(parallel=ParallelConfig(tensor_parallel=2), integrity="audit").validate()
    EngineConfig(parallel=ParallelConfig(tensor_parallel=4, nodes=2), formats=PhaseFormats()).validate()


# ---------------------------------------------------------------------------------- a real server


def start(tmp_path: Path) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    log = tmp_path / "server.log"
    cmd = [sys.executable, "-P", "-m", "pagoda.node_agent.cli.main", "serve", "--port", str(port),
           "--tenant-secret", "s", "--kv-memory", "64MiB", "--max-num-seqs", "4",
           "--tensor-parallel", "2", "--dist-timeout", str(TIMEOUT_S)]  # fmt: skip
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log.open("w"))
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, [proc], timeout=240)
    return proc, url, log


def rank_pids(pid: int) -> list[int]:
    """The rank processes a server started (not multiprocessing's resource tracker)."""
    import psutil

    return [c.pid for c in psutil.Process(pid).children() if "spawn_main" in " ".join(c.cmdline())]


def stream_until_error(url: str, out: dict) -> None:
    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    text = []
    try:
        for chunk in client.completions.create(
            model="smollm2-135m", prompt="Once upon a time", max_tokens=2000, stream=True,
            extra_body={"ignore_eos": True},
        ):  # fmt: skip
            text.append(chunk.choices[0].text if chunk.choices else "")
        out["ended"] = "finished"
    except Exception as exc:  # the error the client sees
        out["ended"] = f"{type(exc).__name__}: {exc}"
    out["text"] = "".join(text)


@pytest.mark.parametrize("how", ["kill", "hang"])
def test_a_server_exits_non_zero_when_a_rank_dies_or_hangs(tmp_path, how):
    proc, url, log = start(tmp_path)
    try:
        pids = rank_pids(proc.pid)
        assert len(pids) == 1, pids
        out: dict = {}
        t = threading.Thread(target=stream_until_error, args=(url, out))
        t.start()
        time.sleep(3)  # the stream is under way
        os.kill(pids[0], signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        t0 = time.monotonic()
        readiness = set()
        while proc.poll() is None and time.monotonic() - t0 < EXIT_BOUND_S:
            try:
                readiness.add(httpx.get(url + "/ready", timeout=1).status_code)
            except httpx.HTTPError:
                pass  # exiting
            time.sleep(0.02)
        try:
            code = proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the server had not exited {EXIT_BOUND_S + 5:.0f}s after the rank was hit; its log:\n"
                        + log.read_text()[-4000:])  # fmt: skip
        waited = time.monotonic() - t0
        assert 503 in readiness  # it reported not ready before it exited
        t.join(timeout=30)
        assert code == 3
        assert out["ended"] != "finished" and out["text"], out  # tokens came, then an error, no hang
        err = log.read_text()
        assert "tensor-parallel replica failed" in err and "rank 1" in err
        if how == "hang":
            assert "did not finish instruction" in err
            assert waited >= TIMEOUT_S - 1  # it waited for the collective timeout, not less
        else:
            assert "signal 9" in err
        with pytest.raises(httpx.HTTPError):
            httpx.get(url + "/ready", timeout=2)  # the server is gone
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in (p for p in [*locals().get("pids", [])]):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
