"""One engine and one live single-process server for the serving tests (started once per session)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from .live import LiveServer

MODEL = "smollm2-135m"
# prompts whose greedy answers are computed offline before the server takes over the engine
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a quiet village,"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 8


@dataclass
class Stack:
    url: str
    server: LiveServer
    aengine: object
    engine: object
    offline: dict[str, str]  # prompt -> greedy text
    offline_chat: str


def offline_greedy(engine, prompts: list[str], chat: list[dict]) -> tuple[dict[str, str], str]:
    from pagoda.node_agent.params import SamplingParams

    p = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    ids = {engine.add_request(x, p): x for x in prompts}
    chat_id = engine.add_request(chat, p, chat=True)
    final = engine.run_until_done()
    engine.decode_pool.check_idle()
    return {ids[i]: final[i].text for i in ids}, final[chat_id].text


@pytest.fixture(scope="session")
def stack(make_engine):
    """A live ``pagoda serve`` (role both) over a small KV budget: 24 MiB (~540 tokens, float32)."""
    import argparse

    from pagoda.node_agent.cli.serve import add_serve_args, build_app

    engine = make_engine(kv_memory=24 << 20, max_num_seqs=16, max_model_len=512)
    offline, offline_chat = offline_greedy(engine, PROMPTS, CHAT)
    engine.decode_pool.clear_prefix_cache()
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin://smollm2-135m")
    ap.add_argument("--no-prefix-caching", action="store_true")
    add_serve_args(ap)
    args = ap.parse_args(
        ["--tenant-secret", "test-secret", "--shared-cache-scope", "public", "--max-queue", "64"]
    )
    app = build_app(args, engine=engine)
    server = LiveServer(app).start()
    aengine = app.state.backend.engine
    try:
        yield Stack(server.url, server, aengine, engine, offline, offline_chat)
    finally:
        server.stop()
