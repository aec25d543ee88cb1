"""SamplingParams.validate: seeds and max_tokens are plain integers in range; every accepted seed seeds."""

from __future__ import annotations

import pytest
import torch

from pagoda.node_agent.engine.sampling import sample
from pagoda.node_agent.engine.sequence import Sequence
from pagoda.node_agent.params import SEED_MAX, SEED_MIN, RequestError, SamplingParams

EXTREME_SEEDS = [SEED_MIN, SEED_MIN + 1, -1, 0, 1, 2**63 - 1, 2**63, SEED_MAX]


@pytest.mark.parametrize(
    "seed", [True, False, 1.0, "7", SEED_MAX + 1, SEED_MIN - 1, 2**200, -(2**200), [1], 1j]
)
def test_bad_seed_is_a_request_error(seed):
    with pytest.raises(RequestError, match="^seed: "):
        SamplingParams(seed=seed).validate()


@pytest.mark.parametrize("max_tokens", [True, False, 1.0, 3.5, "4", None, 0, -1])
def test_bad_max_tokens_is_a_request_error(max_tokens):
    with pytest.raises(RequestError, match="max_tokens"):
        SamplingParams(max_tokens=max_tokens).validate()


@pytest.mark.parametrize(
    "kw,field",
    [
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"temperature": "0.5"}, "temperature"),
        ({"top_p": "1"}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_k": 2.0}, "top_k"),
        ({"top_k": True}, "top_k"),
    ],
)
def test_bad_number_types_are_request_errors(kw, field):
    with pytest.raises(RequestError, match=field) as e:
        SamplingParams(**kw).validate()
    assert e.value.param == field  # set where it is raised, not read back from the message


@pytest.mark.parametrize(
    "kw,field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"seed": 2**200}, "seed"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_every_validation_error_carries_its_field(kw, field):
    with pytest.raises(RequestError) as e:
        SamplingParams(**kw).validate()
    assert e.value.param == field


@pytest.mark.parametrize("seed", [None, *EXTREME_SEEDS])
def test_every_accepted_seed_seeds_a_generator_and_samples(seed):
    params = SamplingParams(max_tokens=1, temperature=1.0, seed=seed)
    params.validate()
    seq = Sequence("r", [1, 2], params)
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    first = sample(logits, [seq]).tokens
    assert 0 <= first[0] < 50
    if seed is None:
        assert seq.generator is None
        return
    assert seq.generator.initial_seed() == seed % 2**64  # negative seeds wrap, none overflows
    assert sample(logits, [Sequence("r", [1, 2], params)]).tokens == first  # the seed decides the draw


def test_extreme_seeds_give_distinct_streams_modulo_2_64():
    """Seeds are taken modulo 2**64 (-1 and 2**64 - 1 are one stream); distinct residues differ."""
    states = {bytes(Sequence("r", [1], SamplingParams(seed=s)).generator.get_state()) for s in EXTREME_SEEDS}
    assert len(states) == len({s % 2**64 for s in EXTREME_SEEDS}) == len(EXTREME_SEEDS) - 2


@pytest.mark.parametrize("temperature", [5e-324, 1e-310, 1e-45, 1e-40, 1e-30, 1e-8])
@pytest.mark.parametrize("seed", [None, 3])
@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (5, 0.5)])
def test_a_tiny_temperature_samples_the_top_token_instead_of_failing(temperature, seed, top_k, top_p):
    """Any accepted temperature samples: a subnormal one once made NaN probabilities (a 500 the API
    fuzz test found); at these temperatures the draw is the top token."""
    params = SamplingParams(max_tokens=1, temperature=temperature, seed=seed, top_k=top_k, top_p=top_p)
    params.validate()
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(1))
    seqs = [Sequence("a", [1], params), Sequence("b", [1], params)]
    assert sample(logits, seqs).tokens == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize(
    "bias",
    [
        {5: 101},
        {5: -100.5},
        {5: float("nan")},
        {5: float("inf")},
        {5: "1"},
        {5: True},
        {-1: 1},
        {"5": 1},
        {True: 1},
        {i: 1 for i in range(1025)},
        [5],
    ],
)
def test_bad_logit_bias_is_a_request_error_naming_it(bias):
    with pytest.raises(RequestError) as e:
        SamplingParams(logit_bias=bias).validate()
    assert e.value.param == "logit_bias"


def test_logit_bias_crosses_the_internal_plane_and_is_checked_on_arrival():
    from pagoda.node_agent.params import params_from_json, params_to_json

    p = SamplingParams(logit_bias={7: -100, 12: 2.5})
    d = params_to_json(p)
    assert d["logit_bias"] == {"7": -100, "12": 2.5}  # JSON object keys are strings
    assert params_from_json(d).logit_bias == {7: -100, 12: 2.5}
    for bad in ({"x7": 1}, {"7": 500}, {" 7": 1}, {"7" * 13: 1}):
        with pytest.raises(RequestError) as e:
            params_from_json({**d, "logit_bias": bad})
        assert e.value.param == "logit_bias"


def test_logit_bias_bans_forces_and_never_leaves_a_row_without_a_token():
    from pagoda.node_agent.engine.sampling import apply_logit_bias

    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]] * 3)
    seqs = [
        Sequence("ban", [1], SamplingParams(temperature=0.0, logit_bias={0: -100})),
        Sequence("force", [1], SamplingParams(temperature=0.0, logit_bias={3: 100})),
        Sequence("plain", [1], SamplingParams(temperature=0.0)),
    ]
    assert sample(logits.clone(), seqs).tokens == [1, 3, 0]
    # sampling rows draw from the biased distribution: a banned token never comes out
    hot = [
        Sequence(f"s{i}", [1], SamplingParams(temperature=2.0, seed=i, logit_bias={0: -100, 1: -100}))
        for i in range(40)
    ]
    assert all(t in (2, 3) for t in sample(torch.zeros(40, 4), hot).tokens)
    # a constrained row whose every allowed token is banned keeps its logits unbiased, and so does
    # a row whose whole vocabulary is banned; the rows beside them keep their biases
    masked = torch.tensor([[float("-inf"), 1.0, float("-inf"), float("-inf")], [0.0, 1.0, 2.0, 3.0]])
    grammar = [Sequence("g", [1], SamplingParams(temperature=0.0, logit_bias={1: -100}))]
    grammar[0].grammar = object()  # only its presence matters here
    biased = [Sequence("b", [1], SamplingParams(temperature=0.0, logit_bias={3: -100}))]
    out = masked.clone()
    apply_logit_bias(out, grammar + biased)
    assert (
        torch.equal(out[0], masked[0])
        and out[1, 3] == float("-inf")
        and torch.equal(out[1, :3], masked[1, :3])
    )
    everything = [
        Sequence("all", [1], SamplingParams(temperature=0.0, logit_bias={t: -100 for t in range(4)}))
    ]
    assert sample(logits[:1].clone(), everything).tokens == [0]  # the row's own logits' argmax, not an error
    hot_all = [
        Sequence("h", [1], SamplingParams(temperature=1.0, seed=1, logit_bias={t: -100 for t in range(4)}))
    ]
    assert sample(logits[:1].clone(), hot_all).tokens[0] in range(4)
