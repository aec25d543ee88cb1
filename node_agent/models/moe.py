"""Mixture-of-experts MLP: a router scoring every expert in float32 and choosing top-k per token,
the routed experts computed grouped by expert (kernels.moe.fused_moe) from one ExpertStack per phase
weight format, plus optional always-on shared experts (ordinary PhaseLinears)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from pagoda.kernels.dispatch import select_backend
from pagoda.kernels.int4 import pick_group_size
from pagoda.kernels.linear import DEFAULT_INT4_COMPUTE
from pagoda.kernels.moe import ExpertStack, fused_moe, make_expert_stack
from pagoda.kernels.selector import KernelSelection
from pagoda.node_agent.models.checkpoint_formats import dense_experts, prequantized_expert_stack
from pagoda.node_agent.models.config import ModelConfig, ModelLoadError, MoeConfig
from pagoda.node_agent.models.layers import PHASES, DenseMLP, PhaseLinear
from pagoda.node_agent.models.parallel import TensorParallel
from pagoda.vocabulary import STORED

# The engine's weight format names -> the expert stack's format (dense ones keep their dtype).
_STACK_FORMATS = {"bf16": "dense", "fp32": "dense", "fp8": "fp8", "int4": "int4"}


def route_softmax(logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE routing: softmax over the experts, the k most probable, optionally renormalized.
    Returns (weights [T, k] float32, ids [T, k] int64)."""
    probs = logits.float().softmax(dim=-1)
    weights, ids = probs.topk(k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def route_grouped_sigmoid(
    logits: torch.Tensor,
    correction_bias: torch.Tensor,
    k: int,
    n_group: int,
    topk_group: int,
    normalize: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GLM-4.5 / DeepSeek-V3 routing: sigmoid scores; the bias-corrected scores choose the experts,
    only within the ``topk_group`` groups whose best two corrected scores sum highest; the weights
    are the uncorrected scores of the chosen experts, optionally renormalized, times ``scaling``."""
    scores = logits.float().sigmoid()
    choice = scores + correction_bias.float()
    t, e = choice.shape
    if n_group > 1:
        per = e // n_group
        group_scores = choice.view(t, n_group, per).topk(2, dim=-1).values.sum(dim=-1)
        keep = group_scores.topk(topk_group, dim=-1).indices
        allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~allowed.repeat_interleave(per, dim=1), float("-inf"))
    ids = choice.topk(k, dim=-1).indices
    weights = scores.gather(1, ids)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def _stack_phase_format(fmt: str, pre: ExpertStack | None) -> str:
    """``stored``: the checkpoint's expert format (FP8 blocks serve ``fp8``), dense experts in the
    compute dtype; other formats as given."""
    if fmt != STORED:
        return fmt
    if pre is None:
        return "bf16"
    return "fp8" if pre.fmt == "fp8_block" else {"dense": "bf16"}.get(pre.fmt, pre.fmt)


def _serves(stored: ExpertStack, stack_fmt: str | None) -> bool:
    """Whether a checkpoint's expert stack runs a phase's stack format as stored (FP8 blocks serve
    the ``fp8`` format with their block scales)."""
    return stored.fmt == stack_fmt or (stored.fmt == "fp8_block" and stack_fmt == "fp8")


def expert_weights(
    w: dict[str, torch.Tensor], prefix: str, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gate [E, I, H], up [E, I, H], down [E, H, I]) of ``<prefix>experts``: per-expert tensors
    ``experts.{e}.gate_proj.weight`` (released checkpoints, transformers' save_pretrained) or the
    fused ``experts.gate_up_proj [E, 2I, H]`` / ``experts.down_proj [E, H, I]``."""
    fused = prefix + "experts.gate_up_proj"
    if fused in w:
        gate_up, down = w[fused], w[prefix + "experts.down_proj"]
        if gate_up.dim() != 3 or gate_up.shape[1] % 2:
            raise ModelLoadError(f"{fused}: expected [E, 2I, H], got {tuple(gate_up.shape)}")
        half = gate_up.shape[1] // 2
        return gate_up[:, :half], gate_up[:, half:], down
    names = ("gate_proj", "up_proj", "down_proj")
    gate, up, down = (
        torch.stack([w[f"{prefix}experts.{e}.{n}.weight"] for e in range(num_experts)]) for n in names
    )
    return gate, up, down


def expert_weight_names(prefix: str, num_experts: int, w: dict[str, torch.Tensor]) -> list[str]:
    """The names the experts of ``prefix`` need in ``w`` (fused form when present)."""
    if prefix + "experts.gate_up_proj" in w:
        return [prefix + "experts.gate_up_proj", prefix + "experts.down_proj"]
    return [
        f"{prefix}experts.{e}.{n}.weight"
        for e in range(num_experts)
        for n in ("gate_proj", "up_proj", "down_proj")
    ]


class MoeMLP:
    """One sparse layer's MLP (``prefix`` is ``model.layers.N.mlp.``)."""

    def __init__(
        self,
        cfg: MoeConfig,
        hidden_size: int,
        prefix: str,
        w: dict[str, torch.Tensor],
        formats: dict[str, str],
        dtype: torch.dtype,
        kernels: KernelSelection | None,
        group_size: int | None = None,
        experts: tuple[int, int] | None = None,
    ) -> None:
        """``experts``: the range of routed experts this rank holds (expert parallelism; renumbered
        from 0 in ``w``), None for all of them."""
        self.cfg = cfg
        self.backend = backend = None if kernels is None else kernels.backend
        self.experts = experts or (0, cfg.num_experts)
        n_local = self.experts[1] - self.experts[0]
        self.router = w[prefix + "gate.weight"].float().contiguous()  # [E, H], dense float32
        if tuple(self.router.shape) != (cfg.num_experts, hidden_size):
            raise ModelLoadError(
                f"{prefix}gate.weight: expected {(cfg.num_experts, hidden_size)}, got {tuple(self.router.shape)}"
            )
        bias = w.get(prefix + "gate.e_score_correction_bias")
        self.correction_bias = (
            torch.zeros(cfg.num_experts, device=self.router.device) if bias is None else bias.float()
        )
        # A prequantized checkpoint's experts serve their own format as stored; dequantized for others.
        pre = prequantized_expert_stack(w, prefix, n_local)
        stack_formats = {p: _stack_phase_format(f, pre) for p, f in formats.items()}
        if pre is None:
            gate, up, down = expert_weights(w, prefix, n_local)
        elif any(not _serves(pre, _STACK_FORMATS.get(stack_formats[p])) for p in PHASES):
            gate, up, down = dense_experts(pre)
        else:
            gate = up = torch.empty(pre.num_experts, pre.intermediate, pre.hidden, device="meta")
            down = gate.transpose(1, 2)  # shapes only: every phase serves the stored stack
        e, i, h = gate.shape
        if (e, i, h) != (n_local, cfg.expert_intermediate_size, hidden_size) or tuple(down.shape) != (
            e,
            h,
            i,
        ):
            raise ModelLoadError(
                f"{prefix}experts: shapes gate {tuple(gate.shape)} / down {tuple(down.shape)} do not match "
                f"num_experts={cfg.num_experts}, moe_intermediate_size={cfg.expert_intermediate_size}, "
                f"hidden_size={hidden_size}"
            )
        int4_compute = DEFAULT_INT4_COMPUTE if kernels is None else kernels.int4_compute
        if dtype != torch.float32:
            int4_compute = "bf16"  # the exact kernel takes float32 activations only
        self.stacks: dict[str, ExpertStack] = {}
        made: dict[tuple[str, torch.dtype], ExpertStack] = {}
        for phase in PHASES:
            fmt = stack_formats[phase]
            stack_fmt = _STACK_FORMATS.get(fmt)
            if stack_fmt is None:
                raise ValueError(f"unknown weight format {fmt!r} for the experts")
            stack_dtype = torch.float32 if fmt == "fp32" else dtype
            key = (stack_fmt, stack_dtype)
            if key not in made:
                g = pick_group_size(math.gcd(h, i), group_size or 128) if stack_fmt == "int4" else None
                if pre is not None and _serves(pre, stack_fmt):
                    stack = pre
                else:
                    stack = make_expert_stack(gate, up, down, stack_fmt, g, stack_dtype)
                if stack_fmt == "int4" and select_backend(self.router.device, backend) == "cpu":
                    # as the INT4 linear layer (--int4-compute): the exact native kernel's layout for
                    # float32 compute, else only torch's CPU int4pack layouts stay resident
                    stack.prepare("cpu", keep_canonical=False, compute=int4_compute)
                made[key] = stack
            self.stacks[phase] = made[key]
        self.shared = (
            DenseMLP(prefix + "shared_experts", w, formats, dtype, kernels, group_size)
            if cfg.n_shared_experts
            else None
        )

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, expert ids [T, k]) for hidden states h [T, H]."""
        c = self.cfg
        logits = F.linear(h.float(), self.router)
        if c.router == "softmax":
            return route_softmax(logits, c.top_k, c.norm_topk_prob)
        return route_grouped_sigmoid(
            logits,
            self.correction_bias,
            c.top_k,
            c.n_group,
            c.topk_group,
            c.norm_topk_prob,
            c.routed_scaling_factor,
        )

    def __call__(self, h: torch.Tensor, phase: str) -> torch.Tensor:
        """The MLP output; with expert parallelism this rank's share (its experts' terms and its
        slice of the shared experts), which the layer sums over the ranks."""
        weights, ids = self.route(h)
        e0, e1 = self.experts
        if (e0, e1) != (0, self.cfg.num_experts):  # other ranks' experts count zero here
            mine = (ids >= e0) & (ids < e1)
            weights = weights * mine
            ids = torch.where(mine, ids - e0, torch.zeros_like(ids))
        out = fused_moe(h, weights, ids, self.stacks[phase], backend=self.backend)
        if self.shared is not None:
            out = out + self.shared(h, phase)
        return out

    def linears(self) -> list[PhaseLinear]:
        """The shared experts' linear layers (the routed experts are expert stacks)."""
        return [] if self.shared is None else self.shared.linears()

    def unique_stacks(self) -> list[ExpertStack]:
        return list({id(s): s for s in self.stacks.values()}.values())

    def expert_bytes(self) -> int:
        """Resident bytes of the routed experts (every held format)."""
        return sum(s.nbytes() for s in self.unique_stacks())

    def router_bytes(self) -> int:
        return self.router.nbytes + self.correction_bias.nbytes


def layer_mlp(
    cfg: ModelConfig,
    idx: int,
    w: dict[str, torch.Tensor],
    formats: dict[str, str],
    dtype: torch.dtype,
    kernels: KernelSelection | None,
    group_size: int | None = None,
    tp: TensorParallel | None = None,
) -> DenseMLP | MoeMLP:
    """Layer ``idx``'s MLP: a MoeMLP for the sparse layers of a MoE family, else a DenseMLP."""
    p = f"model.layers.{idx}.mlp"
    if cfg.is_sparse(idx):
        experts = tp.plan.experts if tp is not None else None
        return MoeMLP(cfg.moe, cfg.hidden_size, p + ".", w, formats, dtype, kernels, group_size, experts)
    return DenseMLP(p, w, formats, dtype, kernels, group_size)
