"""Bad input fails early with a message that names the problem."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagoda.node_agent.engine.config import ConfigError, EngineConfig, PhaseFormats, parse_bytes
from pagoda.node_agent.models.config import ModelLoadError
from pagoda.node_agent.models.loader import load_model
from pagoda.node_agent.params import RequestError, SamplingParams


def test_empty_prompt(engine):
    with pytest.raises(RequestError, match="empty"):
        engine.add_request("", SamplingParams())
    with pytest.raises(RequestError, match="empty"):
        engine.add_request([], SamplingParams())


@pytest.mark.parametrize("bad", [0, -3])
def test_non_positive_max_tokens(engine, bad):
    with pytest.raises(RequestError, match="max_tokens"):
        engine.add_request("hi", SamplingParams(max_tokens=bad))


@pytest.mark.parametrize(
    "kw,field",
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_bad_sampling_params(engine, kw, field):
    with pytest.raises(RequestError, match=field):
        engine.add_request("hi", SamplingParams(**kw))


def test_prompt_longer_than_model_is_rejected_not_truncated(make_engine):
    eng = make_engine(max_model_len=32)
    with pytest.raises(RequestError, match="model length is 32"):
        eng.add_request("word " * 40, SamplingParams())


def test_token_ids_out_of_vocab(engine):
    with pytest.raises(RequestError, match="out of range"):
        engine.add_request([1, 2, 10**7], SamplingParams())


@pytest.mark.parametrize(
    "source,msg",
    [
        ("builtin://no-such-model", "unknown built-in model"),
        ("s3://bucket/model", "unknown model source scheme"),
        ("/nonexistent/model/dir", "does not exist"),
        ("", "empty"),
    ],
)
def test_unknown_model_source(source, msg):
    with pytest.raises(ModelLoadError, match=msg):
        load_model(source)


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        load_model(str(bad))
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"\x00" * 16)
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        load_model(str(not_gguf))


def test_hf_dir_problems(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ModelLoadError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_model(str(tmp_path))


@pytest.mark.parametrize(
    "kw,msg",
    [
        ({"formats": PhaseFormats("bf16", "bf16", "int3", "bf16")}, "decode-weights must be one of"),
        ({"formats": PhaseFormats("bf16", "fp8_e5m2", "bf16", "bf16")}, "prefill-kv must be one of"),
        ({"formats": PhaseFormats("bf16", "fp8_e4m3", "bf16", "bf16")}, "cannot hand off to decode-kv bf16"),
        ({"integrity": "sometimes"}, "integrity must be one of"),
        ({"page_size": 12}, "power of two"),
        ({"dtype": "float16"}, "dtype must be"),
    ],
)
def test_bad_engine_config(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        EngineConfig(**kw).validate()


def test_parse_bytes():
    assert parse_bytes("512MiB") == 512 << 20
    assert parse_bytes("2GB") == 2_000_000_000
    with pytest.raises(ConfigError):
        parse_bytes("lots")


def test_cli_reports_errors_with_exit_code_2():
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagoda.node_agent.cli.main",
            "generate",
            "--model",
            "builtin://nope",
            "--prompt",
            "hi",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    assert "unknown built-in model 'nope'" in r.stderr
