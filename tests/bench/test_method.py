"""The common method: warm-up, interleaving order, medians and spread, paired ratios, the machine
block and the recorded command line (no model, no timing)."""

from __future__ import annotations

import shlex

import pytest

from pagoda.node_agent.bench.common import (
    Variant,
    environment,
    paired_ratio,
    run_interleaved,
    spread,
    summarize,
    write_result,
)
from pagoda.node_agent.cli.bench import command_line
from pagoda.node_agent.cli.main import build_parser


def test_warm_up_first_then_rounds_interleaved() -> None:
    calls: list[tuple[str, int]] = []

    def variant(name: str, warm: bool) -> Variant:
        def run(r: int) -> dict:
            calls.append((name, r))
            return {"x": float(r)}

        return Variant(name, run, (lambda: calls.append((name, "warm"))) if warm else None)

    runs = run_interleaved([variant("A", True), variant("B", False), variant("C", True)], repeats=2)
    assert calls == [
        ("A", "warm"),
        ("B", -1),
        ("C", "warm"),
        ("A", 0),
        ("B", 0),
        ("C", 0),
        ("A", 1),
        ("B", 1),
        ("C", 1),
    ]
    assert runs == {n: [{"x": 0.0}, {"x": 1.0}] for n in "ABC"}


def test_method_refuses_what_it_cannot_measure() -> None:
    v = Variant("A", lambda r: {})
    with pytest.raises(ValueError, match="repeats must be at least 1"):
        run_interleaved([v], 0)
    with pytest.raises(ValueError, match="distinct"):
        run_interleaved([v, v], 1)
    with pytest.raises(ValueError, match="equal, non-empty"):
        paired_ratio([1.0, 2.0], [1.0])


def test_spread_summary_and_paired_ratio() -> None:
    assert spread([3, 1, 2]) == {"median": 2.0, "min": 1.0, "max": 3.0, "runs": [3.0, 1.0, 2.0]}
    row = summarize([{"t": 4.0}, {"t": 1.0}, {"t": 2.0}], ["t"])
    assert row == {"t": 2.0, "t_min": 1.0, "t_max": 4.0, "t_runs": [4.0, 1.0, 2.0]}
    # pairs are taken per round: a slow round slows both sides and cancels out
    r = paired_ratio([10.0, 5.0, 12.0], [5.0, 2.5, 4.0])
    assert r["runs"] == [2.0, 2.0, 3.0] and r["median"] == 2.0 and r["max"] == 3.0


def test_environment_block(tmp_path) -> None:
    import torch

    env = environment("pagoda bench x")
    assert env["threads"] == torch.get_num_threads() and env["command"] == "pagoda bench x"
    assert env["machine"]["logical_cores"] >= 1 and env["machine"]["cpu"]
    assert env["versions"]["torch"] == torch.__version__
    # a result without the block gets it on writing; keys a bench set itself are kept
    res = {"bench": "k", "threads": 1}
    write_result(str(tmp_path / "r.json"), res, lambda p: p.write_bytes(b""), "pagoda bench k")
    assert res["threads"] == 1 and res["command"] == "pagoda bench k" and "machine" in res


def test_command_line_names_every_changed_flag() -> None:
    argv = ["bench", "decode", "--concurrency", "1,16", "--threads", "2", "--no-baseline", "--json", "o.json"]
    a = build_parser().parse_args(argv)
    assert command_line(a) == "pagoda bench decode --concurrency 1,16 --no-baseline --threads 2 --json o.json"
    a = build_parser().parse_args(["bench", "kv", "--repeats", "5", "--decode-kv", "fp8_e4m3"])
    assert command_line(a) == "pagoda bench kv --decode-kv fp8_e4m3 --repeats 5"
    a = build_parser().parse_args(["bench", "serve", "--llama-server-args=--no-repack -t 2"])
    line = command_line(a)
    assert line == "pagoda bench serve '--llama-server-args=--no-repack -t 2'"
    again = build_parser().parse_args(shlex.split(line)[1:])  # the line runs again as written
    assert again.llama_server_args == "--no-repack -t 2"


def test_eval_records_its_own_command_line() -> None:
    from pagoda.node_agent.cli.eval import eval_command

    a = build_parser().parse_args(["eval", "--tools", "--formats", "int4/fp8,bf16/bf16", "--threads", "1"])
    assert eval_command(a) == "pagoda eval --formats int4/fp8,bf16/bf16 --tools --threads 1"


@pytest.mark.parametrize("bench", ["decode", "kv", "weights", "integrity"])
def test_repeats_must_be_positive(bench, capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", bench, "--repeats", "0"])
    assert "must be at least 1" in capsys.readouterr().err
