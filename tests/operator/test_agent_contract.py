"""The operator's pod command lines are accepted by the real `pagoda serve` parser (the agent contract)."""

from __future__ import annotations

import pytest
from op_schema import admit, example

from pagoda.node_agent.cli.engine_args import engine_config_from_args
from pagoda.node_agent.cli.main import build_parser
from pagoda.operator import children
from pagoda.operator.config import Config
from pagoda.operator.spec import parse


@pytest.mark.parametrize("role", ["prefill", "decode", "router"])
@pytest.mark.parametrize(
    "spec",
    [
        {},
        {"routing": {"prefixCaching": False, "sessionAffinity": False}, "integrity": {"mode": "audit"}},
        {"routing": {"trustTenantHeader": True}, "auth": {"apiKeysSecret": {"name": "keys"}}},
        {"model": {"source": "pvc://models/kimi-k2", "trustRemoteCode": True}},
        {"rollout": {"qualityGate": {"probeInterval": 900}}},
        {"prefill": {"maxQueueTimeSeconds": 4}, "decode": {"maxQueueTimeSeconds": 2.5}},
    ],
)
def test_operator_args_parse_as_pagoda_serve(role: str, spec: dict) -> None:
    s = parse(admit(example("m", **spec))["spec"])
    args = children.agent_args(s, role, "m", "ns")
    ns = build_parser().parse_args(args)
    assert ns.cmd == "serve" and ns.role == role
    assert ns.no_prefix_caching == (not s.routing.prefix_caching)
    assert ns.trust_tenant_header == (role == "router" and s.routing.trust_tenant_header)
    assert ns.kv_port == (children.KV_PORT if role == "decode" else None)
    # the engines (never the router, which loads no tokenizer) get the spec's trust decision
    assert ns.trust_remote_code == (role != "router" and s.trust_remote_code)
    assert ns.drain_timeout == 30
    # continuous quality probes: the engines get the reference the gate records, and the interval
    probing = (
        role != "router"
        and s.rollout.quality_gate is not None
        and s.rollout.quality_gate.probe_interval_s > 0
    )
    assert ns.quality_reference == (children.QUALITY_REFERENCE_FILE if probing else None)
    if probing:
        assert ns.quality_probe_interval == 900
    if role != "router" and s.pool(role).max_queue_time_s is not None:
        assert ns.max_queue_time == s.pool(role).max_queue_time_s
    if role == "router":
        # Each pod of a pool through its headless Service; no formats (the router reads none).
        assert ns.prefill_dns == "m-prefill-pods.ns.svc.cluster.local:8000"
        assert ns.decode_dns == "m-decode-pods.ns.svc.cluster.local:8000"
        assert ns.no_session_affinity == (not s.routing.session_affinity)
        assert "--decode-weights" not in args and not ns.prefill_endpoints and not ns.decode_endpoints
    else:
        assert ns.integrity == s.integrity.mode
        assert (ns.decode_weights, ns.decode_kv) == (s.decode.weight_format, s.decode.kv_cache_format)
        assert (ns.prefill_weights, ns.prefill_kv) == (s.prefill.weight_format, s.prefill.kv_cache_format)


def _serve_options() -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._subparsers._group_actions if a.choices)  # noqa: SLF001
    return set(sub.choices["serve"]._option_string_actions)  # noqa: SLF001


@pytest.mark.parametrize("worker", [False, True])
def test_multi_node_args_parse_as_pagoda_serve(worker: bool) -> None:
    """A LeaderWorkerSet pool's leader and workers run the same command: TP over all hosts."""
    if not {"--nodes", "--dist-port"} <= _serve_options():
        pytest.skip("this checkout's `pagoda serve` has no --nodes/--dist-port yet (engine side of issue 11)")
    s = parse(admit(example("m", decode={"tensorParallel": 4, "nodesPerReplica": 2}))["spec"])
    lws = children.build({"name": "m", "namespace": "ns", "uid": "u"}, s, Config())[
        "LeaderWorkerSet/m-decode"
    ]
    key = "workerTemplate" if worker else "leaderTemplate"
    args = lws["spec"]["leaderWorkerTemplate"][key]["spec"]["containers"][0]["args"]
    ns = build_parser().parse_args(args)
    assert (ns.tensor_parallel, ns.nodes, ns.dist_port) == (4, 2, children.DIST_PORT)


@pytest.mark.parametrize(
    ("pools", "weights"),
    [
        ({}, ("auto", "auto")),  # the CRD default
        ({"prefill": {"weightFormat": "bf16"}, "decode": {"weightFormat": "int4"}}, ("bf16", "int4")),
        ({"prefill": {"weightFormat": "stored"}}, ("stored", "auto")),
    ],
)
def test_weight_formats_reach_the_engine_config_as_in_the_spec(pools: dict, weights: tuple) -> None:
    """The engines' command lines name each phase's weight format, auto included, and `pagoda serve`
    builds the EngineConfig the spec asks for: auto is the engine's own default (the flag left out),
    which it resolves per source when it builds."""
    s = parse(admit(example("m", **pools))["spec"])
    for role in ("prefill", "decode"):
        args = children.agent_args(s, role, "m", "ns")
        assert args[args.index("--prefill-weights") + 1] == weights[0]
        assert args[args.index("--decode-weights") + 1] == weights[1]
        f = engine_config_from_args(build_parser().parse_args(args)).formats
        assert (f.prefill_weights, f.decode_weights) == weights
        flags = {"--prefill-weights", "--decode-weights"}
        bare = [a for i, a in enumerate(args) if a not in flags and args[i - 1] not in flags]
        left_out = engine_config_from_args(build_parser().parse_args(bare)).formats
        for phase, fmt in zip(("prefill", "decode"), weights, strict=True):
            if fmt == "auto":  # the same config as without the flag
                assert getattr(f, f"{phase}_weights") == getattr(left_out, f"{phase}_weights") == "auto"
