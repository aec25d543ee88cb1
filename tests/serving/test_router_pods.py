"""Per-pod routing: ``--prefill-dns``/``--decode-dns`` values, DNS resolution and its failures, two
router replicas agreeing on session affinity by rendezvous hashing, a leaving pod moving only its
own sessions, and (with live workers) pods that leave mid-stream, come back fresh, or drain."""

from __future__ import annotations

import argparse
import asyncio
from collections import Counter

import pytest

from pagoda.node_agent.params import SamplingParams
from pagoda.node_agent.serving.api.backend import GenRequest
from pagoda.node_agent.serving.api.errors import ApiError
from pagoda.node_agent.serving.api.internal_auth import InternalAuth
from pagoda.node_agent.serving.api.metrics import ServeMetrics, metric_sum, parse_metrics
from pagoda.node_agent.serving.router import hashing
from pagoda.node_agent.serving.router.discovery import DnsTarget, DnsWatch, parse_dns_targets, resolve
from pagoda.node_agent.serving.router.router import Router, RouterSettings

from .live import LiveServer

TOKEN = "router-pods-test-internal-token"
PODS = [f"http://10.0.0.{i}:8000" for i in range(1, 6)]
SESSIONS = [f"session-{i}" for i in range(400)]


# ---------------------------------------------------------------------- flag values


def test_dns_flag_values_parse() -> None:
    got = parse_dns_targets(
        " md-decode-pods.ns.svc.cluster.local:8000 , [::1]:81,10.1.2.3:9,x:1", "--decode-dns"
    )
    assert got == [
        DnsTarget("md-decode-pods.ns.svc.cluster.local", 8000),
        DnsTarget("::1", 81),
        DnsTarget("10.1.2.3", 9),
        DnsTarget("x", 1),
    ]
    assert str(got[1]) == "[::1]:81"
    assert parse_dns_targets("", "--decode-dns") == []
    assert parse_dns_targets("a:1,a:1", "--decode-dns") == [DnsTarget("a", 1)]


@pytest.mark.parametrize(
    "value, why",
    [
        ("svc", "has no port"),
        ("svc:", "has no port"),
        (":80", "has no host"),
        ("svc:0", "1..65535"),
        ("svc:70000", "1..65535"),
        ("svc:http", "1..65535"),
        ("http://svc:80", "is a URL"),
        ("svc:80,", "an empty entry"),
        ("::1:80", "in brackets"),
        ("[fe80::zz]:80", "not an IPv6 address"),
        ("bad_name!:80", "not a valid DNS name"),
        ("a..b:80", "not a valid DNS name"),
    ],
)
def test_a_malformed_dns_value_is_a_startup_error(value: str, why: str, capsys) -> None:
    from pagoda.node_agent.cli.main import main

    with pytest.raises(ValueError, match=why) as err:
        parse_dns_targets(value, "--prefill-dns")
    assert "--prefill-dns" in str(err.value)
    code = main(["serve", "--role", "router", "--prefill-dns", value, "--decode-endpoints", "http://d:1"])
    assert code == 2
    assert why in capsys.readouterr().err


def test_resolve_gives_one_backend_per_address() -> None:
    async def main() -> None:
        assert await resolve(DnsTarget("127.0.0.1", 8001)) == {"http://127.0.0.1:8001"}
        assert await resolve(DnsTarget("::1", 8002)) == {"http://[::1]:8002"}
        local = await resolve(DnsTarget("localhost", 8003))
        assert local and local <= {"http://127.0.0.1:8003", "http://[::1]:8003"}
        with pytest.raises(OSError):
            await resolve(DnsTarget("no-such-host.invalid", 80))  # RFC 6761: never resolves

    asyncio.run(main())


# ---------------------------------------------------------------------- DNS without live workers


class FakeDns:
    """A resolver over a table the test edits (names missing from it fail like NXDOMAIN)."""

    def __init__(self, table: dict[str, set[str]]) -> None:
        self.table = table

    async def __call__(self, target: DnsTarget) -> set[str]:
        if target.host not in self.table:
            raise OSError(f"{target.host}: Name or service not known")
        return set(self.table[target.host])


