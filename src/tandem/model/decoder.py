"""The decoder: ragged tokens in, hidden states out. Its layers are Llama's (Llama, Mistral,
Qwen2, Qwen3, Phi-3; Qwen3-MoE and Mixtral with `moe.SparseMoeBlock` as the MLP) or Gemma's
(`gemma.py`), made by `layers.make_layer`."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tandem.attention import AttentionBackend, AttentionMetadata, Unrotated, rotates_in_decode
from tandem.attention.torch_ref import soft_cap
from tandem.config import ModelConfig
from tandem.model import fused, splitk
from tandem.model.fused import act_and_mul, add_rms_norm, rope_qk
from tandem.model.lora import LoRALayers, with_lora
from tandem.model.rope import RotaryEmbedding
from tandem.parallel import TensorParallel
from tandem.quant.checkpoint import Fp8Config
from tandem.quant.fp8 import Fp8Rows
from tandem.quant.int4 import Int4Config
from tandem.quant.linear import linear_factory


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))
        self.fixed_warps = False  # deterministic mode: the kernel's warps never follow the rows
        # rows -> whether add_forward's kernel stores its output quantized for the W8A8 layer
        # it feeds (fp8.Fp8Rows); set by quant.linear.prepare
        self.quantize_out: Callable[[int], bool] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        return add_rms_norm(rows, None, self.weight, self.eps, self.fixed_warps)[0].view(x.shape)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor | Fp8Rows, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual stream advances in the same kernel;
        the norm comes quantized where `quantize_out` says so."""
        fp8_out = wants_fp8_out(self.quantize_out, x)
        return add_rms_norm(x, residual, self.weight, self.eps, self.fixed_warps, fp8_out)


def wants_fp8_out(wanted: Callable[[int], bool] | None, x: torch.Tensor) -> bool:
    """Whether the kernel taking x ([..., rows, cols]) stores its output as `Fp8Rows`: only
    Triton kernels do (the torch path stays the layer's own), where the layer wants them."""
    return wanted is not None and fused.use_kernels(x) and wanted(x.shape[-2])


