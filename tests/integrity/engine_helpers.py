"""Driving a real engine (built-in model) for integrity tests: prompts, runs and a read oracle."""

from __future__ import annotations

from pagoda.node_agent.params import SamplingParams

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three colours:",
    "Explain gravity in one sentence.",
]
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def guard_reads(engine) -> list[int]:
    """Wrap the model runner: fail the test if a step would read a page whose tag changed.

    Returns a list that counts the guarded steps (so a test can see the guard ran)."""
    run = engine.runner.run
    steps: list[int] = []

    def checked(step, pool):
        for seq in step.seqs:
            for ref in seq.block_table:
                assert pool.current_tag(ref.page) == ref.tag, f"{seq.request_id} read stale page {ref.page}"
        steps.append(len(step.seqs))
        return run(step, pool)

    engine.runner.run = checked
    return steps


def run_all(engine, prompts=PROMPTS, params=PARAMS, prefix: str = "") -> dict:
    """Queue every prompt and run to completion; final outputs by request id."""
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=f"{prefix}{i}")
    return engine.run_until_done()
