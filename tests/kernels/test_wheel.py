"""The built wheel alone runs the native INT4 kernel: the package data holds every source and header
the C build needs, and the build cache lies outside the (read-only) installed package."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest
import torch

from pagoda.kernels import cpu_int4_native

REPO = Path(__file__).resolve().parents[2]
PROJECT_FILES = ("pyproject.toml", "README.md", "pagoda", "operator", "node_agent", "kernels")

CHECK = textwrap.dedent(
    """
    import sys
    import pagoda.kernels
    from pagoda.kernels.selfcheck import check

    where = pagoda.kernels.__file__
    assert "site-packages" in where and not where.startswith(sys.argv[1]), where
    print(check(), where)
    """
)


@pytest.mark.slow
def test_the_wheel_alone_builds_and_runs_the_native_int4_kernel(tmp_path):
    if cpu_int4_native.compiler() is None:
        pytest.skip("no C compiler here: the installed wheel cannot build its native kernels")
    src = tmp_path / "src"  # a copy: building in place would leave build/ and egg-info in the tree
    src.mkdir()
    for name in PROJECT_FILES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy(path, src / name)
    wheels = tmp_path / "wheels"
    pip = [sys.executable, "-m", "pip"]
    run = {"check": True, "capture_output": True, "text": True, "timeout": 600}
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), str(src)], **run
    )
    (wheel,) = wheels.glob("pagoda-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], **run)
    py = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], **run
        ).stdout.strip()
    )
    # the dependencies (torch, ...) from this interpreter's site-packages, appended after the venv's own
    deps = {Path(torch.__file__).resolve().parents[1], Path(sysconfig.get_paths()["purelib"])}
    (site / "_pagoda_test_deps.pth").write_text("".join(f"{d}\n" for d in sorted(deps)))
    subprocess.run([*pip, "--python", str(py), "install", "--no-deps", "-q", str(wheel)], **run)
    installed = site / "pagoda" / "kernels"
    assert {p.name for p in installed.glob("*.h")} >= set(cpu_int4_native.HEADER_NAMES)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PAGODA_"))}
    env.update(PYTHONSAFEPATH="1", PAGODA_CACHE_DIR=str(tmp_path / "cache"))
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    done = subprocess.run([str(py), "-c", CHECK, str(REPO)], cwd=cwd, env=env, **run)
    assert "native INT4 kernel ok" in done.stdout
    assert list((tmp_path / "cache" / "kernels").glob("cpu_int4-*.so"))
