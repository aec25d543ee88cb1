"""The kernel selector: its table, the errors where native kernels should run and cannot, the
fallback the user may allow, and a deliberately broken ``.c`` file failing the build loudly."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from kernel_testing import native_built

from pagoda.kernels import cpu_int4_native, selector
from pagoda.kernels.selector import OPS, KernelSelectionError, select_kernels


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """The library state as before its first build, with the build cache in ``tmp_path``."""
    monkeypatch.setattr(cpu_int4_native, "_lib", None)
    monkeypatch.setattr(
        cpu_int4_native, "status", {"loaded": False, "reason": "not built yet", "compiler": None}
    )
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("PAGODA_ALLOW_KERNEL_FALLBACK", raising=False)
    return tmp_path


def _broken_sources(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in (*cpu_int4_native.SOURCE_NAMES, *cpu_int4_native.HEADER_NAMES):
        shutil.copy(cpu_int4_native.SOURCE_DIR / name, src / name)
    with (src / "cpu_int4.c").open("a") as f:
        f.write("\nint pagoda_broken(void) { return 1 +; }\n")  # a syntax error
    return src


def test_the_table_names_every_op_with_a_reason():
    sel = select_kernels("cpu", torch.float32, int4_compute="bf16")
    assert set(sel.table) == set(OPS)
    assert all(choice.backend and choice.why for choice in sel.table.values())
    assert sel.table["int4_gemm"].backend == "torch-int4pack-bf16" and sel.int4_compute == "bf16"
    d = sel.as_dict()
    assert d["device"] == "cpu" and d["dtype"] == "float32" and set(d["ops"]) == set(OPS)
    ref = select_kernels("cpu", torch.float32, backend="reference")
    assert ref.table["int4_gemm"].backend == "reference" and ref.table["decode_layers"].backend == "off"
    if native_built():
        exact = select_kernels("cpu", torch.float32)
        assert exact.int4_compute == "float32" and exact.table["int4_gemm"].backend.startswith("native")
        assert exact.table["paged_attention_decode"].backend == "native"


def test_the_table_is_logged_once_and_becomes_the_reported_one(caplog):
    sel = select_kernels("cpu", torch.bfloat16)
    sel.note("decode_layers", "off", "a test's own reason")
    with caplog.at_level(logging.INFO, logger="pagoda.kernels"):
        sel.log_table()
        sel.log_table()
    tables = [r for r in caplog.records if r.getMessage().startswith("kernels (cpu, bfloat16)")]
    assert len(tables) == 1 and "a test's own reason" in tables[0].getMessage()
    assert selector.active_selection() is sel


def test_a_broken_c_file_fails_the_build_with_the_compilers_message(tmp_path):
    if cpu_int4_native.compiler() is None:
        pytest.skip("no C compiler here: nothing to build")
    src = _broken_sources(tmp_path)
    with pytest.raises(cpu_int4_native.KernelBuildError, match="failed to build the native kernels.*error"):
        cpu_int4_native.build_library(src, tmp_path / "out")
    assert not list((tmp_path / "out").glob("*.so"))


def test_a_failed_build_with_a_compiler_is_an_error_unless_a_fallback_is_allowed(fresh_build, monkeypatch):
    if cpu_int4_native.compiler() is None:
        pytest.skip("no C compiler here: nothing to build")
    src = _broken_sources(fresh_build)
    monkeypatch.setattr(cpu_int4_native, "SOURCE_DIR", src)
    real = cpu_int4_native.build_library
    monkeypatch.setattr(cpu_int4_native, "build_library", lambda: real(src))
    with pytest.raises(KernelSelectionError, match="failed to build.*--allow-kernel-fallback"):
        select_kernels("cpu", torch.float32)
    assert cpu_int4_native.status["compiler"] is True and cpu_int4_native.status["loaded"] is False
    allowed = select_kernels("cpu", torch.float32, allow_fallback=True)
    assert allowed.int4_compute == "bf16" and allowed.table["int4_gemm"].fallback
    assert allowed.table["paged_attention_decode"].backend == "torch"
    monkeypatch.setenv("PAGODA_ALLOW_KERNEL_FALLBACK", "1")
    assert select_kernels("cpu", torch.float32).int4_compute == "bf16"


def test_no_compiler_keeps_the_bf16_fallback_and_says_so(fresh_build, monkeypatch):
    monkeypatch.setenv("CC", str(fresh_build / "no-such-cc"))
    sel = select_kernels("cpu", torch.float32)
    assert cpu_int4_native.status["compiler"] is False
    assert sel.int4_compute == "bf16" and sel.requested_int4_compute == "float32"
    row = sel.table["int4_gemm"]
    assert row.backend == "torch-int4pack-bf16" and row.fallback and "no compiler" in row.why


def test_float32_int4_with_its_kernel_switched_off_is_an_error(fresh_build, monkeypatch):
    monkeypatch.setenv("PAGODA_NATIVE_INT4", "0")
    with pytest.raises(
        KernelSelectionError, match="float32 needs the native INT4 kernel.*PAGODA_NATIVE_INT4=0"
    ):
        select_kernels("cpu", torch.float32, int4_compute="float32")
    assert select_kernels("cpu", torch.float32, int4_compute="bf16").int4_compute == "bf16"
    assert select_kernels("cpu", torch.float32, allow_fallback=True).int4_compute == "bf16"


def test_an_unwritable_cache_dir_builds_under_the_temp_dir(monkeypatch, tmp_path):
    """An installed, read-only setup (no writable home) still builds: in a per-user temp folder."""
    import os
    import tempfile

    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))
    assert cpu_int4_native.cache_dir() == tmp_path / "cache" / "kernels"
    monkeypatch.setattr(cpu_int4_native.os, "access", lambda *a: False)
    expected = Path(tempfile.gettempdir()) / f"pagoda-{os.getuid()}" / "kernels"
    assert cpu_int4_native.cache_dir() == expected