def to_residual(linear: nn.Linear, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The o or the down projection. Its output always goes to a residual add + RMSNorm next,
    so on one device it may be split-K partial sums [splits, rows, out] that the norm adds up
    (`splitk`). x may come quantized for an FP8 layer (`Fp8Rows`, see `MLP.quantize_out`)."""
    values = x.values if isinstance(x, Fp8Rows) else x
    # LoRA adapters in this step: the plain product plus their delta
    lora = vars(linear).get("lora")
    with_adapters = lora is not None and lora.layers.active
    if tp.size == 1 and linear.bias is None and fused.use_kernels(values) and not with_adapters:
        # a layer's own way: FP8 layers', and deterministic mode's slices in a split count
        # fixed by the weight (batch_invariant.py)
        own = getattr(linear, "residual_partials", None)
        if own is not None:
            return own(x)
        if splitk.ENABLED:
            return splitk.residual_product(x, linear.weight, fallback=linear)
    return row_parallel(linear, x, tp)


def row_parallel(linear: nn.Linear, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The product of a projection whose input features are split across ranks: partial sums
    (with their LoRA delta), all-reduced, then the bias; on one device the layer itself."""
    if tp.size == 1:
        return with_lora(linear, x, linear(x))
    partial = F.linear(x, linear.weight) if type(linear) is nn.Linear else linear(x, False)
    y = tp.all_reduce(with_lora(linear, x, partial))
    return y if linear.bias is None else y + linear.bias


class VocabParallelEmbedding(nn.Module):
    """Rank r holds rows [r * per_rank, (r + 1) * per_rank) of the (padded) vocabulary."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.first, self.per_rank = tp.part(vocab_size)
        self.weight = nn.Parameter(torch.zeros(self.per_rank, hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.first
        mine = (local >= 0) & (local < self.per_rank)
        x = F.embedding(local * mine, self.weight) * mine[:, None]
        return self.tp.all_reduce(x)


class Attention(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        rope: RotaryEmbedding,
        tp: TensorParallel,
        sliding_window: int | None = None,
        linear=nn.Linear,
    ):
        super().__init__()
        self.sliding_window = sliding_window
        self.logits_soft_cap: float | None = None
        self.tp = tp
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.scale = cfg.attention_multiplier or cfg.head_dim**-0.5
        # an FP8 KV cache's per-tensor scales (the checkpoint's, see loader.set_kv_scales)
        self.k_scale = self.v_scale = 1.0
        # q, k and v projections stacked into one matrix: [q_size + 2 * kv_size, hidden]
        self.qkv_proj = linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rope = rope

    def project(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        q_out: torch.Tensor | None = None,
        rotate: bool = True,
    ) -> torch.Tensor | Unrotated:
        """Up to the attention: q, k and v, their norms and rotary; k and v go to the cache and
        q is returned [tokens, heads, head_dim] (in `q_out` when given). Without `rotate`, the
        three as projected, for the attention's decode kernel to do the rest (`Unrotated`)."""
        q, k, v, norms = self.heads(x)
        if not rotate:
            return Unrotated(q, k, v, self.rope.cos_sin, slot_mapping, *norms)
        return rope_qk(
            q, k, v, positions, self.rope.cos_sin, kv_cache, slot_mapping, *norms, q_out=q_out,
            k_scale=self.k_scale, v_scale=self.v_scale,
        )  # fmt: skip

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple]:
        """(q, k, v) [tokens, heads, head_dim] as projected, and the per-head norms' arguments
        for the rotary (q and k norm weights and eps; () without them)."""
        qkv = with_lora(self.qkv_proj, x, self.qkv_proj(x))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.q_norm else ()
        return q, k, v, norms

    def attend_options(self) -> dict:
        """This layer's arguments to the attention backend besides q, the cache and metadata."""
        return {
            "scale": self.scale,
            "k_scale": self.k_scale,
            "v_scale": self.v_scale,
            "sliding_window": self.sliding_window,
            "logits_soft_cap": self.logits_soft_cap,
        }

    def output(self, attended: torch.Tensor) -> torch.Tensor:
        """After the attention: the o projection of its [tokens, heads, head_dim] result."""
        return to_residual(self.o_proj, attended.flatten(1), self.tp)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, linear=nn.Linear):
        super().__init__()
        self.tp = tp
        # gate and up projections stacked: [2 * intermediate, hidden]
        self.gate_up_proj = linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.hidden_act = cfg.hidden_act
        # as RMSNorm.quantize_out, for the activation ahead of down_proj
        self.quantize_out: Callable[[int], bool] | None = None

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        return to_residual(self.down_proj, self.activated(x), self.tp)

    def activated(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor | Fp8Rows:
        """act(gate) * up: [rows, hidden] -> [rows, inter], quantized where `quantize_out`
        says so."""
        gate_up = with_lora(self.gate_up_proj, x, self.gate_up_proj(x))
        fp8_out = wants_fp8_out(self.quantize_out, gate_up)
        return act_and_mul(gate_up, self.hidden_act, fp8_out)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        rope: RotaryEmbedding,
        tp: TensorParallel,
        mlp: nn.Module | None = None,  # a dense MLP unless given (the experts of a MoE layer)
        sliding_window: int | None = None,
        linear=nn.Linear,  # the projections' class (quant.linear.linear_factory)
    ):
        super().__init__()
        self.tp = tp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rope, tp, sliding_window, linear)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp, linear) if mlp is None else mlp

    def before_attention(
        self, x, residual, positions, kv_cache, slot_mapping, q_out=None, rotate=True
    ):  # fmt: skip
        """(q, the residual stream): the previous layer's output added to the stream, the norm,
        and the attention's projections (this step's K/V stored; without `rotate` left to the
        attention, see `Attention.project`)."""
        h, residual = self.input_layernorm.add_forward(x, residual)
        q = self.self_attn.project(h, positions, kv_cache, slot_mapping, q_out, rotate)
        return q, residual

    def after_attention(self, attended, residual):
        """(this layer's output, the residual stream before it); the caller adds the two. On
        one device the output may be partials [parts, rows, hidden] that the next add + RMSNorm
        sums (the down projection's split-K slices, a MoE block's top_k expert outputs)."""
        h = self.self_attn.output(attended)
        # a MoE block may take the norm into its own launches (`moe.SparseMoeBlock`)
        after_attention = getattr(self.mlp, "after_attention", None)
        out = after_attention and after_attention(h, residual, self.post_attention_layernorm)
        if out is not None:
            return out, residual
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual

    def forward(self, x, residual, positions, kv_cache, meta, attend):
        """(this layer's output, the residual stream before it); the caller adds the two. The
        residual stream is advanced in place (see `fused.add_rms_norm`)."""
        # on CUDA with the fused kernels (TANDEM_FUSED_KERNELS=0 keeps rope_qk's torch version)
        rotate = not (fused.use_kernels(x) and rotates_in_decode(attend, meta, kv_cache))
        q, residual = self.before_attention(
            x, residual, positions, kv_cache, meta.slot_mapping, rotate=rotate
        )
        attended = attend(q, kv_cache, meta, **self.self_attn.attend_options())
        return self.after_attention(attended, residual)


