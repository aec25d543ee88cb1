"""Integrity fault soak (``pagoda bench integrity --soak``): thousands of requests with page churn,
and stale mappings and flipped tags injected into live requests, with every outcome accounted for.

Churn: a small KV budget (preemption and recompute in both pools), prompts that share cached prefix
pages, a prefill pool in another KV format than the decode pool (every sequence migrates), and a
share of requests run as prefill-only whose payload is handed back to the engine's decode pool
(``add_prefilled``, the in-process form of a disaggregated handoff). Arrivals are random and keep
about ``in_flight`` requests live.

Injection: a share of requests is marked as victims on arrival. Each time a batch of live sequences
is about to be tag-checked (a prefill or decode step, or a migration), each marked sequence in it
that maps pages gets, with probability ``inject_prob``, one fault (a stale mapping or a flipped
expected tag, half each) through the engine's fault injector, right before the check. The soak
tallies, for every check: injected faults the check flagged (detections), injected faults it did
not (misses), and sequences it flagged that carried no fault (false positives). At the end: victims
that did not end with an integrity error, bystanders (never injected) that did not finish normally
or whose tokens differ from a fault-free run of the same prompt, and pages still referenced
(the free count must be back to the pool's size).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

from pagoda.node_agent.bench.common import Log, echo, environment, set_threads
from pagoda.node_agent.engine.fault_injection import FaultInjectionError
from pagoda.node_agent.engine.source_formats import resolve_weight_formats
from pagoda.node_agent.params import CapacityError, SamplingParams

KINDS = ("stale_mapping", "flip_tag")
STUCK_STEPS = 500  # steps in a row with no output: the soak ends what is still open as failures
# the engine logs every integrity abort and preemption; the soak counts them instead
QUIET = ("pagoda.engine", "pagoda.integrity", "pagoda.kv", "pagoda.scheduler")


@contextlib.contextmanager
def quiet_engine_logs():
    """Only CRITICAL records from the engine's loggers while the soak runs (levels restored after)."""
    loggers = [logging.getLogger(n) for n in QUIET]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


@dataclass
class SoakPlan:
    """How much and what kind of load the soak runs (defaults: the documented run)."""

    requests: int = 15000
    in_flight: int = 24
    victim_share: float = 0.75  # requests marked for a fault on arrival
    inject_prob: float = 0.5  # per check of a marked sequence that maps pages
    handoff_share: float = 0.2  # requests run prefill-only, then handed to the decode pool
    prefixes: int = 6  # shared prompt prefixes (cached pages reused across requests)
    prefix_tokens: int = 40
    suffixes: int = 12
    suffix_tokens: tuple[int, int] = (4, 24)
    max_tokens: tuple[int, ...] = (2, 8, 32)
    seed: int = 0
    progress_every: int = 2000


@dataclass
class Tally:
    """What the injecting wrapper saw, check by check."""

    checks: int = 0
    injected: Counter = field(default_factory=Counter)
    detected: Counter = field(default_factory=Counter)
    missed: Counter = field(default_factory=Counter)
    skipped: int = 0  # an injection the pool could not apply (no unreferenced page to reallocate)
    false_positives: int = 0
    injected_in: Counter = field(default_factory=Counter)  # "prefill" / "decode" / "migration"


class Injector:
    """Wraps the engine's tag check: injects faults into marked sequences just before it runs."""

    def __init__(self, engine, plan: SoakPlan, rng: random.Random) -> None:
        self.engine, self.plan, self.rng = engine, plan, rng
        self.marked: set[str] = set()
        self.victims: dict[str, str] = {}  # request id -> fault kind
        self.tally = Tally()
        self._check = engine.replica.check_tags
        engine.replica.check_tags = self.check

    def close(self) -> None:
        del self.engine.replica.check_tags  # the class's own method again

    def check(self, integrity, seqs, pool, tables=None):
        # a step hands its prebuilt block tables; a migration's check builds its own
        phase = "prefill" if any(s.needs_prefill for s in seqs) else "decode"
        where = "migration" if tables is None else phase
        hit = [(s, k) for s in seqs if (k := self._maybe_inject(s)) is not None]
        if hit:
            self.tally.injected_in[where] += len(hit)
        bad = self._check(integrity, seqs, pool, None if hit else tables)  # prebuilt tables predate the fault
        t = self.tally
        t.checks += 1
        for s, k in hit:
            (t.detected if s in bad else t.missed)[k] += 1
        t.false_positives += sum(1 for s in bad if s.request_id not in self.victims)
        return bad

    def _maybe_inject(self, seq) -> str | None:
        rid = seq.request_id
        if rid not in self.marked or not seq.block_table or self.rng.random() >= self.plan.inject_prob:
            return None
        kind = self.rng.choice(KINDS)
        try:
            getattr(self.engine.faults, kind)(rid)
        except FaultInjectionError:
            self.tally.skipped += 1
            return None
        self.marked.discard(rid)
        self.victims[rid] = kind
        self.tally.injected[kind] += 1
        return kind


