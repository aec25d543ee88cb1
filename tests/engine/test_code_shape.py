"""The engine stays readable: the loop file is short and no function in node_agent/engine/ (nor
node_agent/kv/) is long."""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[2] / "node_agent" / "engine"
MAX_LOOP_LINES = 300
MAX_FUNCTION_LINES = 60  # from the def line to the function's last line

KV = ENGINE.parent / "kv"  # the KV package below the engine is held to the same rule


def long_functions(path: Path) -> list[str]:
    """``name (N lines)`` for each function or method of ``path`` over the limit."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]


def test_the_engine_loop_fits_its_budget() -> None:
    lines = len((ENGINE / "llm_engine.py").read_text().splitlines())
    assert lines <= MAX_LOOP_LINES, f"engine/llm_engine.py has {lines} lines (at most {MAX_LOOP_LINES})"


def test_no_function_in_the_engine_is_longer_than_sixty_lines() -> None:
    files = sorted(ENGINE.rglob("*.py")) + sorted(KV.rglob("*.py"))
    assert ENGINE / "parallel" / "replica.py" in files  # the walk reaches sub-packages
    assert KV / "pool.py" in files
    found = {str(p.relative_to(ENGINE.parent)): long for p in files if (long := long_functions(p))}
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines: {found}"


def test_the_measure_counts_a_function_from_def_to_last_line(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))  # def + 60 lines = 61
    (tmp_path / "m.py").write_text(f"def short():\n    pass\n\n\ndef long():\n{body}\n")
    assert long_functions(tmp_path / "m.py") == [f"long ({MAX_FUNCTION_LINES + 1} lines)"]