class Decoder(nn.Module):
    """Token ids of a ragged batch -> final hidden states; logits only for the rows that sample.

    `cfg` holds this rank's shapes (its heads, KV heads and MLP slice; see parallel.shard_config).
    With a quantized `scheme`, the layers' projections are `quant.linear.Fp8Linear`s or
    `quant.int4.Int4Linear`s (the one seam of quantized weights); embeddings, norms, the MoE
    experts and the LM head stay in the model dtype.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        max_position: int,
        tp: TensorParallel | None = None,
        scheme: Fp8Config | Int4Config | None = None,
    ):
        super().__init__()
        self.cfg = cfg
        # the engine's update_weights (a weakref.WeakMethod), behind `load_weights`
        self.weight_loader: Callable[[], Callable | None] | None = None
        self.tp = tp = tp or TensorParallel()
        from tandem.model.layers import embed_scale, make_layer, rotary_embeddings  # they use us

        ropes = rotary_embeddings(cfg, max_position)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.embed_scale = embed_scale(cfg)
        linear = linear_factory(scheme)
        self.layers = nn.ModuleList(
            make_layer(cfg, i, ropes, tp, linear) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nn.Linear(cfg.hidden_size, self.embed_tokens.per_rank, bias=False)
        )
        self.linear = F.linear  # the LM head's product (batch_invariant.py swaps it)
        # LoRA adapters' weights and the step's mask, where the engine runs adapters
        # (lora/adapters.py)
        self.lora: LoRALayers | None = None
        # a sequence classifier's head, read at a prompt's last token (pooling.py); replicated
        self.score = (
            nn.Linear(cfg.hidden_size, cfg.num_labels, bias=False) if cfg.num_labels else None
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[
            torch.Tensor
        ],  # per layer [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        attend: AttentionBackend,
        embeds: tuple[torch.Tensor, torch.Tensor] | None = None,  # prompt_embeds.py's rows
    ) -> torch.Tensor:
        x, residual = self.embed(input_ids, embeds), None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, positions, kv_cache, meta, attend)
        return self.norm.add_forward(x, residual)[0]

    def embed(
        self, input_ids: torch.Tensor, embeds: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """[tokens] -> [tokens, hidden]; Gemma scales the embeddings by sqrt(hidden), rounded
        to the model dtype as transformers does. With `embeds` (rows [n] int64, values [n,
        hidden]), a prompt's given embeddings in those rows, as they are: the first layer's
        input, scaled already (transformers' and vLLM's inputs_embeds)."""
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        return x if embeds is None else x.index_copy(0, *embeds)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[rows, hidden] -> [rows, vocab] in the model's dtype (each rank's vocabulary slice
        gathered). The sampler reads them as they are; a float32 copy of [rows, vocab] would be
        a full extra pass over the largest tensor of a decode step. With `out` ([rows, vocab]),
        into it: the LM head's product itself where nothing follows it, else a copy."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if self.cfg.logits_scaling is not None:  # Granite: logits / s, as (hidden / s) @ W.T
            hidden = hidden * (1.0 / self.cfg.logits_scaling)
        direct = (
            self.tp.size == 1
            and self.linear is F.linear
            and weight.shape[0] == self.cfg.vocab_size
            and self.cfg.final_logit_softcapping is None
        )
        if out is not None and direct:
            return torch.mm(hidden, weight.t(), out=out)  # F.linear's own product, in place
        logits = self.tp.gather_columns(self.linear(hidden, weight))
        logits = soft_cap(logits[:, : self.cfg.vocab_size], self.cfg.final_logit_softcapping)
        return logits if out is None else out.copy_(logits)

    def load_weights(self, weights) -> set[str]:
        """vLLM's, as `llm.apply_model(lambda model: model.load_weights(pairs))` calls it: the
        (Hugging Face name, tensor) pairs go through the engine serving this model
        (`Engine.update_weights`: checked whole first, copied after the steps launched before,
        its prefix cache forgotten); returns the names taken."""
        engine_update = self.weight_loader and self.weight_loader()
        if engine_update is None:
            raise RuntimeError(
                "load_weights copies through the engine that serves this model, and none does "
                "(never built by one, or shut down)"
            )
        return engine_update(weights)