class Workload:
    """Prompts built from shared prefixes and suffixes (token ids), and their fault-free outputs."""

    def __init__(self, plan: SoakPlan, vocab: int) -> None:
        rng = random.Random(plan.seed + 1)
        tok = lambda n: [rng.randrange(100, vocab - 100) for _ in range(n)]  # noqa: E731
        self.prefixes = [tok(plan.prefix_tokens) for _ in range(plan.prefixes)]
        self.suffixes = [tok(rng.randint(*plan.suffix_tokens)) for _ in range(plan.suffixes)]
        self.reference: dict[tuple[int, int], list[int]] = {}

    def prompt(self, key: tuple[int, int]) -> list[int]:
        return self.prefixes[key[0]] + self.suffixes[key[1]]

    def keys(self) -> list[tuple[int, int]]:
        return [(p, s) for p in range(len(self.prefixes)) for s in range(len(self.suffixes))]

    def fault_free_reference(self, engine, max_tokens: int) -> None:
        """Every prompt once, in one batch on a fault-free engine with room for all (same model and
        formats): its greedy tokens, the output a bystander must reproduce."""
        ids = {key: engine.add_request(self.prompt(key), greedy(max_tokens)) for key in self.keys()}
        final = engine.run_until_done()
        self.reference = {key: list(final[rid].token_ids) for key, rid in ids.items()}


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@dataclass
class Outcomes:
    finished: int = 0
    victims_failed_closed: int = 0
    victims_wrong_outcome: int = 0  # a victim that did not end with an integrity error and no text
    bystanders: int = 0
    bystander_errors: int = 0  # bystanders that did not finish normally
    bystander_mismatches: int = 0  # bystanders whose tokens differ from the fault-free reference
    handoffs: int = 0
    handoff_retries: int = 0
    stuck: int = 0  # requests that could never progress (the pools lost pages), ended by the soak
    examples: list[str] = field(default_factory=list)


