"""LoRA on the decoder's projections: every adapter slot's A and B stacked, rows picking theirs.

Per projection, for `slots` adapters of rank up to `rank` and `lanes` checkpoint matrices (q, k
and v in qkv_proj; gate and up in gate_up_proj; one in o_proj and down_proj):

    h = x @ A^T      # [tokens, lanes * slots * rank]
    h *= mask        # a token keeps its slot's rank columns alone (none: the base model's row)
    y += h @ B^T     # B: [out, lanes * slots * rank], each adapter's scale folded in

Lane i's columns of B are non-zero only in the rows of matrix i, so two products serve every
matrix and every slot of a step at once. The mask ([tokens, slots * rank]) is made at the start
of each forward from the tokens' slots (`select`), inside the step's graphs: a step with any mix
of adapters replays the same graphs. A step whose rows name no adapter leaves the products
out (`LoRALayers.active`; decode graphs are captured both ways). A row-parallel projection
(o, down) under tensor parallelism adds its delta to its partial sums before their all-reduce:
the delta is linear in the rank's input columns too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.lora.adapters import PROJECTIONS, Adapter, ProjectionShape


class LoRAProjection:
    """One projection's A and B for every slot (see the module docstring)."""

    def __init__(
        self,
        layers: LoRALayers,
        linear: nn.Linear,
        lane_rows: tuple[int, ...],
        slots: int,
        rank: int,
    ):
        self.layers = layers  # holds the step's mask
        self.lanes, self.slots, self.rank = len(lane_rows), slots, rank
        self.shape = ProjectionShape(linear.in_features, lane_rows)
        width = self.lanes * slots * rank
        weight = linear.weight
        # [lanes * slots * rank, in] and [out, lanes * slots * rank], in the model dtype
        self.a = torch.zeros(width, linear.in_features, dtype=weight.dtype, device=weight.device)
        self.b = torch.zeros(linear.out_features, width, dtype=weight.dtype, device=weight.device)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y + this step's LoRA delta of x ([rows, in]; y [rows, out]); y alone in a step
        whose rows name no adapter (`LoRALayers.active`)."""
        if not self.layers.active:
            return y
        h = F.linear(x, self.a)
        rows = h.shape[0]
        h.view(rows, self.lanes, -1).mul_(self.layers.mask[:rows, None])
        return torch.addmm(y, h, self.b.t())

    def load(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Slot `slot` takes an adapter's blocks: a [lanes, rank, in], b [out, lanes, rank]."""
        lanes, slots, rank = self.lanes, self.slots, self.rank
        self.a.view(lanes, slots, rank, -1)[:, slot].copy_(a, non_blocking=True)
        self.b.view(-1, lanes, slots, rank)[:, :, slot].copy_(b, non_blocking=True)


class LoRALayers:
    """The LoRA state of a model: each projection's `LoRAProjection` (as `linear.lora`) and the
    step's mask."""

    def __init__(self, model: nn.Module, slots: int, rank: int, max_tokens: int):
        from tandem.model.loader import stacked_sizes  # it imports the decoder, which imports us

        if any(type(layer.self_attn.qkv_proj) is not nn.Linear for layer in model.layers):
            raise ValueError(
                "LoRA adapters run on bfloat16/float16/float32 weights, not FP8 or int4 ones"
            )
        weight = model.embed_tokens.weight
        # [max_tokens, slots * rank] in the model dtype: 1 where a token's slot owns the column
        self.mask = torch.zeros(max_tokens, slots * rank, dtype=weight.dtype, device=weight.device)
        # [slots * rank] int32: the slot of each column
        self.column_slot = torch.arange(slots * rank, device=weight.device, dtype=torch.int32)
        self.column_slot //= rank
        # False: the step's rows name no adapter, so the products are left out (the runner sets
        # it per step, and captures a decode graph of each kind)
        self.active = True
        self.projections: dict[tuple[int, str], LoRAProjection] = {}
        for index, layer in enumerate(model.layers):
            parents = {"qkv_proj": layer.self_attn, "o_proj": layer.self_attn}
            if hasattr(layer.mlp, "gate_up_proj"):  # a dense MLP (not a MoE block)
                parents.update(gate_up_proj=layer.mlp, down_proj=layer.mlp)
            for name, parent in parents.items():
                linear = getattr(parent, name)
                sizes = stacked_sizes(model).get(name)  # a dense MLP's
                lane_rows = tuple(sizes) if sizes else (linear.out_features,)
                assert len(lane_rows) == PROJECTIONS[name]
                linear.lora = LoRAProjection(self, linear, lane_rows, slots, rank)
                self.projections[(index, name)] = linear.lora

    def shapes(self) -> dict[int, dict[str, ProjectionShape]]:
        """layer -> projection -> its shape on this rank: what an adapter is read into."""
        shapes: dict[int, dict[str, ProjectionShape]] = {}
        for (layer, name), projection in self.projections.items():
            shapes.setdefault(layer, {})[name] = projection.shape
        return shapes

    def select(self, token_slots: torch.Tensor) -> None:
        """This step's mask from each token's slot ([tokens] int32, -1: no adapter)."""
        self.mask[: len(token_slots)].copy_(token_slots[:, None] == self.column_slot)

    def load(self, slot: int, adapter: Adapter) -> None:
        """The adapter's weights into `slot` (on the current stream; every projection written,
        those the adapter leaves out with zeros)."""
        for key, projection in self.projections.items():
            projection.load(slot, *adapter.weights[key])


def with_lora(linear: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """y, the projection's output of x, plus its LoRA delta where adapters are on."""
    lora = vars(linear).get("lora")  # set by LoRALayers (a miss of getattr would raise inside)
    return y if lora is None else lora.add(x, y)
