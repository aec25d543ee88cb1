"""The shared request proof: what the operator signs with pagoda/internal_proof.py is what the
engine's InternalAuth accepts, bound to method and path, and once only."""

from __future__ import annotations

from pagoda.internal_proof import HEADER, derive, request_header
from pagoda.node_agent.serving.api.internal_auth import InternalAuth

TOKEN = "a-token-of-sufficient-length-0123"


def test_the_operators_proof_opens_the_score_route_once() -> None:
    auth = InternalAuth(TOKEN)
    value = request_header(derive(TOKEN, "request"), "POST", "/internal/score")[HEADER]
    assert auth.check("POST", "/internal/score", value) is None
    assert auth.check("POST", "/internal/score", value)[1] == "replayed"
    other = request_header(derive(TOKEN, "request"), "POST", "/internal/score")[HEADER]
    assert auth.check("POST", "/internal/prefill", other)[1] == "invalid"  # bound to the path
    wrong = request_header(derive("another-token-of-enough-chars", "request"), "POST", "/internal/score")
    assert auth.check("POST", "/internal/score", wrong[HEADER])[1] == "invalid"


def test_the_engine_signs_what_the_shared_module_signs() -> None:
    clock = lambda: 1_700_000_000.0  # noqa: E731
    ours = InternalAuth(TOKEN, clock=clock).headers("GET", "/internal/state")[HEADER].split(" ")
    theirs = request_header(derive(TOKEN, "request"), "GET", "/internal/state", clock)[HEADER].split(" ")
    assert ours[:2] == theirs[:2] == ["v1", "1700000000"]
    checker = InternalAuth(TOKEN, clock=clock)
    assert checker.check("GET", "/internal/state", " ".join(ours)) is None
    assert checker.check("GET", "/internal/state", " ".join(theirs)) is None
