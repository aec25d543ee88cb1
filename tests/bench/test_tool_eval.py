"""``pagoda eval --tools`` runs briefly: rows per format and mode, rates that match their counts,
the grammar's replies all valid, and the PNG."""

from __future__ import annotations

import json

import pytest

from pagoda.node_agent.cli.main import main

from .shape import check_png


@pytest.mark.slow
def test_eval_tools_scores_constrained_and_free_replies(no_reload, tmp_path) -> None:
    out = tmp_path / "tools.json"
    argv = ["eval", "--tools", "--dtype", "float32", "--formats", "bf16/bf16", "--kv-memory", "32MiB"]
    assert main([*argv, "--num-prompts", "3", "--max-new-tokens", "64", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["kind"] == "eval-tools" and res["max_tokens"] == 64
    rows = {r["mode"]: r for r in res["rows"]}
    assert set(rows) == {"constrained", "unconstrained"}
    for r in rows.values():
        assert r["formats"] == "bf16/bf16" and r["tool_parser"] == "generic" and r["cases"] == 3
        assert r["validity"] == r["valid"] / 3 and r["exact_match"] == r["exact"] / 3
        assert r["exact"] <= r["valid"] or r["mode"] == "unconstrained"
    assert rows["constrained"]["valid"] == 3  # the envelope's grammar: valid by construction
    check_png(out)
