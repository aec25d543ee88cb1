"""``pagoda serve``: roles both, prefill, decode and router, or all of them locally (``--disaggregated``)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from collections.abc import Callable

from pagoda.node_agent.cli.engine_args import add_engine_args, engine_config_from_args
from pagoda.node_agent.serving.api.toolcalls import PARSERS, REASONING_PARSERS
from pagoda.node_agent.serving.launch import agent_command, free_port, is_ready
from pagoda.vocabulary import SERVE_ROLES

log = logging.getLogger("pagoda.serve")

DEFAULT_PORT = 8000
EXIT_REPLICA_FAILED = 3  # a tensor-parallel rank died or hung: the replica exits with this code
FATAL_FLUSH_S = 0.5  # error responses reach their clients before the process exits
PUBLIC_CONNECTIONS_PER_CLIENT = 256


DEFAULT_SWITCH_INTERVAL_S = 0.0005


def apply_switch_interval(seconds: float) -> None:
    """The process's GIL switch interval (``--gil-switch-interval``; 0 leaves Python's own)."""
    if seconds < 0:
        raise SystemExit(f"pagoda serve: --gil-switch-interval must be >= 0, got {seconds}")
    if seconds > 0:
        sys.setswitchinterval(seconds)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Serving flags (the engine flags are added by the caller)."""
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument(
        "--role",
        choices=SERVE_ROLES,
        default="both",
        help="both: one process holds both phases (default); prefill/decode: a disaggregated "
        "worker; router: the OpenAI API in front of prefill and decode workers",
    )
    p.add_argument(
        "--disaggregated",
        action="store_true",
        help="start a router, one prefill and one decode worker locally (ports P, P+1, P+2)",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=("auto", *PARSERS),
        default="auto",
        help="how tool calls are read from the model's replies (default: detected from the model's "
        "family and chat template; 'generic': tools in a system prompt and a JSON reply)",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=("auto", "none", *REASONING_PARSERS),
        default="auto",
        help="separate <think> reasoning into reasoning_content (default: detected from the chat "
        "template; 'none' turns it off)",
    )
    p.add_argument("--served-model-name", default=None, help="model id in the API (default: from --model)")
    p.add_argument(
        "--tenant-header",
        default="X-Pagoda-Tenant",
        help="request header naming the tenant (salts the prefix cache); read only with "
        "--trust-tenant-header",
    )
    p.add_argument(
        "--trust-tenant-header",
        action="store_true",
        help="trust the --tenant-header set by a gateway in front (with --api-keys too, the key "
        "authenticates the gateway and the header, when present, names the tenant)",
    )
    p.add_argument(
        "--api-keys",
        default=None,
        metavar="FILE",
        help="public API keys, one 'TENANT KEY' or 'TENANT sha256:HEX' per line; each request needs "
        "'Authorization: Bearer KEY' and its tenant comes from the key (default: "
        "$PAGODA_API_KEYS_FILE; without either the API is open and single-tenant)",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        help="seconds to receive a whole request body before 408",
    )
    add_http_limit_args(p)
    p.add_argument(
        "--tenant-secret",
        default=None,
        help="HMAC key for tenant salts (default: --tenant-secret-file, $PAGODA_TENANT_SECRET, random)",
    )
    p.add_argument("--tenant-secret-file", default=None, help="file holding the HMAC key for tenant salts")
    p.add_argument(
        "--shared-cache-scope",
        default=None,
        help="the one cache scope tenants may share via X-Pagoda-Cache-Scope",
    )
    p.add_argument("--no-session-affinity", action="store_true")
    p.add_argument(
        "--max-queue", type=int, default=256, help="requests waiting beyond --max-num-seqs before 429"
    )
    p.add_argument(
        "--max-queue-time",
        type=float,
        default=None,
        help="seconds a request may wait unscheduled: refused at once with 429 when the expected wait "
        "is longer, ended with an error when it waits longer (default: no deadline)",
    )
    p.add_argument(
        "--tenant-queue-share",
        type=float,
        default=0.5,
        help="with --max-queue-time: the share of the queue's places one tenant may hold",
    )
    p.add_argument("--max-body-bytes", type=int, default=1 << 20)
    p.add_argument(
        "--max-prompt-bytes",
        type=int,
        default=None,
        help="prompt text (a completion's prompt, or a chat's messages and tools) refused before "
        "tokenizing above this many UTF-8 bytes (default on a worker: 16 bytes per token of the model "
        "length; the router forwards prompts up to --max-body-bytes unless set)",
    )
    p.add_argument("--prefill-endpoints", default="", help="router: prefill worker URLs, comma-separated")
    p.add_argument("--decode-endpoints", default="", help="router: decode worker URLs, comma-separated")
    p.add_argument(
        "--prefill-dns",
        default="",
        metavar="HOST:PORT[,...]",
        help="router: DNS names of prefill workers (e.g. a headless Service); each A/AAAA record is one "
        "worker http://IP:PORT, re-resolved every --dns-refresh-seconds",
    )
    p.add_argument(
        "--decode-dns", default="", metavar="HOST:PORT[,...]", help="router: like --prefill-dns, for decode"
    )
    p.add_argument(
        "--dns-refresh-seconds",
        type=float,
        default=5.0,
        help="router: period of re-resolving --prefill-dns/--decode-dns",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM: stop admitting and let requests in flight finish for up to this long, then "
        "end the rest with an error and exit 0 (a second SIGTERM/SIGINT exits at once)",
    )
    p.add_argument(
        "--kv-port",
        type=int,
        default=None,
        help="decode worker: TCP port receiving KV pages (default: --port + 1000)",
    )
    p.add_argument(
        "--kv-advertise-host",
        default=None,
        help="decode worker: address prefill workers connect to (default: this host's address)",
    )
    p.add_argument(
        "--internal-token-file",
        default=None,
        help="router/prefill/decode: file holding the internal token they share (default: "
        "$PAGODA_INTERNAL_TOKEN_FILE, else $PAGODA_INTERNAL_TOKEN)",
    )
    p.add_argument(
        "--kv-frame-timeout", type=float, default=10.0, help="decode worker: seconds one KV frame may take"
    )
    p.add_argument(
        "--kv-handoff-deadline",
        type=float,
        default=60.0,
        help="decode worker: seconds one KV handoff may take",
    )
    p.add_argument(
        "--kv-max-handoffs",
        type=int,
        default=8,
        help="decode worker: KV handoffs received at once (more: busy)",
    )
    p.add_argument(
        "--quality-reference",
        default=None,
        metavar="FILE",
        help="continuous quality probes: the reference's score of the probe set (a ScoreResponse JSON, "
        "as the operator mounts it); with it the pool probes every --quality-probe-interval seconds",
    )
    p.add_argument(
        "--quality-probe-interval",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="seconds between continuous quality probes (default 600; 0: off)",
    )
    p.add_argument(
        "--quality-probe-set",
        default=None,
        metavar="FILE",
        help="the probe set's probes.json (default: the built-in set); its prompts must be the reference's",
    )
    p.add_argument(
        "--force-fault-injection",
        action="store_true",
        help="allow --enable-fault-injection's drill endpoint on a non-loopback bind (drills only)",
    )
    p.add_argument(
        "--kv-auth-timeout",
        type=float,
        default=5.0,
        help="decode worker: seconds a KV connection may take to send a verified header (then closed)",
    )
    p.add_argument(
        "--kv-max-connections",
        type=int,
        default=256,
        help="decode worker: open KV connections in all (more are closed at once)",
    )
    p.add_argument(
        "--kv-max-unauthenticated",
        type=int,
        default=128,
        help="decode worker: KV connections before their header's MAC (over it the oldest is closed)",
    )
    p.add_argument(
        "--kv-max-unauthenticated-per-peer",
        type=int,
        default=32,
        help="decode worker: the same, per peer address",
    )
    p.add_argument(
        "--kv-max-abs-value",
        type=float,
        default=65504.0,
        help="decode worker: KV page values beyond +-this (or NaN/infinity) refuse the handoff",
    )
    p.add_argument(
        "--report-interval",
        type=float,
        default=None,
        help="agent report period in seconds (default: $PAGODA_REPORT_INTERVAL_S or 10)",
    )
    p.add_argument("--log-level", default="warning")
    p.add_argument(
        "--gil-switch-interval",
        type=float,
        default=DEFAULT_SWITCH_INTERVAL_S,
        help="seconds a thread may hold the GIL while another waits for it (sys.setswitchinterval; "
        "0 keeps Python's 0.005): short, so the engine thread, which takes the GIL back after each "
        "kernel, does not wait behind the event loop parsing a flood of bodies",
    )


