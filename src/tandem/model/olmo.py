"""OLMo 2 and OLMo 3 decoder layers.

Beside Llama's layer: no norm before the attention or the MLP; their outputs are normed
instead (post_attention_layernorm, post_feedforward_layernorm) before they join the residual
stream, and q and k are each normed over all their heads at once (a norm of q_size, not of a
head). OLMo 3 windows three layers of four (`layer_types`), its full layers alone taking the
rope scaling (`layers.make_layer` gives the sliding ones the unscaled table). The q and k norms
span every head, so these layers run on one device (`parallel.check_shardable`).
"""

from __future__ import annotations

import torch

from tandem.config import ModelConfig
from tandem.model.decoder import Attention, DecoderLayer, RMSNorm, row_parallel
from tandem.model.lora import with_lora
from tandem.model.rope import RotaryEmbedding
from tandem.parallel import TensorParallel


class OlmoAttention(Attention):
    def __init__(self, cfg: ModelConfig, rope, tp: TensorParallel, sliding_window, linear):
        super().__init__(cfg, rope, tp, sliding_window, linear)
        self.q_norm = RMSNorm(cfg.q_size, cfg.rms_norm_eps)  # over every head of q
        self.k_norm = RMSNorm(cfg.kv_size, cfg.rms_norm_eps)

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple]:
        """q and k normed whole, then cut into heads; no per-head norm for the rotary."""
        qkv = with_lora(self.qkv_proj, x, self.qkv_proj(x))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        return q, k, v.view(-1, self.num_kv_heads, self.head_dim), ()


class OlmoDecoderLayer(DecoderLayer):
    def __init__(
        self,
        cfg: ModelConfig,
        rope: RotaryEmbedding,
        tp: TensorParallel,
        sliding_window: int | None,
        linear,
    ):
        super().__init__(cfg, rope, tp, sliding_window=sliding_window, linear=linear)
        del self.input_layernorm  # OLMo norms a sublayer's output, not its input
        self.self_attn = OlmoAttention(cfg, rope, tp, sliding_window, linear)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def before_attention(
        self, x, residual, positions, kv_cache, slot_mapping, q_out=None, rotate=True
    ):  # fmt: skip
        """(q, the residual stream): the previous layer's output added to the stream (the
        embeddings start it), whose sum the attention projects as it is."""
        residual = x if residual is None else residual.add_(x)
        q = self.self_attn.project(residual, positions, kv_cache, slot_mapping, q_out, rotate)
        return q, residual

    def after_attention(self, attended, residual):
        """(this layer's output, the residual stream): the attention's output normed and added
        to the stream, the MLP of the stream, normed."""
        o = row_parallel(self.self_attn.o_proj, attended.flatten(1), self.tp)
        residual.add_(self.post_attention_layernorm(o))
        down = row_parallel(self.mlp.down_proj, self.mlp.activated(residual), self.tp)
        return self.post_feedforward_layernorm(down), residual
