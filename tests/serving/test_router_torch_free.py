"""The router holds no model: it imports, and `pagoda serve --role router` builds its app, where torch
cannot be imported at all (a finder on sys.meta_path refuses it), and loads none of the engine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

BLOCK_TORCH = """
import sys

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"{name} is blocked in this test")
        return None

sys.meta_path.insert(0, NoTorch())
"""

REPORT = """
banned = ("torch", "pagoda.node_agent.engine", "pagoda.node_agent.models", "pagoda.kernels",
          "pagoda.node_agent.serving.worker")
loaded = sorted(
    m for m in sys.modules
    if (m in banned or m.startswith(tuple(b + "." for b in banned))) and m not in ALLOWED
)
print("LOADED", loaded)
sys.exit(1 if loaded else 0)
"""


def run_blocked(body: str, cwd: Path, allowed: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """``body`` in a fresh interpreter (-P: the repository's operator/ never shadows the stdlib)
    where importing torch raises ImportError; exit 1 when a banned module (not in ``allowed``) got
    loaded anyway."""
    code = BLOCK_TORCH + f"ALLOWED = {allowed!r}\n" + body + REPORT
    return subprocess.run(
        [sys.executable, "-P", "-c", code], cwd=cwd, capture_output=True, text=True, timeout=100, check=False
    )


def test_the_finder_does_block_torch(tmp_path: Path) -> None:
    """The harness is real: under it, the engine cannot be imported."""
    proc = run_blocked("import pagoda.node_agent.engine.llm_engine\n", tmp_path)
    assert proc.returncode != 0 and "torch is blocked" in proc.stderr, proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "module",
    [
        "pagoda.node_agent.serving.router.router",
        "pagoda.node_agent.serving.router.discovery",
        "pagoda.node_agent.serving.api.api_server",
        "pagoda.node_agent.params",
    ],
)
def test_imports_without_torch(module: str, tmp_path: Path) -> None:
    proc = run_blocked(f"import {module}\n", tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_serve_role_router_builds_its_app_without_torch(tmp_path: Path) -> None:
    """cli/serve.py's router path: flags parsed, credentials read, the Router and the FastAPI app
    built, with no torch loaded; of the engine only its (torch-free) config, which defines the
    shared engine flags."""
    token = tmp_path / "token"
    token.write_text("router-torch-free-test-internal-token\n")
    body = f"""
import argparse
from pagoda.node_agent.cli.serve import add_serve_parser, build_app

ap = argparse.ArgumentParser()
add_serve_parser(ap.add_subparsers(dest="cmd"))
a = ap.parse_args(["serve", "--role", "router", "--internal-token-file", {str(token)!r},
                   "--prefill-endpoints", "http://127.0.0.1:9", "--decode-endpoints", "http://127.0.0.1:9"])
app = build_app(a)
assert type(app).__name__ == "FastAPI", type(app)
"""
    proc = run_blocked(
        body, tmp_path, allowed=("pagoda.node_agent.engine", "pagoda.node_agent.engine.config")
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
