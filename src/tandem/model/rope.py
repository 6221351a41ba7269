"""Rotary position embedding: the cos/sin table, built once (`fused.rope_qk` applies it).

Scaling types, by the `rope_type` of config.json (the same formulas as transformers' rope init
functions): `linear` (positions slowed by `factor`), `dynamic` (NTK: within
max_position_embeddings, which bounds every sequence tandem serves, its frequencies are the
default ones), `llama3`, `yarn` and `longrope` (frequencies blended or rescaled per dimension,
cos and sin times an attention factor). Longrope takes one set of factors for every position,
by the longest sequence the engine serves, as vLLM does: the long factors where max_model_len
exceeds `original_max_position_embeddings`, else the short ones. So every cached key keeps a
rotation the later ones share (transformers, which switches a sequence to the long factors once it
is longer, recomputes its cache at that point).
"""

from __future__ import annotations

import math
from typing import Any

import torch

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def default_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    """[head_dim // 2] float32 rotation speeds."""
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)


def llama3_frequencies(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    in_band = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(in_band, blended, scaled)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any]
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, attention factor): dimensions that turn fewer than `beta_slow`
    times over the original context are interpolated (slowed by `factor`), those that turn more
    than `beta_fast` times kept, a linear ramp between."""
    factor = scaling["factor"]
    old_len = scaling["original_max_position_embeddings"]
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dimension_of(rotations: float) -> float:  # the dimension turning `rotations` times
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension_of(beta_fast), dimension_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = default_frequencies(head_dim, theta)
    return extrapolated / factor * ramp + extrapolated * (1 - ramp), attention_factor


def longrope_attention_factor(scaling: dict[str, Any]) -> float:
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]
    factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))


def rope_angles(
    head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None
) -> tuple[torch.Tensor, float]:
    """([max_position, head_dim // 2] float32 angles, the factor cos and sin are scaled by)."""
    rope_type = "default" if scaling is None else scaling["rope_type"]
    positions = torch.arange(max_position, dtype=torch.float32)
    inv_freq, attention_factor = default_frequencies(head_dim, theta), 1.0
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        inv_freq = llama3_frequencies(inv_freq, scaling)
    elif rope_type == "yarn":
        inv_freq, attention_factor = yarn_frequencies(head_dim, theta, scaling)
    elif rope_type == "longrope":
        long = max_position > scaling["original_max_position_embeddings"]
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"])
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
        inv_freq = 1.0 / (factors.float() * theta**exponents)
        attention_factor = longrope_attention_factor(scaling)
    else:
        assert rope_type in ("default", "dynamic"), rope_type
    return torch.outer(positions, inv_freq), attention_factor


class RotaryEmbedding(torch.nn.Module):
    def __init__(
        self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None
    ):
        super().__init__()
        angles, attention_factor = rope_angles(head_dim, max_position, theta, scaling)
        # [max_position, head_dim] float32: cos in the first half, sin in the second
        cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1) * attention_factor
        self.register_buffer("cos_sin", cos_sin, persistent=False)