def test_a_dns_failure_keeps_the_last_addresses_and_is_counted() -> None:
    dns = FakeDns({"a": {"http://10.0.0.1:1"}, "b": {"http://10.0.0.2:1"}})
    errors: list[str] = []
    watch = DnsWatch(
        {"decode": [DnsTarget("a", 1), DnsTarget("b", 1)]}, lambda role, t, exc: errors.append(str(t)), dns
    )

    async def main() -> None:
        assert await watch.refresh() == {"decode": {"http://10.0.0.1:1", "http://10.0.0.2:1"}}
        del dns.table["a"]
        dns.table["b"] = {"http://10.0.0.3:1"}
        assert await watch.refresh() == {"decode": {"http://10.0.0.1:1", "http://10.0.0.3:1"}}
        assert errors == ["a:1"]

    asyncio.run(main())

    # the router counts and keeps going; a name that never resolved leaves that role empty (not ready)
    async def router_main() -> None:
        m = ServeMetrics("router")
        settings = RouterSettings(["http://127.0.0.1:9"], [], decode_dns=[DnsTarget("gone", 8000)])
        router = Router(settings, m, InternalAuth(TOKEN), resolver=FakeDns({}))
        await router.start()
        try:
            await router.discover()
            assert router.decode == [] and not router.ready
            text = m.render().decode()
            assert metric_sum(parse_metrics(text), "pagoda_router_dns_errors_total", target="gone:8000") == 2
        finally:
            await router.stop()

    asyncio.run(router_main())


def picks(router: Router, role: str = "decode") -> dict[str, str]:
    workers = router.decode if role == "decode" else router.prefill
    out = {}
    for s in SESSIONS:
        w, rule = router._pick(workers, role, GenRequest("hi", SamplingParams(), session=s), None)
        assert rule == "affinity"
        out[s] = w.url
    return out


def test_two_routers_agree_and_a_leaving_pod_moves_only_its_sessions() -> None:
    """Router A has the pods as static URLs, router B finds them by DNS (another order); with the same
    ready pods they send every session to the same pod. When one pod leaves (B: gone from DNS; A:
    marked down) exactly its sessions move, and both routers still agree."""
    dns = FakeDns({"decode-pods": set(PODS)})

    async def main() -> None:
        a = Router(
            RouterSettings(["http://p:1"], list(reversed(PODS))), ServeMetrics("router"), InternalAuth(TOKEN)
        )
        b = Router(
            RouterSettings(["http://p:1"], [], decode_dns=[DnsTarget("decode-pods", 8000)]),
            ServeMetrics("router"),
            InternalAuth(TOKEN),
            resolver=dns,
        )
        await a.start()
        await b.start()
        try:
            for w in a.decode + b.decode:
                w.ready = True  # as the health poll would find them
            before = picks(a)
            assert picks(b) == before
            assert set(Counter(before.values())) and len(set(before.values())) == len(PODS)  # spread
            leaving = PODS[2]
            dns.table["decode-pods"] = set(PODS) - {leaving}
            await b.discover()
            assert leaving not in [w.url for w in b.decode]
            next(w for w in a.decode if w.url == leaving).mark_down("test")
            after = picks(a)
            assert picks(b) == after
            moved = {s for s in SESSIONS if before[s] != after[s]}
            assert moved == {s for s in SESSIONS if before[s] == leaving}
            assert leaving not in after.values()
        finally:
            await a.stop()
            await b.stop()

    asyncio.run(main())


def test_rendezvous_pick_does_not_depend_on_order() -> None:
    for s in SESSIONS[:50]:
        assert hashing.pick(s, PODS, str) == hashing.pick(s, list(reversed(PODS)), str)
    with pytest.raises(ValueError):
        hashing.pick("s", [], str)


# ---------------------------------------------------------------------- live workers


def _app(role: str, engine, token_file) -> object:
    from pagoda.node_agent.cli.serve import add_serve_args, build_app

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin://smollm2-135m")
    ap.add_argument("--no-prefix-caching", action="store_true")
    add_serve_args(ap)
    args = ap.parse_args(["--role", role, "--internal-token-file", str(token_file), "--kv-port", "0"])
    return build_app(args, engine=engine)


