"""A client that goes away (streaming or not) costs one INFO line naming the request, never an
asyncio "exception was never retrieved" traceback or any other error record."""

from __future__ import annotations

import gc
import json
import logging
import socket
import time

import httpx
import pytest

from .conftest import MODEL
from .live import wait_idle

pytestmark = [pytest.mark.serve, pytest.mark.timeout(120)]

BODY = {"model": MODEL, "prompt": "Count slowly:", "max_tokens": 200, "temperature": 0, "ignore_eos": True}


def wait_inflight(stack, n: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while stack.aengine.num_inflight != n:
        assert time.monotonic() < deadline, f"{stack.aengine.num_inflight} in flight, waited for {n}"
        time.sleep(0.02)


def settle(stack) -> None:
    """Every aborted request released, and any forgotten future collected (asyncio logs at collection)."""
    wait_inflight(stack, 0)
    wait_idle(stack.url)
    for _ in range(3):
        gc.collect()
        time.sleep(0.1)


def assert_one_clean_line(caplog) -> None:
    bad = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not bad, [r.getMessage() for r in bad]
    assert "never retrieved" not in caplog.text
    lines = [r for r in caplog.records if r.name == "pagoda.api" and "disconnected" in r.getMessage()]
    assert len(lines) == 1, caplog.text
    assert lines[0].levelno in (logging.INFO, logging.WARNING)
    assert "cmpl-" in lines[0].getMessage()  # the request's id


def test_a_non_streaming_client_that_disconnects_logs_one_line(stack, caplog) -> None:
    caplog.set_level(logging.INFO)
    data = json.dumps(BODY).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", stack.server.port), timeout=10) as s:
        s.sendall(head + data)
        wait_inflight(stack, 1)
        time.sleep(0.3)  # a few tokens in
    settle(stack)
    assert_one_clean_line(caplog)


def test_a_streaming_client_that_disconnects_logs_one_line(stack, caplog) -> None:
    caplog.set_level(logging.INFO)
    with httpx.stream("POST", stack.url + "/v1/completions", json={**BODY, "stream": True}, timeout=30) as r:
        assert next(line for line in r.iter_lines() if line.startswith("data:"))
    settle(stack)
    assert_one_clean_line(caplog)
