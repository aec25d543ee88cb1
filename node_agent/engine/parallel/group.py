"""The process group of one model replica: joining it (one host or several), starting a host's other
ranks, and naming the rank that failed.

Where the ranks meet (first match wins):
- ``RANK`` and ``WORLD_SIZE`` in the environment (an external launcher started every rank): join as
  that rank at ``MASTER_ADDR:MASTER_PORT``; start nothing;
- otherwise this process is the first rank of its host: host index from ``PAGODA_NODE_RANK``,
  ``NODE_RANK`` or ``LWS_WORKER_INDEX`` (LeaderWorkerSet), rank 0's address from ``--dist-addr``,
  ``MASTER_ADDR`` or ``LWS_LEADER_ADDRESS``, its port from ``--dist-port`` or ``MASTER_PORT`` (on a
  single host, else a free port rank 0's store binds before the other ranks are started); it starts the host's other ``tensor_parallel / nodes`` - 1 ranks as
  child processes and joins as ``host index * ranks per host``.

Groups: a gloo "control" group that carries each step's instructions (a worker waits on it between
steps, so its timeout is long), a "data" group (NCCL on CUDA, gloo on the CPU) for the model's
collectives, and a gloo "cpu" group (the data group itself on the CPU) for the integrity votes,
keepalives and KV page transfers; those two time out after ``--dist-timeout``: a rank that dies or
hangs fails the replica within that time. Every worker records the number of
the last instruction it finished in the rendezvous store, so rank 0 can say which rank did not
answer.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from pagoda.node_agent.engine.config import EngineConfig, ParallelConfig

log = logging.getLogger("pagoda.parallel")

CONTROL_TIMEOUT_S = 7 * 24 * 3600  # a worker idles on the control group between steps
ACK_KEY = "pagoda/ack/{rank}"


class ReplicaFailure(RuntimeError):
    """A rank of this replica died, hung or lost the group: the replica cannot serve any more."""


@dataclass
class Rendezvous:
    """Where and as which rank this process joins."""

    rank: int
    world: int
    addr: str
    port: int
    local_ranks: list[int] = field(default_factory=list)  # ranks this process starts on its host


def _env_int(*names: str) -> int | None:
    for n in names:
        v = os.environ.get(n)
        if v not in (None, ""):
            try:
                return int(v)
            except ValueError as exc:
                raise ValueError(f"${n} must be an integer, got {v!r}") from exc
    return None


def rendezvous(pc: ParallelConfig) -> Rendezvous:
    """This process's rank and the ranks it must start, from the config and the environment."""
    world = pc.tensor_parallel
    rank = _env_int("RANK")
    if rank is not None:
        size = _env_int("WORLD_SIZE")
        if size != world:
            raise ValueError(f"$WORLD_SIZE is {size}, but --tensor-parallel is {world}")
        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = _env_int("MASTER_PORT") or pc.dist_port or 29500
        return Rendezvous(rank, world, addr, port)
    per_host = world // pc.nodes
    node = _env_int("PAGODA_NODE_RANK", "NODE_RANK", "LWS_WORKER_INDEX") or 0
    if not 0 <= node < pc.nodes:
        raise ValueError(f"host index {node} is outside a replica of {pc.nodes} hosts")
    if pc.nodes == 1:
        addr = pc.dist_addr or "127.0.0.1"
        port = pc.dist_port or _env_int("MASTER_PORT") or 0  # 0: the store binds a free port
    else:
        addr = pc.dist_addr or os.environ.get("MASTER_ADDR") or os.environ.get("LWS_LEADER_ADDRESS") or ""
        if not addr:
            raise ValueError(
                "a replica over several hosts needs rank 0's address: --dist-addr, $MASTER_ADDR or "
                "$LWS_LEADER_ADDRESS"
            )
        port = pc.dist_port or _env_int("MASTER_PORT") or 29500
    first = node * per_host
    return Rendezvous(first, world, addr, port, list(range(first + 1, first + per_host)))