class Soak:
    """One soak run on one engine: submit, step, hand off, and judge every final output."""

    def __init__(self, engine, plan: SoakPlan, work: Workload, log: Log) -> None:
        self.engine, self.plan, self.work, self.log = engine, plan, work, log
        self.rng = random.Random(plan.seed)
        self.inj = Injector(engine, plan, random.Random(plan.seed + 2))
        self.meta: dict[str, tuple[tuple[int, int], int]] = {}  # request id -> (prompt key, max_tokens)
        self.pending: list[tuple[str, object]] = []  # (decode-half id, payload) waiting for decode pages
        self.out = Outcomes()
        self.submitted = 0
        self.live = 0
        self.idle = 0
        self._next_report = plan.progress_every
        self.open: set[str] = set()  # request ids live in the engine

    def submit(self) -> None:
        p, n = self.plan, self.submitted
        key = (self.rng.randrange(p.prefixes), self.rng.randrange(p.suffixes))
        max_tokens = self.rng.choice(p.max_tokens)
        rid = f"r{n}"
        prefill_only = self.rng.random() < p.handoff_share
        self.engine.add_request(self.work.prompt(key), greedy(max_tokens), rid, prefill_only=prefill_only)
        self.meta[rid] = (key, max_tokens)
        self.open.add(rid)
        if self.rng.random() < p.victim_share:
            self.inj.marked.add(rid)
        self.submitted += 1
        self.live += 1

    def hand_off(self) -> None:
        """Give waiting prefill-only payloads to the decode pool (retried while it is full)."""
        waiting, self.pending = self.pending, []
        for rid, payload in waiting:
            key, max_tokens = self.meta[rid.removesuffix(".d")]
            try:
                self.engine.add_prefilled(payload, greedy(max_tokens), request_id=rid)
            except CapacityError:
                self.out.handoff_retries += 1
                self.pending.append((rid, payload))
                continue
            self.meta[rid] = (key, max_tokens)
            self.open.add(rid)
            self.out.handoffs += 1

    def judge(self, o) -> None:
        self.open.discard(o.request_id)
        if o.finish_reason == "prefilled" and o.kv_payload is not None:
            rid = f"{o.request_id}.d"
            if o.request_id in self.inj.marked:  # not injected yet: the decode half may be
                self.inj.marked.discard(o.request_id)
                self.inj.marked.add(rid)
            self.pending.append((rid, o.kv_payload))
            return
        self.live -= 1
        self.out.finished += 1
        logical = o.request_id.removesuffix(".d")
        if o.request_id in self.inj.victims:
            ok = o.finish_reason == "error" and "KV integrity" in (o.error or "") and o.text == ""
            self.out.victims_failed_closed += ok
            self.out.victims_wrong_outcome += not ok
            if not ok:
                self._example(f"victim {o.request_id}: {o.finish_reason} {o.error!r}")
            return
        self.inj.marked.discard(o.request_id)
        self.out.bystanders += 1
        key, max_tokens = self.meta[logical]
        if o.finish_reason != "length":
            self.out.bystander_errors += 1
            self._example(f"bystander {o.request_id}: {o.finish_reason} {o.error!r}")
        elif list(o.token_ids) != self.work.reference[key][:max_tokens]:
            self.out.bystander_mismatches += 1
            self._example(f"bystander {o.request_id}: tokens differ from the fault-free run")

    def _give_up(self) -> None:
        """Nothing progressed for STUCK_STEPS steps (pages lost, so nothing fits): every request still
        open, in the engine or waiting to hand off, ends as a failure."""
        stuck = [rid for rid, _ in self.pending] + list(self.open)
        self.pending = []
        for rid in stuck:
            self.engine.abort(rid, "the soak gave up: no progress")
            self.open.discard(rid)
            self.live -= 1
            self.out.finished += 1
            self.out.stuck += 1
            if rid in self.inj.victims:
                self.out.victims_wrong_outcome += 1
            else:
                self.out.bystanders += 1
                self.out.bystander_errors += 1
            self._example(f"{rid}: stuck (no step progressed for {STUCK_STEPS} steps)")

    def _example(self, line: str) -> None:
        if len(self.out.examples) < 10:
            self.out.examples.append(line)

    def run(self) -> float:
        """Run every request to its end; returns the wall time in seconds."""
        t0, eng, p = time.perf_counter(), self.engine, self.plan
        try:
            while self.submitted < p.requests or self.live or self.pending:
                while self.submitted < p.requests and self.live < p.in_flight and self.rng.random() < 0.8:
                    self.submit()
                if self.pending:
                    self.hand_off()
                outs = eng.step()
                self.idle = 0 if outs else self.idle + 1
                if self.idle > STUCK_STEPS:
                    self._give_up()
                for o in outs:
                    if o.finished:
                        self.judge(o)
                if not outs and not self.pending and eng.stalled():
                    raise RuntimeError("engine stalled with unfinished requests")
                if p.progress_every and self.out.finished >= self._next_report:
                    self._next_report += p.progress_every
                    self._progress(time.perf_counter() - t0)
        finally:
            self.inj.close()
        return time.perf_counter() - t0

    def _progress(self, wall: float) -> None:
        t, done = self.inj.tally, self.out.finished
        self.log(
            f"  {done} requests done, {sum(t.injected.values())} faults injected, "
            f"{sum(t.detected.values())} detected, {t.false_positives} false positives, {wall:.0f} s"
        )


def pool_report(pool, start_free: int) -> dict:
    leaked = pool.allocator.leaked()
    return {
        "name": pool.name,
        "kv_format": pool.format.name,
        "pages": pool.num_pages,
        "free_at_start": start_free,
        "free_at_end": pool.num_free,
        "leaked_pages": len(leaked),
        "allocations": pool.allocations,
    }


def soak_report(engine, soak: Soak, wall: float, starts: dict[str, int]) -> dict:
    """The soak's figures (every count the docs and the test read)."""
    t, o, c = soak.inj.tally, soak.out, engine.integrity.counters
    pools = [pool_report(p, starts[name]) for name, p in engine.pools().items()]
    injected = sum(t.injected.values())
    return {
        "requests": soak.submitted,
        "wall_s": wall,
        "faults_injected": injected,
        "faults_by_kind": dict(t.injected),
        "faults_by_site": dict(t.injected_in),
        "detected": sum(t.detected.values()),
        "missed": sum(t.missed.values()),
        "detection_pct": 100.0 * sum(t.detected.values()) / injected if injected else None,
        "injections_skipped": t.skipped,
        "false_positives": t.false_positives,
        "checks": c.checks,
        "pages_checked": c.pages_checked,
        "page_allocations": sum(p["allocations"] for p in pools),
        "preemptions": engine.scheduler.num_preemptions,
        "prefix_hit_tokens": engine.scheduler.prefix_hit_tokens,
        "migrations": engine.stats.migrations,
        "leaked_pages": sum(p["leaked_pages"] for p in pools),
        "pools": pools,
        **{k: v for k, v in asdict(o).items()},
        "bystander_failures": o.bystander_errors + o.bystander_mismatches,
        "integrity_counters": asdict(c),
    }


