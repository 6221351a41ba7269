"""Gemma 2 and Gemma 3 (text) decoder layers.

Beside Llama's layer: a norm after the attention and around the MLP (four per layer), GeGLU,
the softmax scale query_pre_attn_scalar ** -0.5, attention logits soft-capped (Gemma 2), and
q/k norms (Gemma 3). Gemma's RMSNorm multiplies by (1 + weight): the loader stores 1 + weight,
so the norms here are tandem's own. Alternating sliding-window and full layers are set by
`layers.make_layer`; the scaled embeddings and the final logit cap by the `Decoder`.
"""

from __future__ import annotations

from torch import nn

from tandem.config import ModelConfig
from tandem.model.decoder import DecoderLayer, RMSNorm, row_parallel
from tandem.model.rope import RotaryEmbedding
from tandem.parallel import TensorParallel

# checkpoint norms stored as 1 + weight (the loader adds the 1)
GEMMA_NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
    "q_norm",
    "k_norm",
    "norm",
)


class GemmaDecoderLayer(DecoderLayer):
    def __init__(
        self,
        cfg: ModelConfig,
        rope: RotaryEmbedding,
        tp: TensorParallel,
        sliding_window: int | None,
        linear=nn.Linear,
    ):
        super().__init__(cfg, rope, tp, sliding_window=sliding_window, linear=linear)
        self.self_attn.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.self_attn.logits_soft_cap = cfg.attn_logit_softcapping
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def after_attention(self, attended, residual):
        """(this layer's output, the residual stream before it): the attention's output
        normed, added to the stream, normed again for the MLP, whose output is normed too."""
        h = self.post_attention_layernorm(
            row_parallel(self.self_attn.o_proj, attended.flatten(1), self.tp)
        )
        h, residual = self.pre_feedforward_layernorm.add_forward(h, residual)
        h = row_parallel(self.mlp.down_proj, self.mlp.activated(h), self.tp)
        return self.post_feedforward_layernorm(h), residual
