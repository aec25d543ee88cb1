"""The quality probe through the serving path: ``POST /internal/score`` on live servers (real HTTP,
internal auth), ``pagoda eval --remote`` between two of them, the continuous probe's gauges and
report, and the corruption drill that the gate must catch.

Three live single-process servers over the built-in model share one module fixture: the reference
(dense float32 weights and KV), an honest format change (INT4 decode weights, INT8 decode KV) and
the same change with the drill (layer 10's output projections scaled by 1.5 at load)."""

from __future__ import annotations

import argparse
import json

import httpx
import pytest
import torch

from pagoda.node_agent.serving.api.internal_auth import InternalAuth
from pagoda.node_agent.serving.api.metrics import metric_sum
from pagoda.quality_probe import PROBE_PROMPTS, PROBE_TEXT, SCORE_PATH, ProbeSet, ScoreResponse

from .live import LiveServer, metrics

# about 75 s on 2 cores: three engines built once (about 40 s), then about 35 s of scoring
pytestmark = [pytest.mark.slow, pytest.mark.serve, pytest.mark.timeout(600)]

TOKEN = "quality-probe-test-token-0123456789"
AUTH = InternalAuth(TOKEN)
CANDIDATE = "bf16/bf16/int4/int8"
PROMPTS = list(PROBE_PROMPTS[:3])
NEW = 8
ENGINE = {"kv_memory": 64 << 20, "max_num_seqs": 8, "max_model_len": 512}


def serve_args(token_file: str, *flags: str) -> argparse.Namespace:
    from pagoda.node_agent.cli.engine_args import add_engine_args
    from pagoda.node_agent.cli.serve import add_serve_args

    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    add_serve_args(ap)
    base = ["--model", "builtin://smollm2-135m", "--tenant-secret", "s", "--internal-token-file", token_file]
    return ap.parse_args([*base, *flags])


class Counting:
    """Counts the engine's forward passes that score (wraps the real runner's ``score``) and the
    user sequences running at each (the probe must run in a gap)."""

    def __init__(self, engine) -> None:
        self.calls = 0
        self.running_at: list[int] = []
        inner = engine.runner.score

        def score(*args, **kw):
            self.calls += 1
            self.running_at.append(len(engine.scheduler.running) + len(engine.scheduler.waiting))
            return inner(*args, **kw)

        engine.runner.score = score


@pytest.fixture(scope="module")
def servers(make_engine, tmp_path_factory):
    """{"ref", "honest", "bad"}: (url, engine, counter); plus the offline figures taken first."""
    from pagoda.node_agent.bench.evaluate import greedy_tokens, kl_top1
    from pagoda.node_agent.cli.serve import build_app
    from pagoda.node_agent.engine.config import PhaseFormats

    d = tmp_path_factory.mktemp("quality")
    token_file = d / "token"
    token_file.write_text(TOKEN)
    reference, probe_set = d / "reference.json", d / "probes.json"
    probe_set.write_text(json.dumps({"prompts": PROMPTS}))
    engines = {
        "ref": make_engine(**ENGINE),
        "honest": make_engine(formats=PhaseFormats.parse(CANDIDATE), **ENGINE),
        "bad": make_engine(
            formats=PhaseFormats.parse(CANDIDATE),
            fault_injection=True,
            corrupt_layer=10,
            corrupt_scale=1.5,
            **ENGINE,
        ),
    }
    honest = engines["honest"]
    ids = honest.tokenize(PROBE_TEXT)
    offline = {
        "ids": ids,
        "logits": honest.score(ids),
        "greedy": greedy_tokens(honest, PROMPTS, NEW),
        "kl_top1": kl_top1(engines["ref"].score(ids), honest.score(ids)),
    }
    for e in engines.values():
        e.decode_pool.clear_prefix_cache()
    # the honest server probes itself continuously against the reference server's recorded score
    # (written below, once the reference serves; the loop's interval is long, the test calls it)
    started, out = [], {}
    try:
        for name, eng in engines.items():
            flags = ["--quality-reference", str(reference), "--quality-probe-set", str(probe_set)]
            flags = flags if name == "honest" else []
            if name == "honest":
                ref_url = started[0].url
                body = ProbeSet(prompts=PROMPTS, max_new_tokens=NEW).request()
                answer = post(ref_url, body)
                assert answer.status_code == 200, answer.text
                reference.write_text(answer.text)
            app = build_app(
                serve_args(str(token_file), *flags, "--quality-probe-interval", "3600"), engine=eng
            )
            out[name] = (LiveServer(app).start(), eng, Counting(eng), app)
            started.append(out[name][0])
        yield {k: (v[0].url, v[1], v[2], v[3]) for k, v in out.items()} | {"offline": offline}
    finally:
        for s in started:
            s.stop()


def post(url: str, body, auth: InternalAuth | None = AUTH, **kw) -> httpx.Response:
    headers = auth.headers("POST", SCORE_PATH) if auth else {}
    return httpx.post(url + SCORE_PATH, json=body, headers=headers, timeout=300, **kw)


