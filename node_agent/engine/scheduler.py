"""Continuous batching: which sequences run in the next step, and with how many tokens.

A step is either a *prefill* step (chunks of prompts, up to a token budget) or a *decode* step (one
token for every running sequence). The two alternate while both have work, so new prompts join
between decode steps. With a time budget (step_budget.py) the prefill chunks are also sized so that
the decode step and the prefill step between two tokens of a running stream fit an inter-token
target (a floor of tokens always goes through). Admission needs free pages above a
watermark; when decode runs out of pages the newest running sequence is preempted (its pages are
freed and it is recomputed later from its tokens, so its output is unchanged). FCFS throughout.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from pagoda.node_agent.engine.integrity import release_owned
from pagoda.node_agent.engine.scheduled_step import ScheduledStep
from pagoda.node_agent.engine.sequence import SeqStatus, Sequence
from pagoda.node_agent.engine.step_budget import PrefillPlan, StepBudget
from pagoda.node_agent.kv.pool import KVPagePool, OutOfPages, PageRef
from pagoda.node_agent.kv.prefix_index import page_hashes

log = logging.getLogger("pagoda.scheduler")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512  # prefill tokens per step (chunk budget)
    max_model_len: int = 2048
    watermark: float = 0.01  # fraction of pages kept free when admitting new sequences
    enable_prefix_caching: bool = True


def _scores_prompt(seq: Sequence) -> bool:
    """Prompt logprobs still to compute: the prompt runs whole, past any prefix-cache hit."""
    p = seq.params.prompt_logprobs
    return p is not None and len(seq.prompt_logprobs) < len(seq.prompt_token_ids) - 1


class Scheduler:
    """Owns the waiting queue and running set and maps sequences' tokens onto KV pages."""

    def __init__(
        self,
        config: SchedulerConfig,
        prefill_pool: KVPagePool,
        decode_pool: KVPagePool | None = None,
        budget: StepBudget | None = None,
    ) -> None:
        self.config, self.budget = config, budget  # budget: None schedules by the token budget alone
        self.prefill_pool = prefill_pool  # prompt chunks and the prefix cache live here
        # decode reads/writes here (the same pool when formats match)
        self.decode_pool = decode_pool or prefill_pool
        self.pools = {prefill_pool.name: prefill_pool, self.decode_pool.name: self.decode_pool}
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._last_phase = "decode"
        self.num_preemptions = 0
        self.preemptions_by_pool = dict.fromkeys(self.pools, 0)  # the pool the victim's pages were in
        self.prefix_hit_tokens = 0

    # ------------------------------------------------------------------ queue

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Take a sequence whose KV already sits in the decode pool (a handoff): it decodes next."""
        if seq.pool_name != self.decode_pool.name:
            raise ValueError(f"{seq.request_id}: pages are not in the decode pool {self.decode_pool.name}")
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, seq: Sequence) -> None:
        """Drop a sequence wherever it is and release its pages."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.free_pages(seq)

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        self.free_pages(seq)

    def pool_of(self, seq: Sequence) -> KVPagePool:
        return self.pools.get(seq.pool_name, self.prefill_pool)

    def in_decode_pool(self, seq: Sequence) -> bool:
        return self.pool_of(seq) is self.decode_pool

    def free_pages(self, seq: Sequence) -> None:
        pool = self.pool_of(seq)
        if any(pool.allocator.is_stale(r) for r in seq.block_table):  # a corrupted expected tag
            release_owned(seq, pool, self.running + list(self.waiting))
        else:
            pool.release_all(seq.block_table)
        seq.pool_name = self.prefill_pool.name
        seq.block_table = []
        seq.page_hashes = []
        seq.num_computed_tokens = 0

    # ------------------------------------------------------------------ scheduling

    def schedule(self) -> ScheduledStep | None:
        """Pick the next step (timed by the budget until ``step_done``); None when there is nothing to do."""
        step = self._pick()
        if step is not None and self.budget is not None:
            self.budget.started(step.phase, step.seqs, step.num_new_tokens)
        return step

    def step_done(self) -> None:
        """The engine ran the step ``schedule`` returned last: its time refines the cost model."""
        if self.budget is not None:
            self.budget.finished()

    def _pick(self) -> ScheduledStep | None:
        decode_ready = [s for s in self.running if not s.needs_prefill and self.in_decode_pool(s)]
        want_prefill = bool(self.waiting) or any(s.needs_prefill for s in self.running)
        if want_prefill and (not decode_ready or self._last_phase == "decode"):
            plan = self.budget.plan(decode_ready) if self.budget is not None else None
            step = self._schedule_prefill(plan)
            if step is not None:
                self._last_phase = "prefill"
                return step
        if decode_ready:
            step = self._schedule_decode()
            if step is not None:
                self._last_phase = "decode"
                return step
        holders = [
            s
            for s in self.running
            if s.block_table and self.pool_of(s) is self.prefill_pool and s.needs_prefill
        ]
        if len(holders) > 1 and self.prefill_pool.num_free == 0:
            # prefills hold pages but none can grow: free the newest and retry (it is recomputed later)
            self._preempt(max(holders, key=lambda s: s.arrival))
            return self._pick()
        return None

    def _schedule_prefill(self, plan: PrefillPlan | None) -> ScheduledStep | None:
        """Chunks of prompts within the token budget (and, with a ``plan``, its time budget)."""
        budget = self.config.max_num_batched_tokens
        seqs: list[Sequence] = []
        counts: list[int] = []
        # 1) continue chunked prefills already running (FCFS by arrival)
        for seq in sorted((s for s in self.running if s.needs_prefill), key=lambda s: s.arrival):
            if budget <= 0:
                break
            n = min(budget, seq.num_tokens - seq.num_computed_tokens)
            n = self._reserve(seq, plan.fit(seq, n) if plan else n, self.prefill_pool)
            if n > 0 and plan:
                plan.take(seq, n)
            if n > 0:
                seqs.append(seq)
                counts.append(n)
                budget -= n
        # 2) admit waiting sequences while budget, seats and pages (above the watermark) allow
        watermark = int(self.config.watermark * self.prefill_pool.num_pages)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not seq.block_table:
                self._match_prefix(seq)
            remaining = seq.num_tokens - seq.num_computed_tokens
            n = plan.fit(seq, min(budget, remaining)) if plan else min(budget, remaining)
            need = self._pages_needed(seq, n)
            if self.prefill_pool.num_free - need < watermark and self.running:
                break
            if self.decode_pool is not self.prefill_pool and self.running:
                # the prompt moves to the decode pool when its prefill ends: it must fit there too
                dmark = int(self.config.watermark * self.decode_pool.num_pages)
                if self.decode_pool.num_free - self._pages_for(seq.num_tokens + 1) < dmark:
                    break
            n = self._reserve(seq, n, self.prefill_pool)
            if n <= 0:
                break
            if plan:
                plan.take(seq, n)
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            seqs.append(seq)
            counts.append(n)
            budget -= n
        if not seqs:
            return None
        return ScheduledStep("prefill", seqs, counts)

    def _schedule_decode(self) -> ScheduledStep | None:
        preempted: list[Sequence] = []
        ready = sorted(
            (s for s in self.running if not s.needs_prefill and self.in_decode_pool(s)),
            key=lambda s: s.arrival,
        )
        scheduled: list[Sequence] = []
        for seq in ready:
            if seq.status != SeqStatus.RUNNING:
                continue  # preempted below while making room for an older one
            while self._reserve(seq, 1, self.decode_pool) < 1:
                victim = self._newest_in_decode_pool()
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status == SeqStatus.RUNNING:
                scheduled.append(seq)
        if not scheduled:
            return None
        return ScheduledStep("decode", scheduled, [1] * len(scheduled), preempted)

    # ------------------------------------------------------------------ pages

    def _pages_for(self, tokens: int) -> int:
        return -(-tokens // self.prefill_pool.page_size)

    def _pages_needed(self, seq: Sequence, n: int) -> int:
        return max(0, self._pages_for(seq.num_computed_tokens + n) - len(seq.block_table))

    def _reserve(self, seq: Sequence, n: int, pool: KVPagePool) -> int:
        """Map pages of ``pool`` for ``n`` more tokens; returns how many tokens fit (may be fewer)."""
        ps = pool.page_size
        seq.pool_name = pool.name
        while n > 0 and self._pages_needed(seq, n) > 0:
            try:
                seq.block_table.append(pool.allocate())
            except OutOfPages:
                n = len(seq.block_table) * ps - seq.num_computed_tokens
                break
        return max(0, n)

    def _match_prefix(self, seq: Sequence) -> None:
        """Map cached full pages of the prompt (never the page holding the last token)."""
        seq.pool_name = self.prefill_pool.name
        if not self.config.enable_prefix_caching or _scores_prompt(seq):
            return
        ps = self.prefill_pool.page_size
        usable = (seq.num_tokens - 1) // ps
        hits: list[PageRef] = []
        for h in page_hashes(seq.all_token_ids[: usable * ps], ps, seq.cache_salt):
            ref = self.prefill_pool.lookup(h)
            if ref is None:
                break
            hits.append(ref)
            seq.page_hashes.append(h)
        if hits:
            seq.block_table = hits
            seq.num_computed_tokens = len(hits) * ps
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = seq.num_computed_tokens
            self.prefix_hit_tokens += seq.num_computed_tokens

    def seal_full_pages(self, seq: Sequence) -> None:
        """Index the sequence's full pages in the prefix cache (which lives in the prefill pool)."""
        if not self.config.enable_prefix_caching or self.pool_of(seq) is not self.prefill_pool:
            return
        ps = self.prefill_pool.page_size
        done = len(seq.page_hashes)
        full = seq.num_computed_tokens // ps
        if full <= done:
            return
        parent = seq.page_hashes[-1] if done else None
        tokens = seq.all_token_ids[done * ps : full * ps]
        for i, h in enumerate(page_hashes(tokens, ps, seq.cache_salt, parent), start=done):
            seq.page_hashes.append(h)
            self.prefill_pool.seal(seq.block_table[i].page, h)

    def _newest_in_decode_pool(self) -> Sequence:
        return max(
            (s for s in self.running if self.in_decode_pool(s) and s.block_table), key=lambda s: s.arrival
        )

    def awaiting_migration(self) -> list[Sequence]:
        """Prefilled sequences whose pages still sit in the prefill pool (oldest first)."""
        if self.decode_pool is self.prefill_pool:
            return []
        return sorted(
            (s for s in self.running if not s.needs_prefill and not self.in_decode_pool(s)),
            key=lambda s: s.arrival,
        )

    def _preempt(self, seq: Sequence) -> None:
        """Free a running sequence's pages and requeue it first; it will be recomputed."""
        log.info("preempting %s (%d tokens) to free KV pages", seq.request_id, seq.num_tokens)
        self.running.remove(seq)
        self.preemptions_by_pool[self.pool_of(seq).name] += 1
        self.free_pages(seq)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
