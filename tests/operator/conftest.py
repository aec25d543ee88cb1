"""Fixtures of the operator tests: the CRD, and kopf running against kmock."""

from __future__ import annotations

import pathlib
import sys
from collections.abc import Iterator

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from op_cluster import Cluster  # noqa: E402
from op_schema import load_crd  # noqa: E402

from pagoda.operator.config import Config  # noqa: E402


@pytest.fixture(scope="session")
def crd() -> dict:
    return load_crd()


@pytest.fixture
def operator_config() -> Config:
    """Short timers so level-based repair and staleness show within a test."""
    return Config(
        resync_s=0.5,
        stale_after_s=30,
        report_interval_s=5,
        install_crd=False,
        shift_settle_s=0.5,
        secret_cache_s=0.5,
    )


@pytest.fixture
def cluster(
    operator_config: Config, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Cluster]:
    kubeconfig = tmp_path / "kubeconfig"
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    running = Cluster(operator_config, kubeconfig)
    running.start()
    try:
        yield running
    finally:
        running.stop()
