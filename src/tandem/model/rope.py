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
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from tandem.config import ModelConfig

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
    """The table of a head of `head_dim` whose first `rotary_dim` dimensions rotate (0: all).
    With partial rotary, the frequencies are those of a `rotary_dim` head and the table's other
    columns cos 1, sin 0: dimensions that stay as they are, once the loader has reordered q and
    k so that pairs (i, i + rotary_dim / 2) sit at (j, j + head_dim / 2) (`hf_names`)."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: dict[str, Any] | None,
        rotary_dim: int = 0,
    ):
        super().__init__()
        dim = rotary_dim or head_dim
        angles, attention_factor = rope_angles(dim, max_position, theta, scaling)
        still = (head_dim - dim) // 2  # columns of dimensions that do not rotate
        cos = F.pad(angles.cos() * attention_factor, (0, still), value=1.0)
        sin = F.pad(angles.sin() * attention_factor, (0, still), value=0.0)
        # [max_position, head_dim] float32: cos in the first half, sin in the second
        self.register_buffer("cos_sin", torch.cat([cos, sin], dim=-1), persistent=False)


class NoRotation(torch.nn.Module):
    """The table of a layer without position embedding (SmolLM3's NoPE layers): angle 0
    everywhere, so the rotary kernels leave q and k as they are."""

    def __init__(self, head_dim: int, max_position: int):
        super().__init__()
        ones, zeros = (
            torch.ones(max_position, head_dim // 2),
            torch.zeros(max_position, head_dim // 2),
        )
        # [max_position, head_dim] float32: cos 1 | sin 0
        self.register_buffer("cos_sin", torch.cat([ones, zeros], dim=-1), persistent=False)


def rotary_order(head_dim: int, rotary_dim: int, interleaved: bool = False) -> torch.Tensor:
    """A head's dimensions in the order that rotates as a full-width table: the rotary pairs
    (i, i + rotary_dim / 2) (`interleaved`: (2i, 2i + 1)) at (j, j + head_dim / 2), the other
    dimensions in the columns whose angle is 0. E.g. head_dim 8, rotary_dim 4 ->
    [0, 1, 4, 5, 2, 3, 6, 7]; interleaved -> [0, 2, 4, 5, 1, 3, 6, 7]."""
    half, rest = rotary_dim // 2, (head_dim - rotary_dim) // 2
    if interleaved:
        first, second = torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2)
    else:
        first, second = torch.arange(0, half), torch.arange(half, rotary_dim)
    return torch.cat(
        [
            first,
            torch.arange(rotary_dim, rotary_dim + rest),
            second,
            torch.arange(rotary_dim + rest, head_dim),
        ]
    )


def rotary_rows(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """A q or k tensor (projection rows, bias, per-row scales, head norm) with each head's
    dimensions in `rotary_order`; any other tensor as it is. ValueError for a q or k tensor
    whose rows are not whole heads (block-quantized scales)."""
    leaf = name.rpartition(".")[0].rpartition(".")[2]
    reordered = cfg.rotary_dim or cfg.rotary_interleaved
    if not reordered or leaf not in ("q_proj", "k_proj", "q_norm", "k_norm"):
        return tensor
    if tensor.numel() == 1:  # a per-tensor scale
        return tensor
    d = cfg.head_dim
    if tensor.shape[0] % d:
        raise ValueError(
            f"checkpoint tensor {name!r} of shape {tuple(tensor.shape)} is not whole heads of "
            f"{d} rows: its rotary dimensions cannot be reordered (partial_rotary_factor)"
        )
    heads = tensor.reshape(tensor.shape[0] // d, d, *tensor.shape[1:])
    order = rotary_order(d, cfg.rotary_dim or d, cfg.rotary_interleaved)
    return heads[:, order].reshape(tensor.shape)
