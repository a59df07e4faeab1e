"""Rotary position embeddings: the frequency tables (plain, Llama 3.1's blend, linear, YaRN) and the
two layouts that rotate a head's dimensions (transformers' rotate-half, and DeepSeek's interleaved
pairs). The tables are ``[positions, rotary dims]``, halves duplicated, computed once per model and
sharded by position under context parallelism (parallel/context.py)."""

from __future__ import annotations

import math

import torch

from meshtrain.models.config import ModelConfig, RopeScalingConfig


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: RopeScalingConfig) -> torch.Tensor:
    if scaling.type == "yarn":
        return _yarn_inverse_frequencies(head_dim, theta, scaling)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling.type == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
        low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
        high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, blended, inv_freq)
    elif scaling.type == "linear":
        inv_freq = inv_freq / scaling.factor
    return inv_freq.float()


def _yarn_inverse_frequencies(dim: int, theta: float, s: RopeScalingConfig) -> torch.Tensor:
    """YaRN (Peng et al. 2023): frequencies that turn fewer than ``beta_slow`` times over the original
    context are interpolated (divided by ``factor``), those that turn more than ``beta_fast`` times
    kept, a linear ramp between. In float32, in transformers' order of operations, so the tables
    match its bit for bit."""
    def correction_dim(rotations: float) -> float:
        return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    return (1.0 / (s.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def attention_factor(scaling: RopeScalingConfig) -> float:
    """YaRN's factor on cos and sin (so on every score through both q and k): ``attention_factor``,
    else mscale(factor, mscale) / mscale(factor, mscale_all_dim) (DeepSeek's, 1.0 when they are
    equal), else mscale(factor). 1.0 for the other scalings."""
    if scaling.type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.mscale and scaling.mscale_all_dim:
        return yarn_mscale(scaling.factor, scaling.mscale) / yarn_mscale(scaling.factor, scaling.mscale_all_dim)
    return yarn_mscale(scaling.factor)


def rope_tables(cfg: ModelConfig, device: torch.device | str | None = None,
                local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, [max_position_embeddings, rotary dims], halves duplicated (rotate-half layout).
    ``local``: the sliding-window layers' own table (``model.local_rope_theta``, no scaling)."""
    theta, scaling = (cfg.local_rope_theta, RopeScalingConfig()) if local else (cfg.rope_theta, cfg.rope_scaling)
    inv_freq = rope_inverse_frequencies(cfg.definition.rope_dim(cfg), theta, scaling)
    positions = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    factor = attention_factor(scaling)
    cos, sin = angles.cos(), angles.sin()
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return cos.to(device), sin.to(device)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def _per_token(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    return cos[:, :, None, :].to(x.dtype), sin[:, :, None, :].to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, seq, heads, head_dim]; cos/sin: [seq, head_dim], or [batch, seq, head_dim] when each
    token has its own position (documents restarting theirs)."""
    cos, sin = _per_token(x, cos, sin)
    return x * cos + _rotate_half(x) * sin


def apply_interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's layout (``rope_interleave``): dims (0, 1), (2, 3)... are the rotated pairs. The
    result comes out de-interleaved (the pairs' first elements, then their second ones), as
    transformers returns it: the same for queries and keys, so their dot products are the
    interleaved rotation's."""
    half = cos.shape[-1] // 2
    cos, sin = _per_token(x, cos[..., :half], sin[..., :half])
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)
