"""Sampling: seeds reproduce, top-k 1 is greedy, stop strings cut the text, streaming adds up."""

from __future__ import annotations

from pagoda.node_agent.params import SamplingParams


def run(engine, prompt, params, chat=True):
    rid = engine.add_request(prompt, params, chat=chat)
    return engine.run_until_done()[rid]


def test_seed_reproduces_and_differs(engine):
    p = dict(max_tokens=16, temperature=1.0, top_p=0.95, ignore_eos=True)
    a = run(engine, "Tell me a story.", SamplingParams(seed=7, **p))
    b = run(engine, "Tell me a story.", SamplingParams(seed=7, **p))
    c = run(engine, "Tell me a story.", SamplingParams(seed=8, **p))
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_seeded_sampling_is_independent_of_batch_mates(engine):
    params = SamplingParams(max_tokens=12, temperature=0.9, top_k=40, seed=3, ignore_eos=True)
    alone = run(engine, "Name a color.", params).token_ids
    rid = engine.add_request("Name a color.", SamplingParams(**vars(params)), chat=True)
    for i in range(3):
        engine.add_request(
            f"Count to {i + 3}.", SamplingParams(max_tokens=10, temperature=1.0, seed=i), chat=True
        )
    assert engine.run_until_done()[rid].token_ids == alone


def test_top_k_one_is_greedy(engine):
    g = run(engine, "What is 3+4?", SamplingParams(max_tokens=10, temperature=0.0))
    k1 = run(engine, "What is 3+4?", SamplingParams(max_tokens=10, temperature=0.7, top_k=1, seed=1))
    assert g.token_ids == k1.token_ids


def test_stop_string_cuts_text(engine):
    full = run(engine, "What is the capital of France?", SamplingParams(max_tokens=12, temperature=0.0))
    assert "France" in full.text
    cut = run(
        engine,
        "What is the capital of France?",
        SamplingParams(max_tokens=12, temperature=0.0, stop=["France"]),
    )
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index("France")]


def test_stop_token_and_length(engine):
    out = run(engine, "Hello", SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    first = out.token_ids[0]
    out2 = run(engine, "Hello", SamplingParams(max_tokens=3, temperature=0.0, stop_token_ids=[first]))
    assert out2.finish_reason == "stop" and out2.token_ids == [first]


def test_streamed_deltas_add_up_to_the_text(engine):
    params = SamplingParams(max_tokens=20, temperature=0.0)
    rid = engine.add_request("Write one sentence about the sea.", params, chat=True)
    deltas, final = [], None
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == rid:
                deltas.append(o.delta)
                final = o if o.finished else final
    assert final is not None and "".join(deltas) == final.text
