"""Grammars compile on the serving layer's grammar threads, never on the engine thread: a request
waiting on a slow compile does not hold up another request's steps; a compile past the bound or
one xgrammar refuses is a RequestError naming the param, and nothing stays in flight."""

from __future__ import annotations

import asyncio
import json
import threading

import jsonschema
import pytest

from pagoda.node_agent.engine.guided import compile as compile_mod
from pagoda.node_agent.params import RequestError, SamplingParams
from pagoda.node_agent.serving.worker.async_engine import AsyncEngine, Submission

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}},
    "required": ["answer"],
}
SPEC = {"type": "json_schema", "schema": SCHEMA}
ASK = [{"role": "user", "content": "Is the sky blue? Answer as JSON."}]


@pytest.fixture
def held_compiles(monkeypatch):
    """Every compile waits for ``release`` (set at teardown at the latest); ``threads`` records where
    each one ran."""
    release, threads = threading.Event(), []
    real = compile_mod.compile_spec

    def slow(compiler, spec):
        threads.append(threading.current_thread().name)
        assert release.wait(300), "the test never released the compile"
        return real(compiler, spec)

    monkeypatch.setattr(compile_mod, "compile_spec", slow)
    yield release, threads
    release.set()


def serve(engine, body) -> None:
    """Run ``body(async_engine)`` on a started AsyncEngine over ``engine``, then stop it."""

    async def main():
        ae = AsyncEngine(engine).start()
        try:
            await asyncio.wait_for(body(ae), 600)
        finally:
            ae.stop()

    asyncio.run(main())


def test_a_slow_compile_does_not_hold_up_another_requests_steps(make_engine, held_compiles):
    release, threads = held_compiles
    engine = make_engine()

    async def body(ae: AsyncEngine):
        constrained = asyncio.ensure_future(
            ae.submit(ASK, SamplingParams(max_tokens=16, temperature=0.0, guided=SPEC), chat=True)
        )
        while not threads:  # its compile has started (and is held)
            await asyncio.sleep(0.01)
        plain = await ae.submit(
            "Once upon a time", SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        )
        out = await plain.final()
        assert out.finish_reason == "length" and len(out.token_ids) == 3
        assert not constrained.done()  # still compiling while the other request ran every step
        release.set()
        final = await (await constrained).final()
        assert final.finish_reason == "stop"
        jsonschema.validate(json.loads(final.text), SCHEMA)

    serve(engine, body)
    assert threads and all(t.startswith("pagoda-grammar") for t in threads)
    assert engine.grammars.compiles == 1


def test_a_compile_past_its_bound_is_refused_and_its_grammar_kept(make_engine, held_compiles):
    release, _ = held_compiles
    engine = make_engine()
    engine.grammars.timeout_s = 0.3

    async def body(ae: AsyncEngine):
        with pytest.raises(RequestError, match="did not compile within 0.3s") as e:
            await ae.submit("Hi", SamplingParams(max_tokens=2, guided=dict(SPEC, param="tools")))
        assert e.value.param == "tools" and ae.num_inflight == 0
        release.set()
        while len(engine.grammars) == 0:  # the compile ran to its end on its thread
            await asyncio.sleep(0.01)
        subs = [
            Submission("Hi", SamplingParams(max_tokens=2, temperature=0.0, guided=SPEC)) for _ in range(2)
        ]
        outs = [await s.final() for s in await ae.submit_many(subs)]
        assert [o.finish_reason for o in outs] == ["length", "length"]

    serve(engine, body)
    assert engine.grammars.compiles == 1 and engine.grammars.hits == 2


def test_a_refused_constraint_queues_nothing(make_engine):
    engine = make_engine()

    async def body(ae: AsyncEngine):
        bad = {"type": "json_schema", "schema": {"type": "nonsense"}}
        with pytest.raises(RequestError, match="cannot be compiled") as e:
            await ae.submit("Hi", SamplingParams(max_tokens=2, guided=bad))
        assert e.value.param == "response_format" and ae.num_inflight == 0
        assert not engine.has_unfinished()

    serve(engine, body)
