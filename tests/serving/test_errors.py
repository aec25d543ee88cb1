"""An API error's ``param`` comes from the RequestError's typed ``param``, never from its wording."""

from __future__ import annotations

import pytest

from pagoda.agent_report import WEIGHT_PARTS
from pagoda.node_agent.params import PROMPT, RequestError, params_from_json
from pagoda.node_agent.serving.api.errors import ApiError, request_error


@pytest.mark.parametrize(
    "message",
    [
        "top_p must be in (0, 1], got 2",  # today's wording
        "the nucleus mass is out of range",  # reworded: no field name in front
        "temperature is fine but this is about top_p",  # another field's name in front
        "prompt is not the problem here",
    ],
)
def test_rewording_a_message_does_not_change_param(message: str) -> None:
    err = request_error(RequestError(message, "top_p"), "messages")
    assert isinstance(err, ApiError) and err.status == 400 and err.code == "invalid_value"
    assert err.param == "top_p" and err.message == message


@pytest.mark.parametrize("prompt_field", ["prompt", "messages"])
def test_a_prompt_error_names_the_request_s_own_prompt_field(prompt_field: str) -> None:
    for message in ("prompt is empty", "nothing to read here", "token ids out of range"):
        assert request_error(RequestError(message, PROMPT), prompt_field).param == prompt_field


def test_an_error_about_no_field_keeps_param_null_whatever_it_says() -> None:
    assert request_error(RequestError("max_tokens prompt token ids top_k")).param is None
    assert request_error(RequestError("score needs 1..64 tokens")).body()["error"]["param"] is None


def test_a_non_request_error_while_reading_a_prompt_is_about_the_prompt() -> None:
    assert request_error(TypeError("unhashable type: 'dict'"), "messages").param == "messages"


@pytest.mark.parametrize(
    "params,param",
    [
        ({"max_tokens": "8"}, "max_tokens"),
        ({"top_p": "1"}, "top_p"),
        ({"stop_token_ids": 3}, None),
        ({"stop_token_ids": [-1]}, None),
        ({"evil": 1}, None),
        ({"top_k": -2}, "top_k"),
    ],
)
def test_the_internal_plane_s_params_json_errors_keep_their_param(params: dict, param: str | None) -> None:
    with pytest.raises(RequestError) as e:
        params_from_json(params)
    assert e.value.param == param


def test_the_metrics_weight_parts_are_the_engine_s() -> None:
    """api/metrics.py names the parts from the agent report (torch-free) instead of models/."""
    from pagoda.node_agent.models.weight_bytes import PARTS

    assert tuple(WEIGHT_PARTS) == tuple(PARTS)
