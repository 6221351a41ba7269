"""Which layer each architecture stacks, with its rotary table, window and MLP."""

from __future__ import annotations

from typing import NamedTuple

from torch import nn

from tandem.config import GEMMA, OLMO, SANDWICH, ModelConfig
from tandem.model.decoder import DecoderLayer
from tandem.model.gemma import GemmaDecoderLayer
from tandem.model.moe import SparseMoeBlock
from tandem.model.olmo import OlmoDecoderLayer
from tandem.model.rope import NoRotation, RotaryEmbedding
from tandem.parallel import TensorParallel


class Ropes(NamedTuple):
    full: RotaryEmbedding  # rope_theta with rope_scaling
    sliding: RotaryEmbedding  # Gemma 3's sliding layers: rope_local_theta, unscaled; else `full`
    none: NoRotation | None = None  # SmolLM3's layers without position embedding


def rotary_embeddings(cfg: ModelConfig, max_position: int) -> Ropes:
    full = RotaryEmbedding(
        cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling, cfg.rotary_dim
    )
    none = NoRotation(cfg.head_dim, max_position) if cfg.rope_layers else None
    if cfg.rope_local_theta is None:
        return Ropes(full, full, none)
    return Ropes(full, RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_local_theta, None))


def embed_scale(cfg: ModelConfig) -> float | None:
    """What the embeddings are multiplied by (Gemma: sqrt(hidden_size), Granite: its
    embedding_multiplier); None: nothing."""
    return cfg.hidden_size**0.5 if cfg.architecture in GEMMA else cfg.embedding_multiplier


def make_layer(
    cfg: ModelConfig, index: int, ropes: Ropes, tp: TensorParallel, linear=nn.Linear
) -> nn.Module:
    """Layer `index`; `linear` is the class of its projections (FP8 or not)."""
    sliding = bool(cfg.sliding_layers) and cfg.sliding_layers[index]
    window = cfg.sliding_window if sliding else None
    rope = ropes.sliding if sliding else ropes.full  # the same table but for Gemma 3, OLMo 3
    if cfg.architecture in SANDWICH:
        return GemmaDecoderLayer(cfg, rope, tp, window, linear)
    if cfg.architecture in OLMO:
        return OlmoDecoderLayer(cfg, rope, tp, window, linear)
    mlp = SparseMoeBlock(cfg, tp) if cfg.is_moe_layer(index) else None
    if cfg.rope_layers and not cfg.rope_layers[index]:
        rope = ropes.none
    return DecoderLayer(cfg, rope, tp, mlp=mlp, sliding_window=window, linear=linear)
