"""The integrity drill's endpoint: ``/internal/faults`` on a server run with
``--enable-fault-injection`` (docs/integrity.md).

``POST /internal/faults`` with a JSON object:

* ``{"kind": "stale_mapping" | "flip_tag", "request_id": ID}``: that request's next decode step
  finds the fault (a mapped page freed and reallocated, or one expected tag with a bit flipped);
* ``{"kind": ..., "count": N}``: the next N requests to reach a decode step, one fault each;
* ``{"kind": "corrupt_page", "page": P}`` (``page`` optional): one bit of a sealed prefix-cache page
  flips now; the next request that reuses it fails its audit (``--integrity audit``).

It answers what was armed or injected; ``GET /internal/faults`` lists the live request ids, the
faults waiting for a victim and the last ones injected. Both need the internal token's proof
(internal_auth.py), checked before the body is read. The route exists only when fault injection
is enabled; ``serve`` refuses it on a non-loopback bind unless ``--force-fault-injection``.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from pagoda.node_agent.engine.fault_injection import ARMABLE, MAX_ARMED, FaultInjectionError
from pagoda.node_agent.serving.api.errors import ApiError
from pagoda.node_agent.serving.api.internal_auth import InternalAuth
from pagoda.node_agent.serving.api.metrics import ServeMetrics
from pagoda.node_agent.serving.worker.async_engine import AsyncEngine
from pagoda.node_agent.serving.worker.disagg_worker import json_object

PATH = "/internal/faults"
KINDS = (*ARMABLE, "corrupt_page")
MAX_BODY = 4096
SHOWN = 100  # injected faults listed by GET
LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost"})


class DrillRefused(ValueError):
    """Fault injection asked for where it must not run."""


def check_drill_bind(host: str, forced: bool, auth: InternalAuth | None) -> None:
    """Raise DrillRefused unless a drill endpoint may listen on ``host``."""
    if auth is None:
        raise DrillRefused(
            "--enable-fault-injection needs the internal token (--internal-token-file, "
            "$PAGODA_INTERNAL_TOKEN_FILE or $PAGODA_INTERNAL_TOKEN): its endpoint is authenticated"
        )
    if host not in LOOPBACK and not forced:
        raise DrillRefused(
            f"--enable-fault-injection on a non-loopback bind ({host}) is refused; bind 127.0.0.1, "
            "or pass --force-fault-injection for a drill on a network you control"
        )


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


def _request(body: dict[str, Any]) -> tuple[str, str | None, int, int | None]:
    kind = body.get("kind")
    if kind not in KINDS:
        raise _bad(f"kind must be one of {list(KINDS)}", "kind")
    rid, count, page = body.get("request_id"), body.get("count", 1), body.get("page")
    if rid is not None and (type(rid) is not str or not 1 <= len(rid) <= 256):
        raise _bad("request_id must be a string of 1..256 characters", "request_id")
    if type(count) is not int or not 1 <= count <= MAX_ARMED:
        raise _bad(f"count must be an integer in [1, {MAX_ARMED}]", "count")
    if page is not None and (type(page) is not int or page < 0):
        raise _bad("page must be a non-negative integer", "page")
    if kind == "corrupt_page" and rid is not None:
        raise _bad("corrupt_page changes a shared prefix-cache page: it takes no request_id", "request_id")
    return kind, rid, count, page


def fault_routes(engine: AsyncEngine, auth: InternalAuth, metrics: ServeMetrics):
    """``create_app``'s extra route adding the drill endpoint over ``engine``."""

    def inject(kind: str, rid: str | None, count: int, page: int | None):
        def on_engine(eng) -> dict[str, Any]:
            if kind == "corrupt_page":
                return {"injected": [asdict(eng.faults.corrupt_sealed_page(page))]}
            armed = eng.faults.arming.arm(kind, rid, count)
            return {"armed": asdict(armed), "applied": [asdict(f) for f in eng.faults.arming.apply()]}

        return on_engine

    def listing(eng) -> dict[str, Any]:
        return {
            "live": [s.request_id for s in eng.scheduler.running],
            "armed": [asdict(a) for a in eng.faults.arming.waiting()],
            "injected": [asdict(f) for f in eng.faults.injected[-SHOWN:]],
        }

    def add(app: FastAPI) -> None:
        @app.post(PATH)
        async def post_fault(request: Request) -> JSONResponse:
            if (refusal := auth.refuse(request, metrics)) is not None:
                return refusal
            kind, rid, count, page = _request(await json_object(request, MAX_BODY))
            try:
                return JSONResponse(await engine.call(inject(kind, rid, count, page)))
            except FaultInjectionError as exc:
                return JSONResponse(ApiError(409, str(exc), code="fault_not_applied").body(), status_code=409)

        @app.get(PATH)
        async def get_faults(request: Request) -> JSONResponse:
            if (refusal := auth.refuse(request, metrics)) is not None:
                return refusal
            return JSONResponse(await engine.call(listing))

    return add