def soak_config(cfg, real_model: bool):
    """The engine config the soak runs: fault injection on; on the tiny model, dense bf16 weights
    (the KV formats are the config's) and, unless given, a KV budget small enough to preempt."""
    formats = cfg.formats
    if not real_model:
        formats = dataclasses.replace(formats, prefill_weights="bf16", decode_weights="bf16")
    return dataclasses.replace(
        cfg,
        fault_injection=True,
        formats=formats,
        kv_memory=cfg.kv_memory or (224 << 10),
        prefill_kv_fraction=0.5,
    )


def bench_soak(
    cfg, plan: SoakPlan, threads: int | None = 1, real_model: bool = False, log: Log = echo
) -> dict:
    """Run the soak on ``cfg``'s model (or a tiny random-weight model over its tokenizer)."""
    from pagoda.node_agent.bench.tiny_model import tiny_random_model
    from pagoda.node_agent.engine.llm_engine import LLMEngine
    from pagoda.node_agent.models.loader import load_model

    set_threads(threads)
    cfg = soak_config(cfg, real_model)
    loaded = load_model(cfg.model)
    model = loaded if real_model else tiny_random_model(loaded, seed=plan.seed)
    engine = LLMEngine(cfg, loaded=model)
    ref_cfg = dataclasses.replace(cfg, fault_injection=False, kv_memory=64 << 20)
    work = Workload(plan, engine.model_config.vocab_size)
    work.fault_free_reference(
        LLMEngine(ref_cfg, loaded=model, tokenizer=engine.tokenizer), max(plan.max_tokens)
    )
    starts = {name: p.num_free for name, p in engine.pools().items()}
    log(
        f"soak: {plan.requests} requests, ~{plan.in_flight} in flight, pools "
        + ", ".join(f"{p.name} {p.format.name} {p.num_pages} pages" for p in engine.pools().values())
        + ("" if real_model else f" (tiny random-weight model over {cfg.model}'s tokenizer)")
    )
    if engine.prefill_pool is engine.decode_pool:
        log("soak: one KV format for both phases, so no migration (give --decode-kv int8 for one)")
    soak = Soak(engine, plan, work, log)
    with quiet_engine_logs():
        wall = soak.run()
    report = soak_report(engine, soak, wall, starts)
    log(
        f"soak: {report['faults_injected']} faults injected ({report['faults_by_kind']}), "
        f"{report['detected']} detected, {report['missed']} missed, {report['false_positives']} false "
        f"positives over {report['pages_checked']} page checks and {report['page_allocations']} allocations, "
        f"{report['bystander_failures']} of {report['bystanders']} bystanders failed, "
        f"{report['leaked_pages']} pages leaked; {report['preemptions']} preemptions, "
        f"{report['migrations']} migrations, {report['handoffs']} handoffs, "
        f"{report['prefix_hit_tokens']} prefix-cache tokens reused; {wall:.0f} s"
    )
    for line in report["examples"]:
        log(f"  {line}")
    mc = engine.model_config
    return {
        "bench": "integrity-soak",
        **environment(),
        "model": cfg.model if real_model else f"tiny random weights over {cfg.model}'s tokenizer",
        "model_sizes": {
            "hidden_size": mc.hidden_size,
            "num_layers": mc.num_layers,
            "num_heads": mc.num_heads,
            "num_kv_heads": mc.num_kv_heads,
            "head_dim": mc.head_dim,
            "vocab_size": mc.vocab_size,
        },
        "dtype": str(engine.dtype),
        "formats": resolve_weight_formats(cfg).formats.as_dict(),  # auto weights as run
        "kv_memory": cfg.kv_memory,
        "plan": asdict(plan),
        "method": "faults injected into marked live requests right before a tag check (prefill, decode or "
        "migration); detected = flagged by that check; false positive = a flagged request that carried no "
        "fault; bystander failure = a never-injected request that did not finish by length or whose tokens "
        "differ from a fault-free run; leaked = pages still referenced after every request ended",
        **report,
    }


def plot_soak(path, result: dict) -> None:
    """Bars: faults injected, detected, missed; false positives, bystander failures, leaked pages."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["injected", "detected", "missed", "false\npositives", "bystander\nfailures", "leaked\npages"]
    keys = ["faults_injected", "detected", "missed", "false_positives", "bystander_failures", "leaked_pages"]
    vals = [result[k] for k in keys]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    bars = ax.bar(names, vals, color=["#777", "#2a7", "#c33", "#c33", "#c33", "#c33"])
    ax.bar_label(bars, labels=[str(v) for v in vals])
    ax.set_yscale("symlog")
    ax.set_ylim(0, max(vals + [1]) * 4)
    ax.set_title(
        f"integrity soak: {result['requests']} requests, {result['preemptions']} preemptions,\n"
        f"{result['migrations']} migrations, {result['handoffs']} handoffs",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
