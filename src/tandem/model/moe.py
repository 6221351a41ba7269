"""Mixture-of-experts MLP (Qwen2-MoE, Qwen3-MoE, Mixtral): a top-k router and the routed
experts, and Qwen2-MoE's shared expert.

Routing as both models define it (`moe_routing`): softmax over the experts in float32, the top
k, renormalised to sum to one where the model asks (`norm_topk_prob`; Mixtral always). On CUDA
the routing and the pairs' alignment by expert are one Triton launch at decode sizes (two past
them) and the experts the grouped GEMMs of `fused_moe`; elsewhere both are the same arithmetic
in torch (CPU engines; tests run the Triton kernels under the interpreter against it). A decode
step's MoE block is then four launches: the router's product (split-K slices, `splitk`, which
the routing adds up as it reads them), the routing, the two grouped GEMMs. At one token the
layer's post-attention norm runs inside the router's launch and the routing inside GEMM 1's
programs (`moe_one_token`, through `after_attention`): three launches with the norm.

On one device the block returns each token's top_k weighted expert outputs as partials
[top_k, tokens, hidden] (a view of GEMM 2's output): the residual add + RMSNorm that always
follows adds them up as it reads them (`fused.add_rms_norm`), as it does split-K partial sums,
so the sum over top_k costs no launch and no pass of its own.

Qwen2-MoE adds a shared expert, a dense MLP every token takes, its output scaled by
sigmoid(shared_expert_gate(x)) and added to the routed experts' sum (`decoder.MLP`); the block
then returns that sum (on one device too). With the Triton kernels the shared down projection
is split-K slices where `splitk` takes them, and one launch (`moe_shared.join_shared`) adds
those and the routed outputs up and applies the gate; a one-token step runs it after
`moe_one_token`'s launches.

Tensor parallelism shards every expert's intermediate dimension: rank r holds rows
[r * inter / size, (r + 1) * inter / size) of each expert's gate and up projections and those
columns of its down projection; the router is replicated, and the partial outputs are
all-reduced, as after a dense MLP. The shared expert is sliced as a dense MLP (its gate
replicated) and joins the routed sum before that all-reduce.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from tandem.config import ModelConfig
from tandem.model import fused, splitk
from tandem.model.decoder import MLP
from tandem.model.fused_moe import block_m_for, expert_outputs, fused_experts_torch
from tandem.model.moe_one_token import norm_and_router, routed_expert_outputs
from tandem.model.moe_routing import fused_topk_align, route
from tandem.model.moe_shared import join_shared
from tandem.parallel import TensorParallel


class Experts(nn.Module):
    """Every expert's weights stacked: one tensor per projection."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        # [experts, 2 * inter, hidden]: gate rows, then up rows
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size)
        )
        # [experts, hidden, inter]
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.hidden_act = cfg.hidden_act
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # the router
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_expert = self.shared_expert_gate = None
        if shared := cfg.shared_expert_intermediate_size:  # Qwen2-MoE: a dense MLP of its own
            self.shared_expert = MLP(replace(cfg, intermediate_size=shared), tp)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)  # [1, hidden]

    def shared(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert's share of the output, [tokens, hidden] (this rank's part, before
        the block's one all-reduce)."""
        mlp = self.shared_expert
        return torch.sigmoid(self.shared_expert_gate(x)) * mlp.down_proj(mlp.activated(x))

    def joined(self, routed: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The block's output with the shared expert, [tokens, hidden], from the routed
        experts' weighted outputs [tokens, top_k, hidden] (Triton kernels: one launch after
        the shared expert's products; this rank's part, before the all-reduce)."""
        mlp = self.shared_expert
        activated = mlp.activated(x)
        if type(mlp.down_proj) is nn.Linear and splitk.ENABLED:
            down = splitk.residual_product(activated, mlp.down_proj.weight, mlp.down_proj)
        else:
            down = mlp.down_proj(activated)
        return join_shared(routed, down, x, self.shared_expert_gate.weight)

    def after_attention(
        self, attended: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module
    ) -> torch.Tensor | None:
        """The layer's residual add + RMSNorm after its attention (`norm`, the layer's
        post-attention RMSNorm), then this block, where that is fewer launches: at one token on
        one device with the Triton kernels (`moe_one_token`: the norm inside the router's
        launch). The block's output as `forward` gives it, the residual stream advanced in place
        as the norm advances it; elsewhere None, and the layer norms, then calls the block."""
        hidden, experts = self.gate.weight.shape[1], self.gate.weight.shape[0]
        one_token = residual is not None and residual.shape[0] == 1 and self.tp.size == 1
        if not (one_token and self.hidden_act == "silu" and fused.use_kernels(residual)):
            return None
        if not splitk.ENABLED or splitk.plan(1, experts, hidden, residual.device) is None:
            return None
        normed, summed, logits = norm_and_router(
            attended, residual, norm.weight, norm.eps, self.gate.weight
        )
        w13, w2 = self.experts.gate_up_proj, self.experts.down_proj
        pairs = routed_expert_outputs(
            normed, w13, w2, logits, self.top_k, self.renormalize, summed, residual
        )  # [1, top_k, hidden]
        if self.shared_expert is not None:
            return self.joined(pairs, normed)
        return pairs.transpose(0, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[tokens, hidden] -> [tokens, hidden] in x's dtype; on one device with the Triton
        kernels, [top_k, tokens, hidden] partials whose sum is that (for the next norm)."""
        w13, w2 = self.experts.gate_up_proj, self.experts.down_proj
        if not fused.use_kernels(x):
            weights, ids = route(F.linear(x, self.gate.weight), self.top_k, self.renormalize)
            out = fused_experts_torch(x, w13, w2, weights, ids, self.hidden_act)
            if self.shared_expert is not None:
                out = out + self.shared(x)
            return self.tp.all_reduce(out)
        # at decode sizes float32 slices [splits, tokens, experts] of the router's product,
        # which the routing adds up as it reads them; past them [tokens, experts] (F.linear)
        router = splitk.linear_partials if splitk.ENABLED else F.linear
        router_logits = router(x, self.gate.weight)
        if x.shape[0] == 1 and self.hidden_act == "silu":  # the routing inside GEMM 1
            pairs = routed_expert_outputs(
                x, w13, w2, router_logits, self.top_k, self.renormalize
            )  # [1, top_k, hidden]
        else:
            block_m = block_m_for(x.shape[0] * self.top_k, w13.shape[0])
            weights, _, blocks = fused_topk_align(
                router_logits, self.top_k, self.renormalize, block_m, x.dtype
            )
            # [tokens, top_k, hidden]
            pairs = expert_outputs(x, w13, w2, weights, blocks, block_m, self.hidden_act)
        if self.shared_expert is not None:
            return self.tp.all_reduce(self.joined(pairs, x))
        if self.tp.size == 1:
            return pairs.transpose(0, 1)
        return self.tp.all_reduce(pairs.sum(1))  # no atomics: deterministic