class ParallelGroup:
    """This process's membership of the replica's group (and the local ranks it started)."""

    def __init__(self, config: EngineConfig, worker_main: Callable[..., None]) -> None:
        """Join the replica; ``worker_main(config, rank, world, addr, port)`` runs each rank this
        process starts (in a child process)."""
        pc = config.parallel
        if dist.is_initialized():
            raise RuntimeError(
                "this process already belongs to a tensor-parallel replica; close that engine first "
                "(one replica per process)"
            )
        self.timeout_s = pc.dist_timeout
        rv = rendezvous(pc)
        self.rank, self.world = rv.rank, rv.world
        self.children: dict[int, mp.process.BaseProcess] = {}
        store_timeout = datetime.timedelta(seconds=max(self.timeout_s, 300))
        if rv.rank == 0:  # the rendezvous store first: its port is bound before any rank is told it
            self.store = dist.TCPStore(
                rv.addr, rv.port, rv.world, is_master=True, timeout=store_timeout, wait_for_workers=False
            )
            rv.port = self.store.port
        else:
            self.store = None
        if rv.local_ranks:
            ctx = mp.get_context("spawn")
            for r in rv.local_ranks:
                p = ctx.Process(
                    target=worker_main,
                    args=(config, r, rv.world, rv.addr, rv.port),
                    name=f"pagoda-rank-{r}",
                    daemon=False,
                )
                p.start()
                self.children[r] = p
        _limit_threads(config, rv.world // pc.nodes)
        log.info("rank %d of %d: joining the group at %s:%d", self.rank, self.world, rv.addr, rv.port)
        try:
            self._init(config, rv)
        except BaseException:
            self.terminate_children()
            raise

    def _init(self, config: EngineConfig, rv: Rendezvous) -> None:
        if self.store is None:
            timeout = datetime.timedelta(seconds=max(self.timeout_s, 300))
            self.store = dist.TCPStore(rv.addr, rv.port, rv.world, is_master=False, timeout=timeout)
        dist.init_process_group(
            "gloo",
            store=self.store,
            rank=rv.rank,
            world_size=rv.world,
            timeout=datetime.timedelta(seconds=CONTROL_TIMEOUT_S),
        )
        backend = "nccl" if config.torch_device().type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=self.timeout_s)
        self.data = dist.new_group(backend=backend, timeout=timeout)  # the model's collectives
        # votes, keepalives and KV page transfers: CPU tensors, the same timeout
        self.cpu = self.data if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
        self.control = None  # the default group
        if backend == "nccl":
            torch.cuda.set_device(rv.rank % max(1, torch.cuda.device_count()))

    def wait_for_all(self, what: str) -> None:
        """Every rank reached this point (e.g. loaded its slice, however long that took); raises
        ReplicaFailure when a rank this process started exits first."""
        work = dist.barrier(async_op=True)  # the control group: no collective timeout while loading
        while not work.is_completed():
            dead = {r: p for r, p in self.children.items() if p.exitcode is not None}
            if dead:
                text = "; ".join(_exit_text(r, p) for r, p in sorted(dead.items()))
                raise ReplicaFailure(f"{text} before {what}")
            time.sleep(0.05)
        work.wait()

    # ------------------------------------------------------------------ acknowledgements

    def ack(self, seq: int) -> None:
        """A worker finished instruction ``seq``."""
        self.store.set(ACK_KEY.format(rank=self.rank), str(seq))

    def acked(self, rank: int) -> int | None:
        key = ACK_KEY.format(rank=rank)
        try:
            if not self.store.check([key]):
                return None
            return int(self.store.get(key))
        except Exception:
            return None

    def describe_failure(self, exc: BaseException, seq: int) -> str:
        """Which rank failed instruction ``seq`` and how, as far as this rank can tell."""
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:  # a rank that died is reaped within moments
            dead = {r: p for r, p in self.children.items() if p.exitcode is not None}
            if dead:
                return "; ".join(_exit_text(r, p) for r, p in sorted(dead.items()))
            time.sleep(0.05)
        behind = []
        for r in range(1, self.world):
            got = self.acked(r)
            if got is None or got < seq:
                last = "none" if got is None else f"#{got}"
                behind.append(
                    f"tensor-parallel rank {r} did not finish instruction #{seq} (last finished: {last})"
                )
        if behind:
            return "; ".join(behind) + f" within the {self.timeout_s:g}s collective timeout ({exc})"
        return f"a collective of the replica failed: {type(exc).__name__}: {exc}"

    # ------------------------------------------------------------------ shutdown

    def terminate_children(self, grace_s: float = 5.0) -> None:
        """Give every rank this process started ``grace_s`` to exit, then SIGTERM, then SIGKILL (a
        stopped or hung rank does not act on SIGTERM); each child is reaped."""
        for p in self.children.values():
            p.join(timeout=grace_s)
        for p in self.children.values():
            if p.exitcode is None:
                p.terminate()
                p.join(timeout=grace_s)
            if p.exitcode is None:
                p.kill()
                p.join(timeout=grace_s)

    def close(self) -> None:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        finally:
            self.terminate_children()


def _exit_text(rank: int, p: mp.process.BaseProcess) -> str:
    code = p.exitcode
    how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
    return f"tensor-parallel rank {rank} (pid {p.pid}) {how}"


def _limit_threads(config: EngineConfig, local_ranks: int) -> None:
    """CPU ranks on one host share its cores."""
    if config.torch_device().type == "cpu" and local_ranks > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_ranks))
