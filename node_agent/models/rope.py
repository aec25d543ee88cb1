"""Rotary position embeddings: cos/sin tables (plain, or YaRN-scaled for DeepSeek-V3) and the
rotate-half application, with partial RoPE."""

from __future__ import annotations

import math

import torch

from pagoda.node_agent.models.config import ModelConfig, yarn_mscale


def _yarn_inv_freq(base: float, dim: int, p: dict) -> tuple[torch.Tensor, float]:
    """YaRN: inverse frequencies blended between interpolated (/factor) and original ones over a
    linear ramp of dims, and the cos/sin magnitude factor (mscale ratio, or mscale(factor))."""
    factor = float(p["factor"])
    orig = int(p["original_max_position_embeddings"])
    beta_fast, beta_slow = float(p.get("beta_fast") or 32), float(p.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolate = 1 - ramp
    inv = (1.0 / (factor * pos)) * (1 - extrapolate) + (1.0 / pos) * extrapolate
    attn = p.get("attention_factor")
    if attn is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attn = yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all else yarn_mscale(factor)
    return inv, float(attn)


def _llama3_inv_freq(inv: torch.Tensor, p: dict) -> torch.Tensor:
    """Llama 3.1 scaling: wavelengths longer than ``orig / low_freq_factor`` are stretched by
    ``factor``, those shorter than ``orig / high_freq_factor`` kept, and the band between blended
    linearly in ``orig / wavelength``."""
    factor, low, high = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
    orig = float(p["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    smooth = ((orig / wavelen - low) / (high - low)).clamp(0, 1)  # 0: stretch fully, 1: keep
    return (1 - smooth) * inv / factor + smooth * inv


def rope_tables(cfg: ModelConfig, max_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [max_len, rotary_dim] (the rotated part of a head: all of it unless partial RoPE)."""
    dim = cfg.rotary_dim
    scaling = cfg.rope_scaling
    kind = scaling.get("rope_type") if scaling else None
    if kind == "yarn":
        inv, attn = _yarn_inv_freq(cfg.rope_theta, dim, scaling)
    else:
        inv, attn = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)), 1.0
        if kind == "linear":
            inv = inv / float(scaling["factor"])
        elif kind == "llama3":
            inv = _llama3_inv_freq(inv, scaling)
    t = torch.arange(max_len, dtype=torch.float32)
    freqs = torch.outer(t, inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * attn).to(device), (emb.sin() * attn).to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on [T, H, D] with per-token cos/sin [T, R]: the first R dims of each head
    rotate (as pairs i, i + R/2), the rest pass through (partial RoPE)."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos[:, None, :] + rot.float() * sin[:, None, :]).to(x.dtype)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Interleaved rope pairs (x0, x1), (x2, x3)... -> rotate-half layout (evens, then odds): RoPE on
    the result equals DeepSeek's interleaved RoPE with its outputs in that layout."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
