"""A compressed-tensors checkpoint writer for the tests, written from the format's published layout
(what llmcompressor saves; see node_agent/models/compressed_tensors_format.py for the layout):
round-to-nearest scales instead of GPTQ's, the same tensors, names and config.

``quantize`` returns signed values, bf16 scales and signed zero points; ``pack_rows`` packs values
along a row into int32 words (value c at bit c*b of the row's little-endian bit string, stored +2^(b-1)).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from tests.formats.test_checkpoint_formats import _fused, _per_expert


def quantize(w: torch.Tensor, bits: int, group: int, symmetric: bool, g_idx: torch.Tensor | None = None):
    """``w [N, K]`` -> (q int8 [N, K], scale bf16 [N, G], zero int8 [N, G] or None, idx [K]): group
    ``idx[k]`` of channel k (``g_idx``, else k // group; group 0 means one group per row)."""
    n, k = w.shape
    g = group or k
    idx = torch.arange(k) // g if g_idx is None else g_idx.long()
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    q = torch.empty(n, k, dtype=torch.int8)
    scale = torch.empty(n, k // g, dtype=torch.bfloat16)
    zero = None if symmetric else torch.empty(n, k // g, dtype=torch.int8)
    for gi in range(k // g):
        cols = (idx == gi).nonzero().squeeze(1)
        wg = w[:, cols].float()
        if symmetric:
            s = (wg.abs().amax(1) / qmax).clamp(min=1e-8).to(torch.bfloat16).float()
            z = torch.zeros(n)
        else:
            lo, hi = wg.amin(1).clamp(max=0), wg.amax(1).clamp(min=0)
            s = ((hi - lo) / (qmax - qmin)).clamp(min=1e-8).to(torch.bfloat16).float()
            z = (qmin - lo / s).round().clamp(qmin, qmax)
            zero[:, gi] = z.to(torch.int8)
        scale[:, gi] = s.to(torch.bfloat16)
        q[:, cols] = (torch.round(wg / s[:, None]) + z[:, None]).clamp(qmin, qmax).to(torch.int8)
    return q, scale, zero, idx


def dequantize(q, scale, zero, idx) -> torch.Tensor:
    z = 0.0 if zero is None else zero.float()[:, idx]
    return (q.float() - z) * scale.float()[:, idx]


def pack_rows(vals: torch.Tensor, bits: int) -> torch.Tensor:
    """Signed ``vals [R, C]`` -> int32 ``[R, ceil(C * bits / 32)]``."""
    r, c = vals.shape
    u = vals.long() + (1 << (bits - 1))
    words = torch.zeros(r, -(-c * bits // 32), dtype=torch.int64)
    for j in range(c):
        word, off = divmod(j * bits, 32)
        words[:, word] |= (u[:, j] << off) & 0xFFFFFFFF
        if off + bits > 32:
            words[:, word + 1] |= u[:, j] >> (32 - off)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def weights_args(bits: int, group: int, symmetric: bool, actorder=None) -> dict:
    args = {
        "num_bits": bits,
        "type": "int",
        "symmetric": symmetric,
        "strategy": "group" if group else "channel",
        "group_size": group or None,
        "dynamic": False,
        "observer": "minmax",
    }
    if actorder is not None:
        args["actorder"] = actorder
    return args


def quant_config(groups: dict[str, tuple[dict, list[str]]], ignore: list[str]) -> dict:
    """``groups``: name -> (weights args, targets)."""
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            n: {"targets": t, "weights": w, "input_activations": None, "output_activations": None}
            for n, (w, t) in groups.items()
        },
        "ignore": ignore,
        "kv_cache_scheme": None,
    }


def _ignored(name: str, ignore: list[str]) -> bool:
    return any(re.match(i[3:], name) if i.startswith("re:") else i == name for i in ignore)


def write_ct_checkpoint(
    model,
    path: Path,
    tokenizer,
    args: dict,
    ignore: list[str],
    g_idx: str | None = None,
    seed: int = 0,
    targets: list[str] | None = None,
) -> tuple[dict, dict]:
    """Save ``model`` with every linear of ``model.layers`` not in ``ignore`` quantized by
    ``args``; ``g_idx``: None, "runs" (groups permuted as whole runs) or "scatter" (an act-order
    permutation). Returns (stored tensors, dequantized state dict in transformers' names)."""
    gen = torch.Generator().manual_seed(seed)
    stored, deq = {}, {}
    bits, group, sym = args["num_bits"], args["group_size"] or 0, args["symmetric"]
    for name, t in _per_expert(model.state_dict()).items():
        t = t.detach().float().contiguous()
        base = name.removesuffix(".weight")
        quantized = name.startswith("model.layers.") and name.endswith(".weight") and t.dim() == 2
        if not quantized or _ignored(base, ignore):
            stored[name], deq[name] = t, t
            continue
        n, k = t.shape
        idx = None
        if g_idx == "runs":
            idx = torch.randperm(k // group, generator=gen).repeat_interleave(group)
        elif g_idx == "scatter":
            idx = torch.argsort(torch.randperm(k, generator=gen)) // group
        q, scale, zero, used = quantize(t, bits, group, sym, idx)
        stored[base + ".weight_packed"] = pack_rows(q, bits)
        stored[base + ".weight_shape"] = torch.tensor([n, k], dtype=torch.int64)
        stored[base + ".weight_scale"] = scale
        if zero is not None:
            stored[base + ".weight_zero_point"] = pack_rows(zero.t(), bits).t().contiguous()
        if idx is not None:
            stored[base + ".weight_g_idx"] = idx.to(torch.int32)
        deq[name] = dequantize(q, scale, zero, used)
    save_file(stored, str(path / "model.safetensors"))
    cfg = model.config.to_dict()
    cfg["quantization_config"] = quant_config({"group_0": (args, targets or ["Linear"])}, ignore)
    (path / "config.json").write_text(json.dumps(cfg))
    tokenizer._tok.save_pretrained(path)
    return stored, _fused(deq, model.state_dict())