@pytest.fixture(scope="module")
def pods(make_engine, tmp_path_factory):
    """One live prefill worker and two live decode workers (in-process, shared weights)."""
    token_file = tmp_path_factory.mktemp("token") / "token"
    token_file.write_text(TOKEN)
    servers: dict[str, LiveServer] = {}
    try:
        for name in ("prefill", "decode-1", "decode-2"):
            eng = make_engine(kv_memory=16 << 20, max_num_seqs=4, max_model_len=256)
            app = _app(name.split("-")[0], eng, token_file)
            servers[name] = LiveServer(app).start()
        yield servers
    finally:
        for s in servers.values():
            s.stop()


@pytest.mark.slow
@pytest.mark.serve
@pytest.mark.timeout(180)
def test_pods_leave_mid_stream_come_back_fresh_and_a_draining_one_is_skipped(pods) -> None:
    d1, d2 = pods["decode-1"].url, pods["decode-2"].url
    prefill_port = pods["prefill"].port
    dns = FakeDns({"decode-pods": {d1, d2}})
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    session = next(s for s in SESSIONS if hashing.pick(s, [d1, d2], str) == d1)  # lands on decode-1
    m = ServeMetrics("router")

    async def run(router: Router, req: GenRequest) -> str:
        (h,) = await router.open_all([req])
        text = []
        async for c in h:
            assert not c.error
            text.append(c.delta)
        return h.worker.url

    async def main() -> None:
        settings = RouterSettings(
            [],
            [],
            prefill_dns=[DnsTarget("127.0.0.1", prefill_port)],  # the real resolver, a literal address
            decode_dns=[DnsTarget("decode-pods", 8000)],
        )
        router = Router(settings, m, InternalAuth(TOKEN), resolver=_real_for_literals(dns))
        await router.start()
        try:
            assert router.ready and [w.ready for w in router.decode] == [True, True]
            req = GenRequest("Once upon a time", params, session=session)
            # a stream on decode-1 survives decode-1 leaving DNS; new requests of its session move
            (h,) = await router.open_all([req])
            assert h.worker.url == d1
            it = aiter(h)
            first = await anext(it)
            dns.table["decode-pods"] = {d2}
            await router.discover()
            assert [w.url for w in router.decode] == [d2]
            h.worker.mark_down("the test marks the departed pod down")
            rest = [c async for c in it]
            assert not first.error and rest and rest[-1].finished and not rest[-1].error
            assert h.worker.inflight == 0
            assert await run(router, req) == d2
            # decode-1 comes back: a fresh worker (its old mark-down forgotten), its sessions return
            dns.table["decode-pods"] = {d1, d2}
            await router.discover()
            assert {w.url: w.ready for w in router.decode} == {d1: True, d2: True}
            assert await run(router, req) == d1
            # decode-1 drains: it refuses the new stream, the router marks it (alone) down, uses decode-2
            pods["decode-1"].server.config.app.state.drain.begin()
            assert await run(router, req) == d2
            assert {w.url: w.ready for w in router.decode} == {d1: False, d2: True}
            await router.poll()  # its /internal/state says draining too
            assert {w.url: w.ready for w in router.decode} == {d1: False, d2: True}
            # both draining: the last refusal is the client's answer, to retry elsewhere
            pods["decode-2"].server.config.app.state.drain.begin()
            with pytest.raises(ApiError) as err:
                await router.open_all([req])
            assert err.value.status == 503 and err.value.headers["Retry-After"] == "1"
            assert "draining" in err.value.message and d2 in err.value.message
            assert router.inflight == 0 and all(w.inflight == 0 for w in router.decode)
        finally:
            for name in ("decode-1", "decode-2"):
                pods[name].server.config.app.state.drain.draining = False
            await router.stop()

    asyncio.run(main())
    routed = parse_metrics(m.render().decode())
    assert metric_sum(routed, "pagoda_router_routed_total", worker=d2, rule="affinity") == 2
    # decode-1's series were dropped when it left DNS: only its decision after it came back counts
    assert metric_sum(routed, "pagoda_router_routed_total", worker=d1, rule="affinity") == 1


def _real_for_literals(fake: FakeDns):
    """The real resolver for IP literals, ``fake`` for names."""

    async def resolver(target: DnsTarget) -> set[str]:
        if target.host[0].isdigit():
            return await resolve(target)
        return await fake(target)

    return resolver
