"""The roofline of a step: the larger of bytes moved over bandwidth and FLOPs over peak (DESIGN.md §3).

Pure arithmetic on the model shape and what each step computed; no device is touched. Per step:

    bytes = weight bytes (every matrix, the LM head included, read once) + embedding rows looked up
          + KV read (context tokens) + KV written (new tokens)
          (FP8: the layers' matrices at 1 byte a weight, the LM head and embeddings at the model
          dtype's; an FP8 KV cache at 1 byte a value)
    FLOPs = 2 x layer matrix params x tokens + 2 x LM head params x sequences (one logits row each)
          + 4 x heads x head_dim x layers x (query, key) pairs (causal within a step's new tokens)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tandem.config import ModelConfig


@dataclass(frozen=True)
class Hardware:
    name: str
    bandwidth: float  # bytes/s, device-to-device copy (read + write)
    flops: float  # FLOP/s, dense GEMM in the model's dtype


H200 = Hardware("NVIDIA H200 (measured: 4.22 TB/s copy, 760 TFLOP/s bf16 GEMM)", 4.22e12, 760e12)


def on_devices(hardware: Hardware, count: int) -> Hardware:
    """`count` of `hardware` working as one (tensor parallel): bandwidth and peak add up, and the
    all-reduces are left out, so the roofline stays a bound."""
    if count == 1:
        return hardware
    return Hardware(
        f"{count} x {hardware.name}", count * hardware.bandwidth, count * hardware.flops
    )


@dataclass(frozen=True)
class ModelCost:
    """Per-shape constants of the roofline, in bytes and FLOPs."""

    weight_bytes: int  # every matrix, read once per step: q/k/v/o/gate/up/down and the LM head
    embed_row_bytes: int  # one embedding row, read per input token
    kv_bytes_per_token: int  # K and V of one token over all layers
    layer_flops_per_token: int  # 2 x the layers' matrix params
    lm_head_flops_per_seq: int  # 2 x the LM head's params: one logits row per sequence
    attention_flops_per_pair: int  # QK^T and PV for one (query, key) pair over all heads and layers
    # mixture of experts: weight_bytes leaves the experts out; a step reads expert_bytes (one
    # expert of every MoE layer) times the experts its tokens route to (`expected_experts`)
    expert_bytes: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0

    @classmethod
    def of(
        cls,
        cfg: ModelConfig,
        dtype_bytes: int,
        linear_bytes: float | None = None,
        kv_bytes: int | None = None,
    ) -> ModelCost:
        """`linear_bytes`, `kv_bytes`: per weight of the layers' matrices and per KV value,
        where not `dtype_bytes` (1 with FP8 weights, an FP8 KV cache; int4 weights about half
        a byte, their scales shared out)."""
        linear_bytes, kv_bytes = linear_bytes or dtype_bytes, kv_bytes or dtype_bytes
        h = cfg.hidden_size
        moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
        expert_params = moe_layers * 3 * h * cfg.moe_intermediate_size  # one expert per layer
        layer_params = cfg.num_layers * (h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h)
        layer_params += (cfg.num_layers - moe_layers) * 3 * h * cfg.intermediate_size
        layer_params += moe_layers * cfg.num_experts * h  # the routers
        if shared := cfg.shared_expert_intermediate_size:  # Qwen2-MoE's, with their gates:
            layer_params += moe_layers * (3 * h * shared + h)  # every step reads them
        lm_head_params = cfg.vocab_size * h
        return cls(
            weight_bytes=round(layer_params * linear_bytes) + lm_head_params * dtype_bytes,
            embed_row_bytes=h * dtype_bytes,
            kv_bytes_per_token=2 * cfg.num_layers * cfg.kv_size * kv_bytes,
            layer_flops_per_token=2 * (layer_params + cfg.num_experts_per_tok * expert_params),
            lm_head_flops_per_seq=2 * lm_head_params,
            attention_flops_per_pair=4 * cfg.num_heads * cfg.head_dim * cfg.num_layers,
            expert_bytes=expert_params * dtype_bytes,
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
        )

    def expected_experts(self, num_tokens: np.ndarray) -> np.ndarray:
        """Experts a layer reads for `num_tokens` tokens routed uniformly at random, top k of E
        each: E * (1 - (1 - k / E) ** tokens). E.g. 32 tokens, top 8 of 128: 111.8."""
        if not self.num_experts:
            return np.zeros_like(num_tokens, dtype=np.float64)
        missed = (1 - self.num_experts_per_tok / self.num_experts) ** num_tokens
        return self.num_experts * (1 - missed)


def step_work(
    seq_lens: list[int], query_start_loc: list[int], shared_kv_tokens: int = 0
) -> tuple[int, int, int, int]:
    """(num_seqs, num_tokens, context_tokens, attention_pairs) of one step from its host lists.

    context_tokens are the KV tokens read: `shared_kv_tokens` of them are blocks that rows share
    and the attention reads once per group (shared_prefix.py), so they are not counted again.
    """
    num_seqs = len(seq_lens)
    if query_start_loc[-1] == num_seqs:  # decode only: each new token sees its whole context
        context_tokens = sum(seq_lens)
        return num_seqs, num_seqs, context_tokens - shared_kv_tokens, context_tokens
    context = np.asarray(seq_lens, dtype=np.int64)  # [num_seqs] KV tokens after the step
    query = np.diff(np.asarray(query_start_loc, dtype=np.int64))  # [num_seqs] new tokens
    # the j-th of q new tokens sees context - q + j + 1 keys: q * context - q * (q - 1) / 2 pairs
    # E.g. decode (q=1, context=5): 5 pairs; prefill of 3 (q=3, context=3): 1 + 2 + 3 = 6 pairs
    pairs = query * context - query * (query - 1) // 2
    return num_seqs, int(query.sum()), int(context.sum()) - shared_kv_tokens, int(pairs.sum())


def step_rooflines(
    cost: ModelCost, work: np.ndarray, hardware: Hardware = H200
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-step (seconds, bytes, flops) for `work` rows of step_work(); all [num_steps] float64."""
    work = np.asarray(work, dtype=np.float64).reshape(-1, 4)
    num_seqs, num_tokens, context, pairs = work.T
    moved = (
        cost.weight_bytes
        + cost.expected_experts(num_tokens) * cost.expert_bytes
        + num_tokens * cost.embed_row_bytes
        + (context + num_tokens) * cost.kv_bytes_per_token
    )
    flops = (
        num_tokens * cost.layer_flops_per_token
        + num_seqs * cost.lm_head_flops_per_seq
        + pairs * cost.attention_flops_per_pair
    )
    seconds = np.maximum(moved / hardware.bandwidth, flops / hardware.flops)
    return seconds, moved, flops


def roofline_summary(
    cfg: ModelConfig,
    dtype_bytes: int,
    work: np.ndarray,
    hardware: Hardware = H200,
    linear_bytes: float | None = None,
    kv_bytes: int | None = None,
) -> dict:
    """The sum of per-step rooflines of `work` and what it consists of, for a benchmark report
    (`linear_bytes`, `kv_bytes`: as in ModelCost.of)."""
    cost = ModelCost.of(cfg, dtype_bytes, linear_bytes, kv_bytes)
    seconds, moved, flops = step_rooflines(cost, work, hardware)
    bytes_bound = moved / hardware.bandwidth >= flops / hardware.flops
    return {
        "hardware": hardware.name,
        "bandwidth_bytes_per_s": hardware.bandwidth,
        "peak_flops_per_s": hardware.flops,
        "dtype_bytes": dtype_bytes,
        "linear_weight_bytes": linear_bytes or dtype_bytes,
        "kv_value_bytes": kv_bytes or dtype_bytes,
        "weight_bytes": cost.weight_bytes,
        "seconds": float(seconds.sum()),
        "steps": len(seconds),
        "bytes_bound_steps": int(bytes_bound.sum()),
        "bytes": float(moved.sum()),
        "flops": float(flops.sum()),
    }
