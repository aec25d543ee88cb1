"""Engines shared by the format tests (built once: INT4 quantization and FP8 calibration cost)."""

from __future__ import annotations

import pytest

from pagoda.node_agent.engine.config import PhaseFormats

# INT4 weights in both phases (so a prequantized checkpoint can be compared token for token) and
# FP8 decode KV behind a bf16 prefill pool: the migration path runs on every request.
INT4_FP8 = PhaseFormats("int4", "bf16", "int4", "fp8_e4m3")


@pytest.fixture(scope="session")
def int4_fp8_engine(make_engine):
    return make_engine(formats=INT4_FP8, kv_memory=64 << 20)


@pytest.fixture(scope="session")
def int8_kv_engine(make_engine):
    """Dense weights, bf16 prefill pool, int8 decode pool."""
    return make_engine(formats=PhaseFormats("bf16", "bf16", "bf16", "int8"), kv_memory=64 << 20)


@pytest.fixture(scope="session")
def fp8_kv_engine(make_engine):
    """Dense weights, bf16 prefill pool, fp8_e4m3 decode pool."""
    return make_engine(formats=PhaseFormats("bf16", "bf16", "bf16", "fp8_e4m3"), kv_memory=64 << 20)
