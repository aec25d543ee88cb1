"""Operator settings, read from the environment (the Helm chart sets them)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

DEFAULT_FP8_PRODUCTS = (
    "NVIDIA-H100-80GB-HBM3",
    "NVIDIA-H100-PCIe",
    "NVIDIA-H100-NVL",
    "NVIDIA-H200",
    "NVIDIA-H200-NVL",
    "NVIDIA-L4",
    "NVIDIA-L40S",
    "NVIDIA-B200",
    "NVIDIA-GB200",
)


@dataclass(frozen=True)
class Config:
    """What the operator needs beyond the ModelDeployment itself."""

    resync_s: float = 10.0
    stale_after_s: float = 60.0
    report_interval_s: int = 10
    fp8_node_label: str = "nvidia.com/gpu.product"
    fp8_products: tuple[str, ...] = DEFAULT_FP8_PRODUCTS
    namespaces: tuple[str, ...] = field(default_factory=tuple)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Config:
        """Build the settings from PAGODA_* variables; unset ones keep their defaults."""
        env = os.environ if env is None else env
        products = env.get("PAGODA_FP8_GPU_PRODUCTS")
        namespaces = env.get("PAGODA_WATCH_NAMESPACES", "")
        return cls(
            resync_s=float(env.get("PAGODA_RESYNC_S", cls.resync_s)),
            stale_after_s=float(env.get("PAGODA_STALE_AFTER_S", cls.stale_after_s)),
            report_interval_s=int(env.get("PAGODA_REPORT_INTERVAL_S", cls.report_interval_s)),
            fp8_node_label=env.get("PAGODA_FP8_NODE_LABEL", cls.fp8_node_label),
            fp8_products=tuple(p.strip() for p in products.split(",") if p.strip())
            if products
            else DEFAULT_FP8_PRODUCTS,
            namespaces=tuple(n.strip() for n in namespaces.split(",") if n.strip()),
        )
