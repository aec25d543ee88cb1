"""Entry point: ``pagoda-operator`` (or ``python -m pagoda.operator``)."""

from __future__ import annotations

import argparse
import logging

import kopf

from .config import Config
from .handlers import Memo, register


def main(argv: list[str] | None = None) -> None:
    """Run the operator until interrupted; settings come from PAGODA_* environment variables."""
    parser = argparse.ArgumentParser(prog="pagoda-operator", description="Pagoda ModelDeployment operator")
    parser.add_argument("--log-format", choices=["json", "plain"], default="json")
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", help="liveness endpoint URL")
    args = parser.parse_args(argv)
    cfg = Config.from_env()
    kopf.configure(
        verbose=args.verbose,
        log_format=kopf.LogFormat.JSON if args.log_format == "json" else kopf.LogFormat.PLAIN,
    )
    logging.getLogger("pagoda.operator").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    registry = register(kopf.OperatorRegistry(), cfg)
    kopf.run(
        registry=registry,
        memo=Memo(cfg=cfg),
        standalone=True,
        clusterwide=not cfg.namespaces,
        namespaces=list(cfg.namespaces),
        liveness_endpoint=args.liveness or None,
    )


if __name__ == "__main__":
    main()
