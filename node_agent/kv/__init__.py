"""The KV cache layer: the format registry (formats.py), page storage (storage.py), the page
allocator (allocator.py, no tensors), the prefix index (prefix_index.py), the pool facade over them
(pool.py) and the one page layout every mover follows (layout.py).

The names below load on first use, so importing the allocator or the prefix index loads no torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "KVPagePool": "pool",
    "storage_dtype": "pool",
    "OutOfPages": "allocator",
    "PageRef": "allocator",
    "page_scale_key": "storage",
    "is_page_scale_key": "storage",
    "KVFormat": "formats",
    "PageLayout": "layout",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    return sorted(_EXPORTS)
