"""docs/development.md's layout block names the tree as it is: every path and module it names
exists, and every top-level folder and every package folder has its row."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "development.md"
PACKAGE_ROOTS = ("pagoda", "kernels", "node_agent", "operator")
# what a working tree holds beside the repository's own folders (used when git cannot list them)
NOT_LAYOUT = {"build", "dist", "bench-results", "__pycache__"}
SUFFIXES = ("", ".py", ".c", ".h")
DESCRIPTION_COLUMN = 21  # where a row's description starts; deeper lines continue it


def layout_rows() -> list[tuple[str, str]]:
    """``(path, description)`` per row of the fenced block under "## Layout"; indented rows are
    joined to the folder above them, continuation lines to their row's description."""
    text = DOC.read_text()
    section = text[text.index("\n## Layout\n") :]
    block = section[section.index("```text\n") + len("```text\n") :]
    block = block[: block.index("\n```")]
    rows: list[tuple[str, str]] = []
    parents: list[tuple[int, str]] = []  # (indent, folder path) of the enclosing folder rows
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip(" "))
        if indent >= DESCRIPTION_COLUMN and rows:  # the previous row's description, continued
            path, prev = rows[-1]
            rows[-1] = (path, f"{prev} {line.strip()}")
            continue
        m = re.match(r"^ *(\S+) {2,}(\S.*)$", line)
        assert m, f"layout line not 'path  description': {line!r}"
        name, desc = m.group(1), m.group(2)
        while parents and parents[-1][0] >= indent:
            parents.pop()
        path = (parents[-1][1] if parents else "") + name
        rows.append((path, desc))
        if name.endswith("/"):
            parents.append((indent, path))
    return rows


def named_modules(folder: str, desc: str) -> list[str]:
    """Backticked names in a folder row's description: modules or files of that folder."""
    return re.findall(r"`([A-Za-z0-9_.*/-]+)`", desc) if folder.endswith("/") else []


def _exists(folder: Path, name: str) -> bool:
    if "*" in name:
        return any(folder.glob(name))
    return any((folder / (name.rstrip("/") + suffix)).exists() for suffix in SUFFIXES)


def test_the_layout_block_parses_into_rows():
    rows = dict(layout_rows())
    assert "node_agent/engine/" in rows and "kernels/" in rows and "pyproject.toml" in rows
    assert all(desc for desc in rows.values()), [p for p, d in rows.items() if not d]


def test_every_path_and_module_the_layout_names_exists():
    missing = []
    for path, desc in layout_rows():
        if not (ROOT / path).exists():
            missing.append(path)
            continue
        missing += [f"{path}{name}" for name in named_modules(path, desc) if not _exists(ROOT / path, name)]
    assert not missing, f"docs/development.md's layout names what the tree lacks: {missing}"


def top_level_folders() -> set[str]:
    """The repository's top-level folders: those holding tracked files (every non-hidden folder
    but build outputs where git cannot say)."""
    try:
        out = subprocess.run(
            ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {
            p.name
            for p in ROOT.iterdir()
            if p.is_dir()
            and not p.name.startswith(".")
            and p.name not in NOT_LAYOUT
            and not p.name.endswith(".egg-info")
        }
    return {line.split("/", 1)[0] for line in out.splitlines() if "/" in line}


def test_every_top_level_folder_and_package_has_a_row():
    named = {path.rstrip("/") for path, _ in layout_rows()}
    packages = {
        init.parent.relative_to(ROOT).as_posix()
        for top in PACKAGE_ROOTS
        for init in (ROOT / top).rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    unnamed = sorted((top_level_folders() | packages) - named)
    assert not unnamed, f"docs/development.md's layout has no row for: {unnamed}"
