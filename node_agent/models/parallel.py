"""Tensor and expert parallelism of one model replica: which slice of every weight a rank holds
(the shard plan), the sliced weights themselves, and the collectives the layers call.

Every rank reads only its slice of the checkpoint (the loader's deferred tensors, narrowed here and
read by lazy_tensor.materialize; other ranks' routed experts are never listed), before any weight is
converted or packed for a phase (PhaseLinear does that per rank):

- attention: contiguous KV-head groups per rank with their query heads (q/k/v rows, o_proj
  columns); with fewer KV heads than ranks a KV head is replicated and its query heads split. The
  KV pool of a rank holds its KV heads only. MLA (DeepSeek-V3) cannot split its latent by head: every
  rank keeps the whole latent cache (replicated, the same memory as one rank alone) and a share of
  the query heads (q/q_b and kv_b rows, o_proj columns);
- dense MLPs and shared experts: gate/up rows and down_proj columns of the intermediate dimension;
- routed experts: expert parallelism, a contiguous range of whole experts per rank; every rank routes
  all tokens (the router is replicated) and computes its experts' share, which the all-reduce after
  the MLP combines;
- embeddings and the LM head: vocab-parallel row ranges (the last one padded), the lookup summed and
  the logits gathered on rank 0.

A column split (o_proj, down_proj) keeps INT4 group boundaries: a boundary inside a group is refused
at load with the reason. Quantization of a column shard uses the whole row's group size and FP8
scale (ColumnShard), so each rank's slice is exactly the slice of what one rank would hold.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pagoda.kernels.fp8 import Fp8Weight
from pagoda.kernels.fp8_block import Fp8BlockWeight
from pagoda.kernels.int4 import Int4Weight, pick_group_size
from pagoda.node_agent.models.config import ModelConfig, ModelLoadError
from pagoda.node_agent.models.lazy_tensor import LazyTensor, materialize, read_now

Range = tuple[int, int]


def split_range(n: int, parts: int, unit: int = 1) -> list[Range]:
    """``[0, n)`` cut into ``parts`` contiguous ranges of whole ``unit``s, the first ones larger."""
    if n % unit:
        raise ModelLoadError(f"cannot split {n} into units of {unit}")
    units = n // unit
    if units < parts:
        raise ModelLoadError(f"cannot split {n} ({units} units of {unit}) over {parts} ranks")
    base, extra = divmod(units, parts)
    out, start = [], 0
    for r in range(parts):
        size = (base + (1 if r < extra else 0)) * unit
        out.append((start, start + size))
        start += size
    return out


@dataclass(frozen=True)
class ShardPlan:
    """The slices rank ``rank`` of ``world`` holds (ranges are [start, end))."""

    rank: int
    world: int
    q_heads: Range
    kv_heads: Range
    vocab: Range
    vocab_shard: int  # rows per rank's padded vocab shard (the gather width)
    intermediate: Range  # dense MLP
    experts: Range | None = None  # routed experts (expert parallelism)
    shared_intermediate: Range | None = None  # MoE shared experts

    @property
    def num_q_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]


def head_ranges(num_heads: int, num_kv_heads: int, world: int) -> list[tuple[Range, Range]]:
    """(query heads, KV heads) per rank: KV-head groups split over the ranks, or, with fewer KV heads
    than ranks, each KV head replicated on ``world / num_kv_heads`` ranks that split its queries."""
    group = num_heads // num_kv_heads
    if num_kv_heads >= world:
        return [((a * group, b * group), (a, b)) for a, b in split_range(num_kv_heads, world)]
    per = world // num_kv_heads
    if world % num_kv_heads or group % per:
        raise ModelLoadError(
            f"tensor-parallel {world} cannot split {num_heads} query heads over {num_kv_heads} KV "
            f"heads: use a degree that divides the KV heads ({num_kv_heads}) or a multiple of them "
            f"that divides the query heads of each"
        )
    out = []
    for r in range(world):
        kv, part = divmod(r, per)
        q0 = kv * group + part * (group // per)
        out.append(((q0, q0 + group // per), (kv, kv + 1)))
    return out


def make_plan(cfg: ModelConfig, rank: int, world: int, mlp_unit: int = 1, shared_unit: int = 1) -> ShardPlan:
    """The shard plan of ``rank``; ``*_unit``: the INT4 group the MLP's down_proj columns keep."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a group of {world}")
    if cfg.mla is not None:  # every rank holds the latent; the query heads are split
        q = split_range(cfg.num_heads, world)[rank]
        kv = (0, 1)
    else:
        q, kv = head_ranges(cfg.num_heads, cfg.num_kv_heads, world)[rank]
    shard = -(-cfg.vocab_size // world)
    v0 = min(rank * shard, cfg.vocab_size)
    experts = shared = None
    if cfg.moe is not None:
        experts = split_range(cfg.moe.num_experts, world)[rank]
        if cfg.moe.n_shared_experts:
            width = cfg.moe.expert_intermediate_size * cfg.moe.n_shared_experts
            shared = split_range(width, world, _unit(width, world, shared_unit))[rank]
    dense_i = cfg.intermediate_size
    inter = split_range(dense_i, world, _unit(dense_i, world, mlp_unit))[rank] if dense_i else (0, 0)
    return ShardPlan(
        rank=rank,
        world=world,
        q_heads=q,
        kv_heads=kv,
        vocab=(v0, min(v0 + shard, cfg.vocab_size)),
        vocab_shard=shard,
        intermediate=inter,
        experts=experts,
        shared_intermediate=shared,
    )


def _unit(n: int, world: int, unit: int) -> int:
    """The split unit: ``unit`` (an INT4 group) when ``n`` divides into enough of them, else refused."""
    if n % unit or n // unit < world:
        raise ModelLoadError(
            f"an MLP width of {n} cannot be split over {world} ranks at INT4 group boundaries of {unit}"
        )
    return unit


def local_config(cfg: ModelConfig, plan: ShardPlan) -> ModelConfig:
    """The model config of one rank's slice (its heads and MLP width; the vocab stays whole)."""
    if plan.world == 1:
        return cfg
    heads = plan.num_q_heads
    kv = 1 if cfg.mla is not None else plan.num_kv_heads
    inter = plan.intermediate[1] - plan.intermediate[0]
    return dataclasses.replace(cfg, num_heads=heads, num_kv_heads=kv, intermediate_size=inter)


# ---------------------------------------------------------------------------------- weight slices


@dataclass
class ColumnShard:
    """Columns of a weight whose whole input width is ``full_in``: a phase format that quantizes uses
    the whole row's INT4 group size and FP8 scale (``row_amax``), so the slice equals the slice of
    the whole weight's quantization."""

    weight: torch.Tensor | Int4Weight | Fp8Weight
    full_in: int
    row_amax: torch.Tensor | None = None  # float32 [N]: amax of each dense row (for FP8 from dense)
    name: str = ""  # the checkpoint's weight name (for errors)

    def int4_group(self, preferred: int | None) -> int:
        """The INT4 group the whole row would get, which must divide this slice's width."""
        g = pick_group_size(self.full_in, preferred or 128)
        k = _cols(self.weight)
        if k % g:
            where = f"{self.name}: " if self.name else ""
            raise ModelLoadError(
                f"{where}a tensor-parallel column slice of width {k} splits an INT4 group of {g} "
                f"(input width {self.full_in}): choose an --int4-group-size that divides {k}"
            )
        return g


def _rows(w) -> int:
    return w.shape[0] if isinstance(w, torch.Tensor | LazyTensor) else w.out_features


def _cols(w) -> int:
    return w.shape[1] if isinstance(w, torch.Tensor | LazyTensor) else w.in_features


def take_rows(w, start: int, end: int):
    """Rows [start, end) of a dense (or deferred), INT4 or FP8 weight (or a bias)."""
    if isinstance(w, torch.Tensor | LazyTensor):
        return w[start:end].contiguous()
    if isinstance(w, Fp8Weight):
        return Fp8Weight(w.weight[start:end].contiguous(), w.scale[start:end].contiguous())
    if isinstance(w, Fp8BlockWeight):
        return w.take_rows(start, end)
    if isinstance(w, Int4Weight):
        st = w.state()
        part = {k: t[start:end].contiguous() for k, t in st.items()}
        return Int4Weight(
            end - start,
            w.in_features,
            w.group_size,
            w.symmetric,
            part["packed"],
            part["scales"],
            part.get("zeros"),
            part.get("mins"),
        )
    raise TypeError(f"cannot slice a {type(w).__name__} weight")


def take_cols(w, start: int, end: int):
    """Columns [start, end) of a dense (or deferred), INT4 (whole groups only) or FP8 weight."""
    if isinstance(w, torch.Tensor | LazyTensor):
        return w[:, start:end].contiguous()
    if isinstance(w, Fp8Weight):
        return Fp8Weight(w.weight[:, start:end].contiguous(), w.scale)
    if isinstance(w, Fp8BlockWeight):
        try:
            return w.take_cols(start, end)
        except ValueError as exc:
            raise ModelLoadError(str(exc)) from exc
    if isinstance(w, Int4Weight):
        g = w.group_size
        if start % g or end % g:
            raise ModelLoadError(
                f"a tensor-parallel column slice [{start}, {end}) splits the stored INT4 groups of {g}: "
                f"use a tensor-parallel degree that cuts at multiples of {g}, or a checkpoint quantized "
                f"with smaller groups"
            )
        st = w.state()
        packed = st["packed"][:, start // 2 : end // 2].contiguous()
        grp = {
            k: st[k][:, start // g : end // g].contiguous() for k in ("scales", "zeros", "mins") if k in st
        }
        return Int4Weight(
            w.out_features,
            end - start,
            g,
            w.symmetric,
            packed,
            grp["scales"],
            grp.get("zeros"),
            grp.get("mins"),
        )
    raise TypeError(f"cannot slice a {type(w).__name__} weight")


def column_shard(w, start: int, end: int, need_amax: bool, name: str = "") -> ColumnShard:
    """Columns [start, end) of ``w`` that remember the whole row (``name``: the weight's, for errors)."""
    amax = None
    fp8 = isinstance(w, Fp8Weight | Fp8BlockWeight) or (isinstance(w, LazyTensor) and w.fp8_block)
    if need_amax and not fp8:
        if isinstance(w, LazyTensor):  # the whole row's amax: one tensor read and dropped
            w_read = read_now(w)
            dense = w_read if isinstance(w_read, torch.Tensor) else w_read.dequantize()
        else:
            dense = w if isinstance(w, torch.Tensor) else w.dequantize()
        amax = dense.detach().float().abs().amax(dim=1)
    try:
        part = take_cols(w, start, end)
    except ModelLoadError as exc:
        raise ModelLoadError(f"{name}: {exc}" if name else str(exc)) from exc
    return ColumnShard(part, _cols(w), amax, name)


def int4_unit(w, formats: set[str], preferred: int | None) -> int:
    """The group a down_proj's input columns must keep: its stored INT4 group or FP8 column block,
    and the group an INT4 phase format would choose for the whole width (1 when nothing is
    grouped)."""
    if isinstance(w, Int4Weight):
        return w.group_size
    if isinstance(w, LazyTensor) and w.int4_group:  # read as an Int4Weight (GGUF Q4_0 / Q4_1)
        return w.int4_group
    if isinstance(w, Fp8BlockWeight):
        unit = w.block[1]
    else:
        unit = w.fp8_block[1] if isinstance(w, LazyTensor) and w.fp8_block else 1
    if "int4" in formats:
        return math.lcm(unit, pick_group_size(_cols(w), preferred or 128))
    return unit


def shard_weights(
    weights: dict[str, object],
    cfg: ModelConfig,
    plan: ShardPlan,
    formats: set[str],
) -> dict[str, object]:
    """This rank's slice of every weight (names kept; experts renumbered from 0; column-split weights
    wrapped in ColumnShard)."""
    if plan.world == 1:
        return weights
    need_amax = "fp8" in formats
    d = cfg.head_dim
    q0, q1 = plan.q_heads
    kv0, kv1 = plan.kv_heads
    i0, i1 = plan.intermediate
    out: dict[str, object] = {}
    for name, w in weights.items():
        out_name, part = name, w
        key = name.rsplit(".", 1)[0]  # without .weight / .bias
        last = name.rsplit(".", 1)[-1]
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            part = take_rows(w, *plan.vocab)
        elif cfg.mla is None and key.endswith(("self_attn.q_proj",)):
            part = take_rows(w, q0 * d, q1 * d)
        elif cfg.mla is None and key.endswith(("self_attn.k_proj", "self_attn.v_proj")):
            part = take_rows(w, kv0 * d, kv1 * d)
        elif key.endswith("self_attn.o_proj"):
            width = cfg.mla.v_head_dim if cfg.mla is not None else d
            part = column_shard(w, q0 * width, q1 * width, need_amax, name) if last == "weight" else None
            part = _row_bias(w, plan) if part is None else part
        elif cfg.mla is not None and key.endswith(("self_attn.q_proj", "self_attn.q_b_proj")):
            per = cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim
            part = take_rows(w, q0 * per, q1 * per)
        elif cfg.mla is not None and key.endswith("self_attn.kv_b_proj"):
            per = cfg.mla.qk_nope_head_dim + cfg.mla.v_head_dim
            part = take_rows(w, q0 * per, q1 * per)
        elif ".mlp.experts." in name:
            part, out_name = _expert_slice(name, w, plan.experts)
            if part is None:
                continue
        elif ".mlp.shared_experts." in name:
            s0, s1 = plan.shared_intermediate
            part = _mlp_slice(name, last, w, s0, s1, need_amax, plan)
        elif key.endswith(("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")):
            part = _mlp_slice(name, last, w, i0, i1, need_amax, plan)
        out[out_name] = part
    return out


def _mlp_slice(name: str, last: str, w, start: int, end: int, need_amax: bool, plan: ShardPlan):
    if name.rsplit(".", 1)[0].endswith("down_proj"):
        return column_shard(w, start, end, need_amax, name) if last == "weight" else _row_bias(w, plan)
    return take_rows(w, start, end)


def _row_bias(bias: torch.Tensor, plan: ShardPlan) -> torch.Tensor:
    """The bias of a layer whose outputs the ranks sum: added once, by rank 0."""
    if plan.rank == 0:
        return bias
    return torch.zeros(tuple(bias.shape), dtype=bias.dtype)


def _expert_slice(name: str, w, experts: Range) -> tuple[object | None, str]:
    """An expert weight of this rank renumbered from 0, or (None, name) for another rank's expert."""
    e0, e1 = experts
    head, _, tail = name.partition(".mlp.experts.")
    first, _, rest = tail.partition(".")
    if first.isdigit():
        e = int(first)
        if not e0 <= e < e1:
            return None, name
        return w, f"{head}.mlp.experts.{e - e0}.{rest}"
    if isinstance(w, torch.Tensor | LazyTensor) and w.dim() == 3:  # fused [E, ...] stacks
        return w[e0:e1].contiguous(), name
    return w, name


def rank_weights(
    weights: dict[str, object],
    cfg: ModelConfig,
    rank: int,
    world: int,
    formats: set[str],
    preferred: int | None,
) -> tuple[ShardPlan, dict[str, object]]:
    """The shard plan of ``rank`` and its weights, read: deferred tensors (the loader's lazy ones)
    narrowed to this rank's slices, then read one shard file at a time. The same path at one rank
    (the plan keeps everything) and at many."""
    units = mlp_units(weights, cfg, formats, preferred) if world > 1 else (1, 1)  # one rank cuts nothing
    plan = make_plan(cfg, rank, world, *units)
    return plan, materialize(shard_weights(weights, cfg, plan, formats))


def mlp_units(weights: dict[str, object], cfg: ModelConfig, formats: set[str], preferred: int | None):
    """(dense MLP unit, shared-experts unit): the INT4 group each down_proj's columns must keep."""
    dense = shared = 1
    for name, w in weights.items():
        if name.endswith("mlp.down_proj.weight"):
            dense = math.lcm(dense, int4_unit(w, formats, preferred))
        elif name.endswith("mlp.shared_experts.down_proj.weight"):
            shared = math.lcm(shared, int4_unit(w, formats, preferred))
    return dense, shared


# ---------------------------------------------------------------------------------- collectives


class TensorParallel:
    """The collectives a sharded model calls, over a torch.distributed process group."""

    def __init__(self, plan: ShardPlan, vocab_size: int, group=None) -> None:
        self.plan = plan
        self.vocab_size = vocab_size
        self.group = group

    @property
    def rank(self) -> int:
        return self.plan.rank

    @property
    def world(self) -> int:
        return self.plan.world

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's partial ``x`` (in place)."""
        if x.is_cuda:
            dist.all_reduce(x, group=self.group)
            return x
        return reduce_cpu(x, self.rank, self.world, self.group, torch.add)

    def embed(self, ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup: each rank fills the rows of its ids, the sum makes every row."""
        v0, v1 = self.plan.vocab
        mine = (ids >= v0) & (ids < v1)
        local = torch.where(mine, ids - v0, torch.zeros_like(ids)).clamp_(max=max(0, v1 - v0 - 1))
        x = F.embedding(local, table) * mine.unsqueeze(-1).to(table.dtype)
        return self.all_reduce(x)

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Each rank's vocab columns [T, shard] -> [T, vocab] on rank 0 (other ranks get theirs back)."""
        pad = self.plan.vocab_shard - logits.shape[1]
        part = F.pad(logits, (0, pad)).contiguous() if pad else logits.contiguous()
        parts = [torch.empty_like(part) for _ in range(self.world)] if self.rank == 0 else None
        dist.gather(part, parts, dst=0, group=self.group)
        if self.rank != 0:
            return logits
        return torch.cat(parts, dim=1)[:, : self.vocab_size]


def reduce_cpu(x: torch.Tensor, rank: int, world: int, group, combine) -> torch.Tensor:
    """``x`` combined over the ranks (in place) with gloo, faster than its all_reduce for the small
    tensors of a decode step (measured ~0.25 ms for two ranks against ~1 ms on a 2-core host): two
    ranks swap their tensors; more ranks gather all of them. Every rank combines the parts in rank
    order, so every rank gets the same bits."""
    if world == 2:
        other = torch.empty_like(x)
        peer = 1 - rank
        send = dist.isend(x.contiguous(), peer, group=group)
        recv = dist.irecv(other, peer, group=group)
        send.wait()
        recv.wait()
        first, second = (x, other) if rank == 0 else (other, x)
        return x.copy_(combine(first, second))
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    out = parts[0]
    for p in parts[1:]:
        out = combine(out, p)
    return x.copy_(out)