def add_http_limit_args(p: argparse.ArgumentParser) -> None:
    """Connection limits of every HTTP server (node_agent/serving/api/http_limits.py)."""
    p.add_argument(
        "--http-head-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="a connection must send a whole request head within this long of opening (and of its "
        "previous response), else 408 and closed",
    )
    p.add_argument(
        "--http-keepalive-timeout",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="an idle keep-alive connection is closed after this long",
    )
    p.add_argument("--http-max-head-bytes", type=int, default=64 << 10, help="largest request line + headers")
    p.add_argument(
        "--http-max-connections",
        type=int,
        default=4096,
        help="open connections in all; more are answered 503 and closed",
    )
    p.add_argument(
        "--http-max-connections-per-client",
        type=int,
        default=None,
        help="open connections per client address; more are answered 503 and closed (default: 256 "
        "on the public API, roles both and router; no per-address cap on prefill/decode workers, "
        "whose one client is the router)",
    )


def http_limits_from_args(a: argparse.Namespace):
    """The HttpLimits of this process's server."""
    from pagoda.node_agent.serving.api.http_limits import HttpLimits

    per_client = a.http_max_connections_per_client
    if per_client is None and a.role in ("both", "router"):
        per_client = PUBLIC_CONNECTIONS_PER_CLIENT
    return HttpLimits(
        head_timeout_s=a.http_head_timeout,
        keep_alive_s=a.http_keepalive_timeout,
        max_head_bytes=a.http_max_head_bytes,
        max_connections=a.http_max_connections,
        max_connections_per_client=per_client,
    )


def served_names(a: argparse.Namespace) -> list[str]:
    """API model ids: the served name (or the source's last part) and the source itself."""
    src = a.model
    short = a.served_model_name or src.rstrip("/").rsplit("/", 1)[-1].removesuffix(".gguf")
    return list(dict.fromkeys([short, src]))


def pool_label(role: str) -> str:
    return os.environ.get("PAGODA_POOL") or role


def build_app(a: argparse.Namespace, engine=None):
    """The FastAPI app for ``a.role`` (``engine``: an LLMEngine to reuse instead of loading one)."""
    from pagoda.node_agent.serving.api.api_server import ApiSettings, create_app
    from pagoda.node_agent.serving.api.auth import ApiKeys
    from pagoda.node_agent.serving.api.metrics import ServeMetrics
    from pagoda.node_agent.serving.api.tenancy import TenantPolicy

    api_keys = ApiKeys.from_settings(a.api_keys) if a.role in ("both", "router") else None
    tenancy = TenantPolicy.from_settings(
        a.tenant_header,
        a.tenant_secret,
        a.shared_cache_scope,
        secret_file=a.tenant_secret_file,
        trust_header=a.trust_tenant_header,
        keyed=api_keys is not None,
    )
    public = {"api_keys": api_keys, "body_timeout_s": a.body_timeout, "drain_timeout_s": a.drain_timeout}
    if not a.drain_timeout >= 0:
        raise ValueError(f"--drain-timeout must be >= 0 seconds, got {a.drain_timeout}")
    from pagoda.node_agent.serving.api.internal_auth import auth_for_role

    if a.role == "router":  # flag values first, then credentials, then anything else
        from pagoda.node_agent.serving.router.discovery import parse_dns_targets

        prefill_dns = parse_dns_targets(a.prefill_dns, "--prefill-dns")
        decode_dns = parse_dns_targets(a.decode_dns, "--decode-dns")
    internal = auth_for_role(a.role, a.internal_token_file)  # before any model load: fail fast
    drill = drill_auth(a, internal)  # --enable-fault-injection: its endpoint's proof (or a refusal)
    if a.role == "router":
        from pagoda.node_agent.serving.router.router import Router, RouterSettings

        metrics = ServeMetrics(pool_label("router"))
        router = Router(
            RouterSettings(
                prefill=[u.strip() for u in a.prefill_endpoints.split(",") if u.strip()],
                decode=[u.strip() for u in a.decode_endpoints.split(",") if u.strip()],
                session_affinity=not a.no_session_affinity,
                prefix_aware=not a.no_prefix_caching,
                max_inflight=a.max_queue,
                prefill_dns=prefill_dns,
                decode_dns=decode_dns,
                dns_refresh_s=a.dns_refresh_seconds,
                tool_call_parser=a.tool_call_parser,
                reasoning_parser=a.reasoning_parser,
                model_name=served_names(a)[0],
            ),
            metrics,
            internal,
        )
        settings = ApiSettings(
            served_names(a),
            tenancy,
            metrics,
            a.max_body_bytes,
            **public,
            on_startup=[router.start],
            on_shutdown=[router.stop],
        )
        settings.max_prompt_bytes = a.max_prompt_bytes
        return create_app(router, settings)

    from pagoda.node_agent.engine.llm_engine import LLMEngine
    from pagoda.node_agent.serving.api.metrics import ServeMetrics
    from pagoda.node_agent.serving.worker.async_engine import AsyncEngine, build_off_main
    from pagoda.node_agent.serving.worker.queue_deadline import QueuePolicy

    if engine is None:
        cfg = engine_config_from_args(a)
        cfg.role = a.role
        engine = build_off_main(lambda: LLMEngine(cfg))  # the engine thread's pool is the only one
    holder: dict = {}
    metrics = ServeMetrics(pool_label(a.role), snapshot=lambda: holder["engine"].snapshot())
    policy = QueuePolicy(a.max_queue_time, a.tenant_queue_share)
    aeng = AsyncEngine(
        engine,
        metrics,
        max_queue=a.max_queue,
        model_name=a.model,
        queue_policy=policy,
        max_prompt_bytes=a.max_prompt_bytes,
    )
    aeng.on_fatal = exit_on_fatal(engine)
    holder["engine"] = aeng
    settings = ApiSettings(served_names(a), tenancy, metrics, a.max_body_bytes, **public)
    settings.max_prompt_bytes = aeng.max_prompt_bytes
    settings.on_startup.append(_async(aeng.start))
    settings.on_shutdown.append(_async(aeng.stop))
    quality = _add_quality(a, settings, aeng, metrics, internal or drill)
    _add_reporter(a, settings, aeng, quality.report if quality is not None else None)
    if drill is not None:
        from pagoda.node_agent.serving.worker.fault_drill import fault_routes

        settings.extra_routes.append(fault_routes(aeng, drill, metrics))
    from pagoda.node_agent.serving.worker.chat_format import chat_format_of

    chat_format = chat_format_of(engine, a.tool_call_parser, a.reasoning_parser)
    if a.role == "both":
        from pagoda.node_agent.serving.api.api_server import create_app
        from pagoda.node_agent.serving.worker.local_backend import LocalBackend

        app = create_app(LocalBackend(aeng, chat_format), settings)
        app.state.quality = quality
        return app
    from pagoda.node_agent.serving.worker.disagg_worker import DisaggWorker

    worker = DisaggWorker(
        a.role,
        aeng,
        metrics,
        internal,
        kv_port=a.kv_port if a.kv_port is not None else a.port + 1000,
        kv_host=a.host,
        advertise_host=a.kv_advertise_host,
        max_body_bytes=a.max_body_bytes,
        kv_frame_timeout_s=a.kv_frame_timeout,
        kv_deadline_s=a.kv_handoff_deadline,
        kv_max_handoffs=a.kv_max_handoffs,
        chat_format=chat_format,
        kv_limits=kv_limit_args(a),
    )
    settings.extra_routes.append(worker.routes)
    settings.on_startup.append(worker.start)
    settings.on_shutdown.append(worker.stop)
    app = create_app(None, settings)
    app.state.quality = quality  # the continuous probe (None when off)
    return app


def drill_auth(a: argparse.Namespace, internal):
    """The internal proof the drill endpoint checks (None without --enable-fault-injection); raises
    DrillRefused without a token, or on a non-loopback bind unless --force-fault-injection."""
    if not getattr(a, "enable_fault_injection", False) or a.role == "router":
        return None
    from pagoda.node_agent.serving.api.internal_auth import InternalAuth, load_token
    from pagoda.node_agent.serving.worker.fault_drill import check_drill_bind

    if internal is None:  # role both has no internal plane of its own: the drill needs the token
        token = load_token(a.internal_token_file)
        internal = InternalAuth(token) if token else None
    check_drill_bind(a.host, a.force_fault_injection, internal)
    return internal


def kv_limit_args(a: argparse.Namespace) -> dict[str, float | int]:
    """The decode worker's KV connection limits from its flags (kv_limits.KVLimits fields)."""
    return {
        "auth_timeout_s": a.kv_auth_timeout,
        "max_connections": a.kv_max_connections,
        "max_unauthenticated": a.kv_max_unauthenticated,
        "max_unauthenticated_per_peer": a.kv_max_unauthenticated_per_peer,
        "max_abs_value": a.kv_max_abs_value,
    }


def _async(fn: Callable[[], object]):
    async def hook() -> None:
        fn()

    return hook


def _add_quality(a: argparse.Namespace, settings, aeng, metrics, internal):
    """``POST /internal/score`` (with the internal token: always on roles prefill and decode, on
    role both when a token is set) and the continuous probe loop (``--quality-reference``)."""
    from pagoda.node_agent.serving.worker.score import Scorer, score_routes

    scorer = Scorer(aeng)
    if internal is None:
        from pagoda.node_agent.serving.api.internal_auth import InternalAuth, load_token

        token = load_token(a.internal_token_file)
        internal = InternalAuth(token) if token else None
    if internal is not None:
        settings.extra_routes.append(score_routes(scorer, internal, metrics))
    if not getattr(a, "quality_reference", None):
        return None
    from pagoda.node_agent.serving.worker.quality_loop import QualityLoop

    if not a.quality_probe_interval >= 0:
        raise ValueError(f"--quality-probe-interval must be >= 0 seconds, got {a.quality_probe_interval}")
    loop = QualityLoop(scorer, a.quality_reference, metrics, a.quality_probe_interval, a.quality_probe_set)
    settings.on_startup.append(loop.start)
    settings.on_shutdown.append(loop.stop)
    return loop


def _add_reporter(a: argparse.Namespace, settings, aeng, quality=None) -> None:
    from pagoda.node_agent.agent.reporter import AgentReporter, ReporterConfig

    cfg = ReporterConfig.from_env(pool=pool_label(a.role), interval=a.report_interval)
    if cfg is None:
        return
    reporter = AgentReporter(cfg, aeng.snapshot, quality=quality)
    settings.on_startup.append(reporter.start)
    settings.on_shutdown.append(reporter.stop)


def exit_on_fatal(engine) -> Callable[[str], None]:
    """What a server does when its replica fails: say why, stop its ranks, exit EXIT_REPLICA_FAILED."""

    def fatal(reason: str) -> None:
        print(f"pagoda serve: {reason}; exiting", file=sys.stderr, flush=True)

        def leave() -> None:
            time.sleep(FATAL_FLUSH_S)
            engine.replica.terminate_children(grace_s=0.5)
            os._exit(EXIT_REPLICA_FAILED)

        threading.Thread(target=leave, name="pagoda-fatal", daemon=True).start()

    return fatal


def is_follower(a: argparse.Namespace) -> bool:
    """Whether this process is a tensor-parallel rank other than 0 (a worker host's first rank)."""
    if a.role == "router" or a.tensor_parallel <= 1:
        return False
    from pagoda.node_agent.engine.parallel.group import rendezvous

    return rendezvous(engine_config_from_args(a).parallel).rank != 0


def serve_follower(a: argparse.Namespace) -> int:
    """A worker host of a multi-host replica: its ranks follow rank 0; ``GET /health`` on the http
    port answers 200 while they do (503 before joining), under the same connection limits as every
    server (node_agent/serving/api/health_server.py). Exits with the ranks' outcome."""
    from pagoda.node_agent.engine.llm_engine import LLMEngine
    from pagoda.node_agent.serving.api.health_server import HealthServer

    state = {"joined": False}
    limits = http_limits_from_args(a)
    health = HealthServer(a.host, a.port, lambda: state["joined"], limits).start()
    cfg = engine_config_from_args(a)
    cfg.role = a.role
    engine = LLMEngine(cfg)
    state["joined"] = True
    print(f"pagoda serve: tensor-parallel rank {engine.replica.rank} following rank 0", flush=True)
    code = engine.follow()
    state["joined"] = False
    health.stop()
    return code


def cmd_serve(a: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT, then drain (node_agent/serving/api/drain.py) and return 0."""
    from pagoda.node_agent.serving.api.drain import serve

    if a.disaggregated:
        return run_disaggregated(a)
    if is_follower(a):
        return serve_follower(a)
    limits = http_limits_from_args(a)  # flag values first: fail before loading a model
    apply_switch_interval(a.gil_switch_interval)
    app = build_app(a)
    print(f"pagoda serve: role {a.role} on http://{a.host}:{a.port}", flush=True)
    return serve(app, app.state.drain, a.host, a.port, a.log_level, limits)


def child_args(a: argparse.Namespace, role: str, port: int, extra: list[str]) -> list[str]:
    """The command line of one local worker of ``--disaggregated``: our own flags, another role/port."""
    argv = [x for x in sys.argv[1:] if x != "--disaggregated"]
    out: list[str] = []
    skip = False
    dropped = ("--role", "--port", "--kv-port", "--tenant-secret")  # the secret goes by environment
    for i, x in enumerate(argv):
        if skip:
            skip = False
            continue
        if x in dropped and i + 1 < len(argv):
            skip = True
            continue
        if x.startswith(tuple(f + "=" for f in dropped)):
            continue
        out.append(x)
    return agent_command(*out, "--role", role, "--port", str(port), *extra)


def run_disaggregated(a: argparse.Namespace) -> int:
    """Router on --port, prefill on --port+1, decode on --port+2 (its KV receiver on a free port),
    under a supervisor that restarts whichever exits (policy: node_agent/cli/supervisor.py)."""
    from pagoda.node_agent.cli.supervisor import ChildSpec, RestartPolicy, Supervisor, child_env

    host = a.host
    p_port, d_port = a.port + 1, a.port + 2
    kv_port = a.kv_port or free_port(host)
    p_url, d_url, r_url = (f"http://{host}:{p}" for p in (p_port, d_port, a.port))
    children = [
        ChildSpec("prefill", child_args(a, "prefill", p_port, []), stage=1),
        ChildSpec("decode", child_args(a, "decode", d_port, ["--kv-port", str(kv_port)]), stage=1),
        ChildSpec(
            "router",
            child_args(a, "router", a.port, ["--prefill-endpoints", p_url, "--decode-endpoints", d_url]),
            stage=0,  # drains first, while the workers still serve its requests in flight
        ),
    ]
    if not a.drain_timeout >= 0:
        raise ValueError(f"--drain-timeout must be >= 0 seconds, got {a.drain_timeout}")
    supervisor = Supervisor(
        children,
        policy=RestartPolicy(stop_timeout_s=a.drain_timeout + 10),
        env=child_env(os.environ, a.internal_token_file, a.tenant_secret),
        ready=lambda: is_ready(r_url),
        ready_line=f"router {r_url}, prefill :{p_port}, decode :{d_port} (KV :{kv_port})",
        label="pagoda serve --disaggregated",
    )
    return supervisor.run()


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``pagoda serve``."""
    s = sub.add_parser(
        "serve", help="OpenAI-compatible server (single process, a disaggregated role, or both)"
    )
    add_engine_args(s)
    add_serve_args(s)
    s.set_defaults(func=cmd_serve)
