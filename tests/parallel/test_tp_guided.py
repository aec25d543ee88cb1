"""Constrained decoding on a tensor-parallel replica: rank 0 gathers the logits, masks them with the
requests' grammars and samples; the outputs hold to their schema as on one rank."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pagoda.node_agent.engine.config import ParallelConfig
from pagoda.node_agent.engine.guided import masking
from pagoda.node_agent.params import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "maximum": 120}},
    "required": ["name", "age"],
}
GUIDED = {"type": "json_schema", "schema": SCHEMA}
ASKS = ["Describe a person named Bob who is 30, as JSON.", "Describe a person named Ann who is 52, as JSON."]


def outputs(engine, params: SamplingParams) -> list:
    rids = [engine.add_request([{"role": "user", "content": a}], params, chat=True) for a in ASKS]
    done = engine.run_until_done()
    return [done[r] for r in rids]


def test_constrained_outputs_on_two_ranks_hold_to_the_schema(make_engine):
    greedy = SamplingParams(max_tokens=32, temperature=0.0, guided=GUIDED)
    sampled = SamplingParams(max_tokens=32, temperature=0.8, seed=5, guided=GUIDED)
    reference = outputs(make_engine(), greedy)
    engine = make_engine(parallel=ParallelConfig(tensor_parallel=2), kv_memory=64 << 20)
    try:
        rows = masking.stats.rows
        got = outputs(engine, greedy) + outputs(engine, sampled)
        assert masking.stats.rows > rows  # rank 0 masked the gathered logits
    finally:
        engine.close()
    for out in got:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    # two ranks change only the float32 summation order: the greedy documents agree as values
    assert [json.loads(o.text) for o in got[:2]] == [json.loads(o.text) for o in reference]
