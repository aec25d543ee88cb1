"""The model replica the engine loop drives: one process (LocalReplica) or the ranks of a tensor-parallel
group (TensorParallelReplica), behind one interface the loop calls without asking which.

What differs between them: how the model runs (rank 0 first sends each batch to the other ranks),
how pages move (a handoff payload gathers every rank's heads; arriving pages and migrations are
mirrored on every rank), the integrity check (every rank votes on its own tag table), pool sizing
(as many pages on each rank as the rank with most heads holds) and the life cycle (join, follow,
keepalive, close). Everything else in the engine is the same code for both.
"""

from __future__ import annotations

import atexit
import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist

from pagoda.node_agent.engine import handoff
from pagoda.node_agent.engine.block_tables import block_table_tensor
from pagoda.node_agent.engine.config import EngineConfig
from pagoda.node_agent.engine.integrity import IntegrityError
from pagoda.node_agent.engine.kv_setup import kv_components
from pagoda.node_agent.engine.parallel.group import ParallelGroup
from pagoda.node_agent.engine.parallel.steps import Follower, ParallelDriver
from pagoda.node_agent.engine.sequence import Sequence
from pagoda.node_agent.kv.pool import KVPagePool, PageRef
from pagoda.node_agent.models.batch import StepBatch
from pagoda.node_agent.models.config import ModelConfig
from pagoda.node_agent.models.parallel import head_ranges
from pagoda.node_agent.params import SamplingParams


class LocalReplica:
    """One process holds the whole replica: every method is the plain single-process path."""

    rank = 0
    world = 1
    group: ParallelGroup | None = None  # the process group a model is sharded over (none here)
    is_driver = True  # this process serves requests

    def loaded(self) -> None:
        """Every rank loaded its slice of the model (here: the only one did)."""

    def pool_args(self, model_config: ModelConfig) -> dict:
        """Extra PoolBuilder arguments: none for one process."""
        return {}

    def join(
        self, model_config: ModelConfig, model, prefill_pool: KVPagePool, decode_pool: KVPagePool
    ) -> None:
        """From now on rank 0 drives the others (nothing to join here)."""

    def run_model(self, model, batch: StepBatch, pool: KVPagePool, weights_phase: str | None, logits: bool):
        """Run the model on ``batch``; the logits, or None when ``logits`` is false."""
        if not logits:
            model.forward_no_logits(batch)
            return None
        return model.forward(batch, weights_phase=weights_phase)

    def check_tags(
        self, integrity, seqs: list[Sequence], pool: KVPagePool, tables: tuple | None = None
    ) -> dict[Sequence, IntegrityError]:
        """The integrity check of ``seqs``: the failed sequences and why."""
        return integrity.check(seqs, pool, tables)

    def payload_of(self, seq: Sequence, pool: KVPagePool, meta) -> handoff.KVPayload:
        """The handoff payload of a prefilled sequence (every KV head of its pages)."""
        return handoff.payload_of(seq, pool, meta, self.extract_pages)

    def extract_pages(self, pool: KVPagePool, refs: list[PageRef]):
        """(layers, static scales) of ``refs``, every KV head."""
        return handoff.extract_pages(pool, refs)

    def receive(
        self, payload: handoff.KVPayload, pool: KVPagePool, params: SamplingParams, rid: str, backend
    ) -> Sequence:
        """A prefilled sequence's pages written into fresh tagged pages of ``pool``."""
        return handoff.receive(payload, pool, params, rid, backend, self._page_writer())

    def migrate(self, src: KVPagePool, dst: KVPagePool, refs: list[PageRef], backend) -> list[PageRef]:
        """Copy a sequence's pages from ``src`` into fresh pages of ``dst`` (converting the format)."""
        return handoff.migrate(src, dst, refs, backend, self._page_mirror())

    def _page_writer(self) -> Callable | None:
        return None  # handoff.receive converts into the pool itself

    def _page_mirror(self) -> Callable | None:
        return None

    def drift_tag(self, rank: int, pool: KVPagePool, page: int) -> None:
        """Test only: move a page's tag on one other rank (there is none here)."""
        raise RuntimeError(f"no tensor-parallel rank {rank} other than 0 in this replica")

    def follow(self) -> int:
        """A rank other than 0 carries out rank 0's instructions; this process is rank 0."""
        raise RuntimeError("only a tensor-parallel rank other than 0 follows")

    def tick(self) -> None:
        """An idle serving loop's keepalive (nothing to keep alive here)."""

    def terminate_children(self, grace_s: float = 5.0) -> None:
        """Stop the ranks this process started (none)."""

    def close(self) -> None:
        """Leave the replica (idempotent)."""


