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


# torch.distributed stays behind the replica object (engine/parallel/); the models' collectives
# (models/parallel.py) sit below the engine and take the process group they are handed
DISTRIBUTED_ALLOWED = ("node_agent/engine/parallel/", "node_agent/models/parallel.py")


def distributed_uses(path: Path) -> list[int]:
    """Lines of ``path`` that import torch.distributed or reach it as ``torch.distributed``."""
    import ast

    lines = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import) and any(a.name.startswith("torch.distributed") for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and (
            (node.module or "").startswith("torch.distributed")
            or (node.module == "torch" and any(a.name == "distributed" for a in node.names))
        ):
            lines.append(node.lineno)
        elif (
            isinstance(node, ast.Attribute)
            and node.attr == "distributed"
            and isinstance(node.value, ast.Name)
            and node.value.id == "torch"
        ):
            lines.append(node.lineno)
    return lines


def test_only_the_parallel_package_uses_torch_distributed() -> None:
    found = {}
    for folder in ("pagoda", "operator", "node_agent", "kernels"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if not rel.startswith(DISTRIBUTED_ALLOWED) and (lines := distributed_uses(path)):
                found[rel] = lines
    assert (ROOT / DISTRIBUTED_ALLOWED[0] / "group.py").is_file()  # the allowed place exists
    assert not found, f"torch.distributed outside engine/parallel/: {found}"


def test_the_distributed_check_sees_every_spelling(tmp_path: Path) -> None:
    spellings = [
        "import torch.distributed as dist",
        "from torch.distributed import all_reduce",
        "from torch import distributed",
        "import torch\ntorch.distributed.barrier()",
    ]
    for i, code in enumerate(spellings):
        (tmp_path / f"m{i}.py").write_text(code + "\n")
        assert distributed_uses(tmp_path / f"m{i}.py"), code
    (tmp_path / "ok.py").write_text("import torch\n# torch.distributed in a comment\nx = torch.zeros(1)\n")
    assert distributed_uses(tmp_path / "ok.py") == []
