"""Unknown format names and invalid combinations fail at configuration time, clearly."""

from __future__ import annotations

import pytest

from pagoda.node_agent.cli.main import main
from pagoda.node_agent.engine.config import ConfigError, EngineConfig, PhaseFormats


@pytest.mark.parametrize(
    ("formats", "message"),
    [
        (
            PhaseFormats("int3", "bf16", "int4", "fp8_e4m3"),
            "prefill-weights must be one of bf16, fp8, int4, stored",
        ),
        (PhaseFormats("fp8", "bf16", "int4", "fp8_e5m2"), "decode-kv must be one of bf16, fp8_e4m3"),
        (PhaseFormats("fp8", "fp8_e4m3", "int4", "bf16"), "cannot hand off to decode-kv bf16"),
    ],
)
def test_engine_config_rejects(formats: PhaseFormats, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        EngineConfig(formats=formats).validate()


@pytest.mark.parametrize("text", ["int4/fp9", "int5/fp8", "a/b/c", "bf16/fp8/int4/bf16"])
def test_parse_rejects(text: str) -> None:
    with pytest.raises(ConfigError):
        PhaseFormats.parse(text)


def test_parse_short_form() -> None:
    assert PhaseFormats.parse("int4/fp8").as_dict() == {
        "prefill_weights": "bf16",
        "prefill_kv": "bf16",
        "decode_weights": "int4",
        "decode_kv": "fp8_e4m3",
    }


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "--prompt", "x", "--decode-weights", "int3"], "invalid choice: 'int3'"),
        (["eval", "--formats", "int4/fp9"], "decode-kv must be one of"),
        (["quantize", "--weights", "nf4", "--out", "x"], "invalid choice: 'nf4'"),
        (["bench", "kv", "--decode-kv", "fp4"], "invalid choice: 'fp4'"),
        (["bench", "weights", "--prefill-weights", "int2"], "invalid choice: 'int2'"),
    ],
)
def test_cli_flag_errors_exit_2(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_invalid_combination_exits_2_before_loading(capsys, monkeypatch) -> None:
    import pagoda.node_agent.models.loader as loader

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    argv = ["generate", "--prompt", "x", "--prefill-kv", "fp8_e4m3", "--decode-kv", "bf16"]
    assert main(argv) == 2
    assert "cannot hand off to decode-kv bf16" in capsys.readouterr().err


def test_quantize_bad_group_size_exits_2(tmp_path, capsys) -> None:
    assert main(["quantize", "--weights", "int4", "--group-size", "100", "--out", str(tmp_path)]) == 2
    assert "group size must be one of" in capsys.readouterr().err
