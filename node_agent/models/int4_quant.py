"""INT4 quantization of dense weights for ``pagoda quantize``: per-layer group sizes, integer or
float zero points, and an optional calibration-based clip search.

* Group size: by default each layer takes the largest of ``AUTO_GROUPS`` dividing its K; a forced
  size must divide every layer's K.
* Zero point: ``int`` (the engine's own round to nearest: groups span ``[min(w, 0), max(w, 0)]``,
  integer zero points 0..15) or ``float`` (GGUF Q4_1's form: ``w = q * scale + min`` over the
  group's own ``[min, max]``, so no code is spent on an unused side of 0).
* Clip search (``clip_search``): per (output row, group) the range is shrunk by each ratio of
  ``CLIP_GRID`` and the ratio with the smallest error of that group's share of the output,
  ``d^T H d`` with ``d`` the rounding error and ``H = X^T X`` the group's block of the calibration
  activations' Gram matrix, is kept. Then ``REFINE_STEPS`` times: for the chosen codes, the scale
  (and the float offset) minimising that error in closed form (least squares weighted by ``H``), the
  codes rounded again on the new grid, kept per group only where the error drops. Ratio 1 (plain
  round to nearest) is on the grid and every step keeps the better values, so the calibration
  error never grows.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pagoda.kernels.int4 import SUPPORTED_GROUPS, Int4Weight, pack_nibbles, quantize_int4

AUTO_GROUPS = (128, 64, 32)  # the engine's default choice: 256 saves little and costs accuracy
ZERO_KINDS = ("int", "float")
CLIP_GRID = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6)
REFINE_STEPS = 2
_SCALE_FLOOR = 1e-12


def layer_group_size(k: int, forced: int | None = None, name: str = "weight") -> int:
    """The group of a layer with input width ``k``: ``forced`` (which must divide it) or the largest
    of ``AUTO_GROUPS`` that does."""
    if forced is not None:
        if forced not in SUPPORTED_GROUPS:
            raise ValueError(
                f"group size must be one of {', '.join(map(str, SUPPORTED_GROUPS))}, got {forced}"
            )
        if k % forced:
            raise ValueError(
                f"group size {forced} does not divide K={k} of {name}; use --group-size auto (the largest "
                f"of {', '.join(map(str, AUTO_GROUPS))} dividing each layer's K)"
            )
        return forced
    for g in AUTO_GROUPS:
        if k % g == 0:
            return g
    raise ValueError(f"no INT4 group size in {AUTO_GROUPS} divides K={k} of {name}")


def _quantize_groups(wg: Tensor, ratio: Tensor | float, float_zero: bool) -> tuple[Tensor, ...]:
    """[N, G, g] float32 with ranges shrunk by ``ratio`` ([N, G] or a number) ->
    (q uint8 [N, G, g], scale [N, G], zero-or-min [N, G])."""
    if float_zero:
        lo, hi = wg.amin(-1), wg.amax(-1)
    else:
        lo, hi = wg.amin(-1).clamp(max=0.0), wg.amax(-1).clamp(min=0.0)
    lo, hi = lo * ratio, hi * ratio
    scale = ((hi - lo) / 15.0).clamp(min=_SCALE_FLOOR)
    if float_zero:
        q = torch.round((wg - lo[..., None]) / scale[..., None]).clamp(0, 15)
        return q.to(torch.uint8), scale, lo
    zero = (-lo / scale).round().clamp(0, 15)
    q = (torch.round(wg / scale[..., None]) + zero[..., None]).clamp(0, 15)
    return q.to(torch.uint8), scale, zero


def _dequant_groups(q: Tensor, scale: Tensor, zm: Tensor, float_zero: bool) -> Tensor:
    if float_zero:
        return q.float() * scale[..., None] + zm[..., None]
    return (q.float() - zm[..., None]) * scale[..., None]


def _weight(n: int, k: int, g: int, q: Tensor, scale: Tensor, zm: Tensor, float_zero: bool) -> Int4Weight:
    packed = pack_nibbles(q.reshape(n, k)).contiguous()
    if float_zero:
        return Int4Weight(n, k, g, False, packed, scale.contiguous(), None, mins=zm.contiguous())
    return Int4Weight(n, k, g, False, packed, scale.contiguous(), zm.to(torch.uint8).contiguous())


def quantize_rtn(w: Tensor, group_size: int, float_zero: bool = False) -> Int4Weight:
    """Round to nearest, asymmetric; the integer-zero form is exactly the engine's ``quantize_int4``."""
    if not float_zero:
        return quantize_int4(w, group_size)
    n, k = w.shape
    q, scale, lo = _quantize_groups(w.detach().float().reshape(n, k // group_size, group_size), 1.0, True)
    return _weight(n, k, group_size, q, scale, lo, True)


def group_grams(gram: Tensor, group_size: int) -> Tensor:
    """The diagonal ``[g, g]`` blocks of a ``[K, K]`` Gram matrix -> ``[K/g, g, g]``."""
    k = gram.shape[0]
    blocks = gram.float().reshape(k // group_size, group_size, k // group_size, group_size)
    return blocks.diagonal(dim1=0, dim2=2).permute(2, 0, 1).contiguous()


def _group_output_error(d: Tensor, h: Tensor) -> Tensor:
    """``d [N, G, g]`` weight error, ``h [G, g, g]`` -> ``[N, G]`` summed squared output error."""
    dt = d.transpose(0, 1)  # [G, N, g]
    return (torch.bmm(dt, h) * dt).sum(-1).transpose(0, 1)


def clip_search(
    w: Tensor,
    gram: Tensor,
    group_size: int,
    float_zero: bool = False,
    grid: tuple[float, ...] = CLIP_GRID,
    refine_steps: int = REFINE_STEPS,
) -> tuple[Int4Weight, dict[str, float]]:
    """INT4 of ``w [N, K]`` with each (row, group)'s clip ratio chosen from ``grid`` to minimise the
    group's output error on activations whose Gram matrix is ``gram [K, K]``; also the calibration
    output error of plain round to nearest and of the result (``rtn_error``, ``error``) and the mean
    chosen ratio."""
    n, k = w.shape
    g = group_size
    if tuple(gram.shape) != (k, k):
        raise ValueError(f"calibration Gram matrix must be {(k, k)}, got {tuple(gram.shape)}")
    wg = w.detach().float().reshape(n, k // g, g)
    h = group_grams(gram, g)
    best_err = best_ratio = None
    rtn_err = 0.0
    for r in grid:
        q, scale, zm = _quantize_groups(wg, r, float_zero)
        err = _group_output_error(wg - _dequant_groups(q, scale, zm, float_zero), h)
        if r == 1.0:
            rtn_err = float(err.sum())
        if best_err is None:
            best_err, best_ratio = err, torch.full_like(err, r)
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_ratio = torch.where(better, torch.full_like(err, r), best_ratio)
    q, scale, zm = _quantize_groups(wg, best_ratio, float_zero)
    clipped_err = float(best_err.sum())
    for _ in range(refine_steps):
        q, scale, zm, best_err = _refine(wg, h, q, scale, zm, best_err, float_zero)
    stats = {
        "rtn_error": rtn_err,
        "clip_error": clipped_err,
        "error": float(best_err.sum()),
        "mean_ratio": float(best_ratio.mean()),
    }
    return _weight(n, k, g, q, scale, zm, float_zero), stats


def _h_times(v: Tensor, h: Tensor) -> Tensor:
    """``v [N, G, g]`` times each group's ``h [G, g, g]`` -> ``[N, G, g]``."""
    return torch.bmm(v.transpose(0, 1), h).transpose(0, 1)


def _refine(
    wg: Tensor, h: Tensor, q: Tensor, scale: Tensor, zm: Tensor, err: Tensor, float_zero: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One scale refinement: for the current codes, the scale (and, for float zeros, the offset)
    minimising each group's output error in closed form (least squares weighted by ``h``), then the
    codes rounded again on that grid; a group keeps its old values unless its error drops."""
    hw = _h_times(wg, h)
    if float_zero:
        a = q.float()
        ones = torch.ones_like(a)
        ha, h1 = _h_times(a, h), _h_times(ones, h)
        aha, ah1, oh1 = (a * ha).sum(-1), (a * h1).sum(-1), h1.sum(-1)
        ahw, ohw = (a * hw).sum(-1), hw.sum(-1)
        det = aha * oh1 - ah1 * ah1
        ok = det.abs() > 1e-9 * (aha * oh1).abs()
        safe = torch.where(ok, det, torch.ones_like(det))
        s_new, m_new = (ahw * oh1 - ah1 * ohw) / safe, (aha * ohw - ah1 * ahw) / safe
        ok &= (s_new > _SCALE_FLOOR) & torch.isfinite(s_new) & torch.isfinite(m_new)
        s_new, m_new = torch.where(ok, s_new, scale), torch.where(ok, m_new, zm)
        q_new = torch.round((wg - m_new[..., None]) / s_new[..., None]).clamp(0, 15).to(torch.uint8)
        z_new = m_new
    else:
        c = q.float() - zm[..., None]
        chc = (c * _h_times(c, h)).sum(-1)
        s_new = (c * hw).sum(-1) / torch.where(chc > 0, chc, torch.ones_like(chc))
        ok = (chc > 0) & (s_new > _SCALE_FLOOR) & torch.isfinite(s_new)
        s_new = torch.where(ok, s_new, scale)
        q_new = (torch.round(wg / s_new[..., None]) + zm[..., None]).clamp(0, 15).to(torch.uint8)
        z_new = zm
    e_new = _group_output_error(wg - _dequant_groups(q_new, s_new, z_new, float_zero), h)
    better = e_new < err
    return (
        torch.where(better[..., None], q_new, q),
        torch.where(better, s_new, scale),
        torch.where(better, z_new, zm),
        torch.where(better, e_new, err),
    )
