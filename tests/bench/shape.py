"""Checks every bench result shares: the method's block (machine, threads, versions, commit, date,
command) and the spread fields of a measured figure."""

from __future__ import annotations

import datetime
from pathlib import Path


def check_environment(res: dict, bench: str, threads: int | None = None) -> None:
    """The machine/threads/versions/git/date/command block a result JSON carries."""
    m = res["machine"]
    assert isinstance(m["platform"], str) and m["platform"]
    assert isinstance(m["cpu"], str) and m["cpu"]
    assert isinstance(m["logical_cores"], int) and m["logical_cores"] >= 1
    assert isinstance(res["threads"], int) and res["threads"] >= 1
    if threads is not None:
        assert res["threads"] == threads
    v = res["versions"]
    assert v["torch"] and v["transformers"] and v["python"]
    assert res["git"] is None or len(res["git"]["commit"]) == 40
    assert datetime.datetime.fromisoformat(res["date"]).tzinfo is not None
    assert res["command"].startswith(f"pagoda bench {bench}")
    check_kernels(res)


def check_kernels(res: dict) -> None:
    """The kernel table (kernels/selector.py): every op with its backend and why."""
    k = res["kernels"]
    assert k["device"] in ("cpu", "cuda") and k["int4_compute"] in ("float32", "bf16")
    assert {"int4_gemm", "paged_attention_decode", "decode_layers"} <= set(k["ops"])
    assert all(row["backend"] and row["why"] for row in k["ops"].values())


def check_spread(row: dict, key: str, repeats: int) -> None:
    """``key`` is a median with its min, max and one value per repeat."""
    runs = row[f"{key}_runs"]
    assert len(runs) == repeats and all(isinstance(x, float) for x in runs)
    assert row[f"{key}_min"] <= row[key] <= row[f"{key}_max"]
    assert row[f"{key}_min"] == min(runs) and row[f"{key}_max"] == max(runs)


def check_ratio(r: dict, repeats: int) -> None:
    """A paired ratio: median, min, max and one ratio per repeat, all positive."""
    assert len(r["runs"]) == repeats and all(x > 0 for x in r["runs"])
    assert r["min"] <= r["median"] <= r["max"]


def check_png(json_path: Path) -> None:
    png = json_path.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
