"""The import rules of the design hold: the import-linter contracts pass, and the operator loads no torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_python(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    # -P: no script or working directory on sys.path, so the repository's operator/ folder can never
    # stand in for the standard library's `operator` module.
    return subprocess.run(
        [sys.executable, "-P", *args], cwd=cwd, capture_output=True, text=True, timeout=300, check=False
    )


def test_import_linter_contracts_are_kept(tmp_path: Path) -> None:
    """tools/lint_imports.py (the contracts in pyproject.toml, as `make lint` runs them) exits 0."""
    proc = run_python(str(ROOT / "tools" / "lint_imports.py"), cwd=tmp_path)
    assert proc.returncode == 0, f"lint_imports.py exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"


def test_the_operator_imports_no_engine_dependency(tmp_path: Path) -> None:
    """Every module of pagoda.operator imports without torch, transformers, triton or the node agent.

    The dev environment has all of them installed, so an import anywhere in the operator's graph
    would show up in sys.modules.
    """
    code = """
import importlib, pkgutil, sys
import pagoda.operator, pagoda.operator.main
for info in pkgutil.iter_modules(pagoda.operator.__path__, "pagoda.operator."):
    if info.name != "pagoda.operator.__main__":  # runs the operator when imported
        importlib.import_module(info.name)
banned = ("torch", "transformers", "triton", "pagoda.node_agent", "pagoda.kernels")
loaded = sorted(m for m in sys.modules if m in banned or m.startswith(tuple(b + "." for b in banned)))
assert "pagoda.operator.reconcile" in sys.modules
print("\\n".join(loaded))
sys.exit(1 if loaded else 0)
"""
    proc = run_python("-c", code, cwd=tmp_path)
    assert proc.returncode == 0, f"the operator loaded:\n{proc.stdout}\n{proc.stderr}"