class TensorParallelReplica(LocalReplica):
    """This process is one rank of a tensor-parallel replica; rank 0 drives the others."""

    def __init__(self, config: EngineConfig, worker_main: Callable[..., None]) -> None:
        """Join the group (starting this host's other ranks with ``worker_main``)."""
        self.group = ParallelGroup(config, worker_main)
        self.rank, self.world = self.group.rank, self.group.world
        self.backend = config.kernel_backend
        self.driver: ParallelDriver | None = None  # rank 0, once joined
        self.follower: Follower | None = None  # another rank, once joined
        self.closed = False

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def loaded(self) -> None:
        # ranks load at their own pace; the first collective waits for all
        self.group.wait_for_all("the model was loaded on every rank")

    def pool_args(self, model_config: ModelConfig) -> dict:
        """Pool sizing over the ranks: as many pages on each as the rank with most heads holds."""
        mc = model_config
        sizing = None
        if mc.mla is None:
            most = max(kv[1] - kv[0] for _, kv in head_ranges(mc.num_heads, mc.num_kv_heads, self.world))
            sizing = kv_components(dataclasses.replace(mc, num_kv_heads=most, num_heads=most))
        group = self.group

        def reduce_max(t: torch.Tensor) -> torch.Tensor:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group.data)
            return t

        return {"sizing": sizing, "reduce_max": reduce_max}

    def join(
        self, model_config: ModelConfig, model, prefill_pool: KVPagePool, decode_pool: KVPagePool
    ) -> None:
        """Rank 0 drives the others from now on; another rank only follows (``follow``)."""
        mc = model_config
        whole = kv_components(mc)
        for p in {id(p): p for p in (prefill_pool, decode_pool)}.values():
            p.replica_components = dict(whole)
        if mc.mla is not None:
            split = [(0, 1)] * self.world
        else:
            split = [kv for _, kv in head_ranges(mc.num_heads, mc.num_kv_heads, self.world)]
        if self.rank == 0:
            self.driver = ParallelDriver(self.group, model, prefill_pool, decode_pool, split, self.backend)
            atexit.register(self.close)
        else:
            self.follower = Follower(self.group, model, prefill_pool, decode_pool, self.backend)

    def run_model(self, model, batch: StepBatch, pool: KVPagePool, weights_phase: str | None, logits: bool):
        if self.driver is None:  # before joining (calibration): every rank runs the model at once
            return super().run_model(model, batch, pool, weights_phase, logits)
        return self.driver.run_model(batch, pool, weights_phase, logits)

    def check_tags(
        self, integrity, seqs: list[Sequence], pool: KVPagePool, tables: tuple | None = None
    ) -> dict[Sequence, IntegrityError]:
        """This rank's check and every other rank's vote: a mismatch on any rank fails the request
        on all of them."""
        bad = integrity.check(seqs, pool, tables)
        if self.driver is None or integrity.mode == "off":
            return bad
        if tables is None:
            tables = block_table_tensor(seqs, pool.tag_table.device)
        votes = self.driver.check(pool, tables[0], tables[1], [len(s.block_table) for s in seqs])
        for seq, vote in zip(seqs, votes, strict=True):
            if vote and seq not in bad:
                bad[seq] = IntegrityError(
                    f"request {seq.request_id}: a KV page's generation tag differs on tensor-parallel "
                    f"rank {vote - 1}; its pages cannot be trusted (failing closed)"
                )
                integrity.counters.mismatches += 1
        return bad

    def extract_pages(self, pool: KVPagePool, refs: list[PageRef]):
        if self.driver is None:
            return super().extract_pages(pool, refs)
        return self.driver.gather_pages(pool, refs)  # every rank's heads, joined on rank 0

    def _page_writer(self) -> Callable | None:
        return self.driver.scatter_pages if self.driver is not None else None

    def _page_mirror(self) -> Callable | None:
        return self.driver.migrate if self.driver is not None else None

    def drift_tag(self, rank: int, pool: KVPagePool, page: int) -> None:
        if self.driver is None or not 0 < rank < self.world:
            super().drift_tag(rank, pool, page)
        self.driver.drift_tag(rank, pool, page)

    def follow(self) -> int:
        """A rank other than 0: carry out rank 0's instructions until it stops (0) or is lost (3)."""
        if self.follower is None:
            super().follow()
        code = self.follower.run()
        self.group.close()
        self.closed = True
        return code

    def tick(self) -> None:
        """A keepalive vote when nothing was sent for a while, so a dead rank fails the replica even
        without traffic (raises ReplicaFailure)."""
        if self.driver is not None:
            self.driver.keepalive_if_due()

    def terminate_children(self, grace_s: float = 5.0) -> None:
        self.group.terminate_children(grace_s=grace_s)

    def close(self) -> None:
        """Tell the other ranks to stop and leave the group (idempotent)."""
        if self.closed:
            return
        if self.driver is not None:
            self.driver.stop()
        self.group.close()
        self.closed = True


def make_replica(config: EngineConfig, worker_main: Callable[..., None]) -> LocalReplica:
    """The replica this process belongs to: tensor-parallel when ``--tensor-parallel`` > 1."""
    if config.parallel.tensor_parallel > 1:
        return TensorParallelReplica(config, worker_main)
    return LocalReplica()
