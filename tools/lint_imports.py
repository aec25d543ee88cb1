"""Run the import-linter contracts of pyproject.toml over the ``pagoda`` namespace.

The folders operator/, node_agent/ and kernels/ are mapped into ``pagoda.*`` by setuptools, a
layout import-linter cannot follow; this lays the namespace out as linked folders in a temporary
directory, puts it first on the path and runs ``lint-imports`` there. Exit status: lint-imports'.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAPPED = {"operator": "operator", "node_agent": "node_agent", "kernels": "kernels"}


def build_tree(dest: Path) -> Path:
    """``dest/pagoda`` with the files of pagoda/ and links to the mapped folders."""
    pkg = dest / "pagoda"
    pkg.mkdir()
    for f in (ROOT / "pagoda").glob("*.py"):
        (pkg / f.name).symlink_to(f)
    for name, folder in MAPPED.items():
        (pkg / name).symlink_to(ROOT / folder, target_is_directory=True)
    return dest


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="pagoda-imports-") as tmp:
        tree = build_tree(Path(tmp))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")])}
        exe = Path(sys.executable).with_name("lint-imports")
        cmd = [str(exe), "--no-cache", str(ROOT / "pyproject.toml")]
        return subprocess.call(cmd, env=env, cwd=tmp)


if __name__ == "__main__":
    sys.exit(main())
