"""Resident weight bytes of a built decoder, by part and by format (what ``weight_bytes()`` reports).

Parts: ``embeddings`` (token embeddings and LM head), ``attention`` (every linear layer of a block
outside its MLP), ``mlp`` (dense MLPs and shared experts), ``experts`` (routed expert stacks, every
held format) and ``other`` (norms, routers). ``linear`` (attention + mlp) and ``total`` are kept for
older readers. ``by_format`` splits the same total by weight format: a linear layer or expert stack
under the format it was built in (``bf16`` held in the engine's compute dtype), unquantized tensors
(embeddings, norms, routers) under their dtype.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from pagoda.node_agent.models.layers import PHASES, PhaseLinear, RMSNorm
from pagoda.node_agent.models.moe import MoeMLP

PARTS = ("embeddings", "attention", "mlp", "experts", "other")
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def dtype_name(dtype: torch.dtype) -> str:
    """``bf16`` / ``fp16`` / ``fp32`` (else torch's own name without the ``torch.`` prefix)."""
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Tally:
    def __init__(self) -> None:
        self.parts: dict[str, int] = dict.fromkeys(PARTS, 0)
        self.formats: dict[str, int] = defaultdict(int)

    def add(self, part: str, fmt: str, nbytes: int) -> None:
        self.parts[part] += nbytes
        self.formats[fmt] += nbytes

    def linears(self, part: str, lins: list[PhaseLinear]) -> None:
        for lin in lins:
            for w in lin.unique_weights():
                self.add(part, w.fmt, w.nbytes)

    def tensor(self, part: str, t: torch.Tensor) -> None:
        self.add(part, dtype_name(t.dtype), _tensor_bytes(t))


def _experts(tally: _Tally, moe: MoeMLP, phase_formats: dict[str, str]) -> None:
    """Each distinct expert stack once, under the format of the first phase that runs it."""
    seen: set[int] = set()
    for phase in PHASES:
        stack = moe.stacks[phase]
        if id(stack) in seen:
            continue
        seen.add(id(stack))
        fmt = stack.fmt if stack.fmt != "dense" else phase_formats.get(phase, dtype_name(stack.gate_up.dtype))
        tally.add("experts", fmt, stack.nbytes())
    tally.add("other", "fp32", moe.router_bytes())


def _norms(layer: Any) -> list[RMSNorm]:
    """The RMSNorms a layer holds, directly or in an attention object of its own (one level down)."""
    found: dict[int, RMSNorm] = {}
    for value in vars(layer).values():
        if isinstance(value, RMSNorm):
            found[id(value)] = value
        elif hasattr(value, "__dict__") and not isinstance(value, PhaseLinear | MoeMLP | torch.nn.Module):
            found.update({id(v): v for v in vars(value).values() if isinstance(v, RMSNorm)})
    return list(found.values())


def weight_breakdown(model: Any) -> dict[str, Any]:
    """``{"embeddings", "attention", "mlp", "experts", "other", "linear", "total": int,
    "by_format": {format: int}}`` for a LlamaForCausalLM-shaped model (layers with ``linears()``,
    ``mlp`` and RMSNorm attributes; ``embed``, ``lm_head``, ``norm``)."""
    tally = _Tally()
    tally.tensor("embeddings", model.embed)
    tally.linears("embeddings", [model.lm_head])
    tally.tensor("other", model.norm.weight)
    for layer in model.layers:
        lins = layer.linears()
        mlp_ids = {id(lin) for lin in layer.mlp.linears()}
        tally.linears("attention", [lin for lin in lins if id(lin) not in mlp_ids])
        tally.linears("mlp", [lin for lin in lins if id(lin) in mlp_ids])
        if isinstance(layer.mlp, MoeMLP):
            phase_formats = {p: lins[0].by_phase[p].fmt for p in PHASES} if lins else {}
            _experts(tally, layer.mlp, phase_formats)
        for norm in _norms(layer):
            tally.tensor("other", norm.weight)
    out: dict[str, Any] = dict(tally.parts)
    out["linear"] = out["attention"] + out["mlp"]
    out["total"] = sum(tally.parts.values())
    out["by_format"] = dict(sorted(tally.formats.items()))
    return out


def phase_format_bytes(model: Any) -> dict[str, dict[str, int]]:
    """Bytes of the block layers each phase runs, by the format each runs in (``phase -> format ->
    bytes``; a weight two phases share counts in both): what ``stored`` formats resolved to."""
    out: dict[str, dict[str, int]] = {}
    for phase in PHASES:
        tally: dict[str, int] = defaultdict(int)
        for layer in model.layers:
            for lin in layer.linears():
                w = lin.by_phase[phase]
                tally[w.fmt] += w.nbytes
            if isinstance(layer.mlp, MoeMLP):
                stack = layer.mlp.stacks[phase]
                fmt = stack.fmt if stack.fmt != "dense" else dtype_name(stack.gate_up.dtype)
                tally[f"experts {fmt}"] += stack.nbytes()
        out[phase] = dict(sorted(tally.items()))
    return out