def test_the_endpoint_needs_the_internal_proof_before_the_body(servers) -> None:
    url, _, counter, _ = servers["ref"]
    before = counter.calls
    assert post(url, {"texts": [{"text": "x y"}]}, auth=None).status_code == 401
    forged = InternalAuth("another-token-0123456789abcdef")
    assert post(url, {"texts": [{"text": "x y"}]}, auth=forged).status_code == 403
    h = AUTH.headers("POST", SCORE_PATH)  # a proof is single-use: a replay is refused
    assert httpx.post(url + SCORE_PATH, json={}, headers=h, timeout=30).status_code == 200
    assert httpx.post(url + SCORE_PATH, json={}, headers=h, timeout=30).status_code == 403
    assert counter.calls == before


@pytest.mark.parametrize(
    "body",
    [
        [1, 2],
        {"texts": "abc"},
        {"texts": [{"text": ""}]},
        {"texts": [{"token_ids": [1]}]},
        {"texts": [{"token_ids": [1, 49152]}]},
        {"texts": [{"token_ids": [1, 2, 3], "targets": [[1]]}]},
        {"texts": [{"token_ids": [1, 2], "targets": [list(range(21))]}]},
        {"texts": [{"text": "hi there"}], "top_k": 0},
        {"prompts": ["hi"], "max_new_tokens": 100000},
        {"texts": [{"text": "word " * 600}]},  # over this pod's 512-token context / KV capacity
        {"prompts": ["word " * 600]},
    ],
)
def test_bad_bodies_are_400_before_any_compute(servers, body) -> None:
    url, eng, counter, _ = servers["ref"]
    before, steps = counter.calls, eng.stats.steps
    r = post(url, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"]
    assert counter.calls == before and eng.stats.steps == steps


def test_not_json_is_400(servers) -> None:
    url = servers["ref"][0]
    r = httpx.post(url + SCORE_PATH, content=b"{nope", headers=AUTH.headers("POST", SCORE_PATH), timeout=30)
    assert r.status_code == 400


def test_scores_equal_offline_teacher_forcing_and_greedy_of_the_same_engine(servers) -> None:
    url = servers["honest"][0]
    off = servers["offline"]
    r = post(url, {"texts": [{"text": PROBE_TEXT}], "prompts": PROMPTS, "max_new_tokens": NEW, "top_k": 5})
    assert r.status_code == 200, r.text
    resp = ScoreResponse.from_json(r.json())
    assert resp.formats["decode_weights"] == "int4" and resp.formats["decode_kv"] == "int8"
    (text,) = resp.texts
    assert text.token_ids == off["ids"] and len(text.top) == len(off["ids"]) - 1
    lp = torch.log_softmax(off["logits"][:-1].double(), dim=-1)
    vals, idx = torch.topk(lp, 5, dim=-1)
    assert [[i for i, _ in pos] for pos in text.top] == idx.tolist()
    got = torch.tensor([[v for _, v in pos] for pos in text.top], dtype=torch.float64)
    assert torch.allclose(got, vals, atol=1e-6, rtol=0)
    assert resp.greedy == off["greedy"]


def test_targets_are_the_logprobs_of_the_named_tokens(servers) -> None:
    url = servers["honest"][0]
    off = servers["offline"]
    ids = off["ids"][:40]
    targets = [[7, ids[p + 1], 100] for p in range(len(ids) - 1)]
    r = post(url, {"texts": [{"token_ids": ids, "targets": targets}], "max_new_tokens": 0})
    assert r.status_code == 200, r.text
    (text,) = ScoreResponse.from_json(r.json()).texts
    lp = torch.log_softmax(off["logits"][: len(ids) - 1].double(), dim=-1)  # causal: a prefix scores alike
    want = lp.gather(1, torch.tensor(targets)).tolist()
    assert torch.allclose(
        torch.tensor(text.targets, dtype=torch.float64), torch.tensor(want, dtype=torch.float64), atol=1e-6
    )


def remote_eval(remote: str, reference: str, token_file: str, tmp_path) -> tuple[int, dict]:
    """``pagoda eval --remote`` as its CLI parses it; (exit status, its JSON result)."""
    from pagoda.node_agent.cli.main import build_parser

    out = tmp_path / "remote.json"
    argv = ["eval", "--remote", remote, "--reference", reference, "--internal-token-file", token_file]
    argv += ["--num-prompts", str(len(PROMPTS)), "--max-new-tokens", str(NEW), "--json", str(out)]
    a = build_parser().parse_args(argv)
    rc = a.func(a)
    return rc, json.loads(out.read_text()) if out.exists() else {}


@pytest.fixture(scope="module")
def token_file(tmp_path_factory) -> str:
    p = tmp_path_factory.mktemp("tok") / "token"
    p.write_text(TOKEN)
    return str(p)


def test_remote_eval_reproduces_offline_and_an_honest_change_passes(servers, token_file, tmp_path) -> None:
    rc, result = remote_eval(servers["honest"][0], servers["ref"][0], token_file, tmp_path)
    assert rc == 0, result
    row = result["rows"][0]
    kl, top1 = servers["offline"]["kl_top1"]
    # the remote KL is over the top-20 plus the rest (a lower bound) on T - 1 positions
    assert row["mean_kl"] <= kl + 1e-6 and row["mean_kl"] >= 0.7 * kl
    assert abs(row["top1"] - top1) <= 2 / len(servers["offline"]["ids"])
    assert result["gate"]["passed"] and row["formats"] == CANDIDATE


def test_the_drill_fails_the_default_gate(servers, token_file, tmp_path) -> None:
    rc, result = remote_eval(servers["bad"][0], servers["ref"][0], token_file, tmp_path)
    assert rc == 1
    g = result["gate"]
    assert not g["passed"] and g["figures"]["meanKL"] > 0.02 and g["figures"]["top1"] < 0.9, g


def test_remote_eval_without_the_token_or_with_a_wrong_one_exits_2(servers, tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("PAGODA_INTERNAL_TOKEN", raising=False)
    monkeypatch.delenv("PAGODA_INTERNAL_TOKEN_FILE", raising=False)
    from pagoda.node_agent.cli.main import build_parser

    a = build_parser().parse_args(
        ["eval", "--remote", servers["honest"][0], "--reference", servers["ref"][0]]
    )
    assert a.func(a) == 2
    wrong = tmp_path / "t"
    wrong.write_text("a-wrong-token-0123456789")
    argv = ["eval", "--remote", servers["honest"][0], "--reference", servers["ref"][0]]
    a = build_parser().parse_args([*argv, "--internal-token-file", str(wrong)])
    assert a.func(a) == 2


def test_the_continuous_probe_exports_gauges_and_reports(servers) -> None:
    import asyncio

    from pagoda.agent_report import AgentReport

    url, _, _, app = servers["honest"]
    loop = app.state.quality
    assert loop.report() is None
    fut = asyncio.run_coroutine_threadsafe(loop.probe_once(), loop.event_loop)
    result = fut.result(300)
    m = metrics(url)
    assert metric_sum(m, "pagoda_quality_kl") == pytest.approx(result.mean_kl)
    assert 0.9 < metric_sum(m, "pagoda_quality_top1") <= 1.0
    assert metric_sum(m, "pagoda_quality_greedy_prefix") == pytest.approx(result.greedy_prefix)
    assert metric_sum(m, "pagoda_quality_probe_seconds") > 0
    assert metric_sum(m, "pagoda_quality_probes_total", result="ok") == 1
    report = loop.report()
    assert report.probes == 1 and report.mean_kl == result.mean_kl and report.last_probe_time is not None
    back = AgentReport.from_status(AgentReport(quality=report).to_status())
    assert back.quality is not None and back.quality.top1 == pytest.approx(result.top1, abs=1e-4)
    assert AgentReport.from_status({"pool": "decode"}).quality is None  # an older agent: absent


def test_the_score_waits_for_a_gap_behind_user_requests(servers) -> None:
    """A score posted while a user request decodes runs its forward pass only once no user
    sequence is running or waiting (the request is far shorter than the 10 s gap wait)."""
    import threading

    url, _, counter, _ = servers["ref"]
    body = {"model": "smollm2-135m", "prompt": "Once upon a time", "max_tokens": 48, "temperature": 0}
    body |= {"stream": True, "ignore_eos": True}
    started, done = threading.Event(), threading.Event()

    def user() -> None:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            for _ in r.iter_lines():
                started.set()
        done.set()

    t = threading.Thread(target=user)
    t.start()
    assert started.wait(60)
    n = counter.calls
    assert not done.is_set()
    r = post(url, {"texts": [{"token_ids": servers["offline"]["ids"][:32]}], "max_new_tokens": 0})
    t.join(120)
    assert r.status_code == 200 and done.is_set()
    assert counter.calls == n + 1 and counter.running_at[-1] == 0


@pytest.fixture(scope="module")
def decode_worker(make_engine, tmp_path_factory):
    from pagoda.node_agent.cli.serve import build_app
    from pagoda.node_agent.serving.launch import free_port

    token_file = tmp_path_factory.mktemp("dw") / "token"
    token_file.write_text(TOKEN)
    a = serve_args(str(token_file), "--role", "decode", "--kv-port", str(free_port()))
    server = LiveServer(build_app(a, engine=make_engine(role="decode", **ENGINE))).start()
    try:
        yield server.url
    finally:
        server.stop()


def test_a_decode_worker_scores_through_its_own_phase(decode_worker) -> None:
    assert post(decode_worker, {}, auth=None).status_code == 401
    r = post(decode_worker, {"texts": [{"text": PROBE_TEXT}], "prompts": PROMPTS[:1], "max_new_tokens": 4})
    assert r.status_code == 200, r.text
    resp = ScoreResponse.from_json(r.json())
    assert resp.formats["role"] == "decode" and resp.formats["scored_phase"] == "decode"
    assert len(resp.texts[0].top) == len(resp.texts[0].token_ids) - 1 and len(resp.greedy[0]) == 4
