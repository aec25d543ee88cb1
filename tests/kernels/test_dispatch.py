import logging

import pytest
import torch

from pagoda.kernels import dispatch
from pagoda.kernels.dispatch import kernel_stats, reset_kernel_stats, select_backend
from pagoda.kernels.integrity import check_page_tags


def test_cpu_device_defaults_to_cpu():
    assert select_backend(torch.device("cpu")) == "cpu"


def test_reference_on_request():
    assert select_backend(torch.device("cpu"), "reference") == "reference"


def test_env_forces_reference(monkeypatch):
    monkeypatch.setenv("PAGODA_KERNELS", "reference")
    assert select_backend(torch.device("cpu")) == "reference"
    assert select_backend(torch.device("cpu"), "cpu") == "reference"


def test_unknown_name_raises():
    with pytest.raises(ValueError, match="unknown kernel backend 'cuda-magic'.*triton, cpu, reference"):
        select_backend(torch.device("cpu"), "cuda-magic")


def test_unknown_env_raises(monkeypatch):
    monkeypatch.setenv("PAGODA_KERNELS", "fast")
    with pytest.raises(ValueError, match="PAGODA_KERNELS"):
        select_backend(torch.device("cpu"))


def test_triton_without_interpreter_falls_back(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert select_backend(torch.device("cpu"), "triton") == "cpu"


def test_triton_missing_falls_back(monkeypatch):
    monkeypatch.setattr(dispatch, "triton_available", lambda: False)
    assert select_backend(torch.device("cuda"), None) == "cpu"
    assert select_backend(torch.device("cuda"), "triton") == "cpu"


def test_cuda_with_triton_picks_triton(monkeypatch):
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    assert select_backend(torch.device("cuda")) == "triton"


def test_stats_count_calls_and_log_once(caplog):
    reset_kernel_stats()
    args = (
        torch.zeros(2, 1, dtype=torch.int32),
        torch.zeros(2, 1, dtype=torch.int32),
        torch.ones(2, dtype=torch.int32),
        torch.zeros(4, dtype=torch.int32),
    )
    dispatch._logged.discard("check_page_tags/reference")
    with caplog.at_level(logging.INFO, logger="pagoda.kernels"):
        for _ in range(3):
            check_page_tags(*args, backend="reference")
        check_page_tags(*args, backend="cpu")
    stats = kernel_stats()
    assert stats["check_page_tags/reference"] == 3
    assert stats["check_page_tags/cpu"] == 1
    lines = [
        r.getMessage() for r in caplog.records if "check_page_tags uses backend reference" in r.getMessage()
    ]
    assert len(lines) == 1
