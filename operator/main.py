"""Entry point: ``pagoda-operator`` (or ``python -m pagoda.operator``) runs the operator;
``pagoda-operator render -f FILE`` prints what it would create, without a cluster."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys


def run(argv: list[str]) -> None:
    """Run the operator until interrupted; settings come from PAGODA_* environment variables."""
    import kopf

    from .config import Config
    from .handlers import Memo, register

    parser = argparse.ArgumentParser(prog="pagoda-operator", description="Pagoda ModelDeployment operator")
    parser.add_argument("--log-format", choices=["json", "plain"], default="json")
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", help="liveness endpoint URL")
    parser.add_argument(
        "--no-install-crd",
        action="store_true",
        help="do not server-side apply the ModelDeployment CRD at start (default: $PAGODA_INSTALL_CRD, true)",
    )
    args = parser.parse_args(argv)
    cfg = Config.from_env()
    if args.no_install_crd:
        cfg = dataclasses.replace(cfg, install_crd=False)
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


def main(argv: list[str] | None = None) -> None:
    """``pagoda-operator [run flags]`` or ``pagoda-operator render -f FILE [--namespace NS]``."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["render"]:
        from .render import main as render_main

        sys.exit(render_main(argv[1:]))
    run(argv)


if __name__ == "__main__":
    main()
