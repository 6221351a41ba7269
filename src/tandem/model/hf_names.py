"""Checkpoint tensors of every architecture under the one set of Hugging Face names the loader
knows (Llama's, plus per-expert `mlp.experts.{j}.{gate,up,down}_proj`), before sharding.

- Mixtral: `block_sparse_moe` -> `mlp`, experts' w1, w3, w2 -> gate_proj, up_proj, down_proj.
- Phi-3 (and GLM-4's `gate_up_proj`): fused `qkv_proj` and `gate_up_proj` split into q/k/v and
  gate/up (so that tensor parallelism slices each part as for Llama, and the loader stacks them
  back).
- GLM-4: its sandwich norms under Gemma's layer's names (`GLM4_NORMS`).
- Gemma: norm weights w stored as 1 + w (Gemma's RMSNorm multiplies by 1 + w).
- Partial or interleaved rotary (Phi-4-mini, GLM-4): q and k rows of each head reordered
  (`rope.rotary_order`), so that the rotary table rotates its pairs as halves and leaves the
  other dimensions as they are.
- Granite: the o and down projections times residual_multiplier (what each sublayer adds).
- Expert weights fused per layer, as transformers 5 saves them (`mlp.experts.gate_up_proj`
  [experts, 2 * inter, hidden], `mlp.experts.down_proj`), split per expert.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from tandem.config import GEMMA, ModelConfig
from tandem.model.gemma import GEMMA_NORMS
from tandem.model.rope import rotary_rows

MIXTRAL_EXPERTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# checkpoints that store q/k/v or gate/up as one matrix (GLM-4: gate_up_proj alone)
FUSED_CHECKPOINTS = ("Phi3ForCausalLM", "Glm4ForCausalLM")
# GLM-4's norms around its sublayers -> gemma.GemmaDecoderLayer's names
GLM4_NORMS = {
    "post_self_attn_layernorm": "post_attention_layernorm",
    "post_attention_layernorm": "pre_feedforward_layernorm",
    "post_mlp_layernorm": "post_feedforward_layernorm",
}
# (layer prefix, expert, projection) of a per-expert tensor name
EXPERT_NAME = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def normalized(
    tensors: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a checkpoint -> the same weights under the loader's names (and,
    with partial rotary, q and k in the order that rotates as a full-width table)."""
    return ((name, output_rows(name, tensor, cfg)) for name, tensor in renamed(tensors, cfg))


def output_rows(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """A tensor whose rows are a projection's outputs (its weight, bias or scales; a LoRA
    adapter's B), as the model keeps them: q and k heads reordered for partial rotary
    (`rope.rotary_rows`), the o and down projections times Granite's residual_multiplier
    (FP8 and int4 codes and zero points keep their values: their scales carry it; activation
    scales do not)."""
    tensor = rotary_rows(name, tensor, cfg)
    module, _, kind = name.rpartition(".")
    scaled = module.rpartition(".")[2] in ("o_proj", "down_proj") and kind != "input_scale"
    codes = not tensor.is_floating_point() or tensor.dtype.itemsize == 1
    if cfg.residual_multiplier is None or not scaled or codes:
        return tensor
    return tensor * cfg.residual_multiplier


def renamed(
    tensors: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    gemma = cfg.architecture in GEMMA
    for name, tensor in tensors:
        if cfg.architecture == "MixtralForCausalLM":
            name = mixtral_name(name)
        module, _, kind = name.rpartition(".")
        leaf = module.rpartition(".")[2]
        if cfg.architecture in FUSED_CHECKPOINTS and leaf in ("qkv_proj", "gate_up_proj"):
            yield from split_fused(module, kind, tensor, cfg)
        elif cfg.architecture == "Glm4ForCausalLM" and leaf in GLM4_NORMS:
            yield f"{module.rpartition('.')[0]}.{GLM4_NORMS[leaf]}.{kind}", tensor
        elif leaf == "experts" and kind in ("gate_up_proj", "down_proj"):
            yield from split_experts(module, kind, tensor)
        elif gemma and leaf in GEMMA_NORMS:
            yield name, tensor.float() + 1.0
        else:
            yield name, tensor


def mixtral_name(name: str) -> str:
    """model.layers.0.block_sparse_moe.experts.3.w1.weight -> model.layers.0.mlp.experts.3.gate_proj.weight"""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    parts = name.split(".")
    if len(parts) >= 3 and parts[-3].isdigit() and parts[-2] in MIXTRAL_EXPERTS:
        parts[-2] = MIXTRAL_EXPERTS[parts[-2]]
    return ".".join(parts)


def split_fused(
    module: str, kind: str, tensor: torch.Tensor, cfg: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    parent, _, leaf = module.rpartition(".")
    if leaf == "qkv_proj":
        names, sizes = ("q_proj", "k_proj", "v_proj"), [cfg.q_size, cfg.kv_size, cfg.kv_size]
    else:
        names, sizes = ("gate_proj", "up_proj"), [cfg.intermediate_size] * 2
    if tensor.numel() == 1:  # a per-tensor scale (FP8's weight or input scale): each part's
        for part in names:
            yield f"{parent}.{part}.{kind}", tensor
        return
    if tensor.shape[0] != sum(sizes):
        raise ValueError(
            f"checkpoint tensor {module}.{kind!r} has {tensor.shape[0]} rows, expected {sum(sizes)}"
        )
    for part, piece in zip(names, tensor.split(sizes), strict=True):
        yield f"{parent}.{part}.{kind}", piece


def split_experts(
    module: str, kind: str, tensor: torch.Tensor
) -> Iterator[tuple[str, torch.Tensor]]:
    for expert, weight in enumerate(tensor):
        if kind == "down_proj":
            yield f"{module}.{expert}.down_proj.weight", weight
        else:
            gate, up = weight.chunk(2, dim=0)
            yield f"{module}.{expert}.gate_proj.weight", gate
            yield f"{module}.{expert}.up_proj.weight", up


def expert_destination(
    name: str, params: dict[str, torch.nn.Parameter], inter: int
) -> tuple[torch.Tensor, str] | None:
    """(where a per-expert tensor goes, its loaded key) or None for a name of no expert.
    `inter`: this rank's intermediate size of each expert."""
    match = EXPERT_NAME.fullmatch(name)
    if match is None:
        return None
    prefix, expert, projection = match.group(1), int(match.group(2)), match.group(3)
    if f"{prefix}.down_proj" not in params or expert >= len(params[f"{prefix}.down_proj"]):
        return None  # no such expert there: the loader names the tensor as having no place
    if projection == "down_proj":
        return params[f"{prefix}.down_proj"].data[expert], f"{prefix}.down_proj#{expert}"
    part = 0 if projection == "gate_proj" else 1
    dest = params[f"{prefix}.gate_up_proj"].data[expert].narrow(0, part * inter, inter)
    return dest, f"{prefix}.gate_up_proj#{expert}.{part}"


def expected_expert_keys(name: str, param: torch.Tensor) -> list[str] | None:
    """The loaded keys that cover an experts parameter; None for another parameter."""
    if name.endswith("experts.gate_up_proj"):
        return [f"{name}#{e}.{part}" for e in range(param.shape[0]) for part in (0, 1)]
    if name.endswith("experts.down_proj"):
        return [f"{name}#{e}" for e in range(param.shape[0])]
    return None


def expert_checkpoint_name(key: str) -> str:
    """'layers.0.mlp.experts.gate_up_proj#3.1' -> 'model.layers.0.mlp.experts.3.up_proj.weight'."""
    name, _, slot = key.partition("#")
    prefix, _, param = name.rpartition(".")
    expert, _, part = slot.partition(".")
    projection = "down_proj" if param == "down_proj" else ("gate_proj", "up_proj")[int(part)]
    return f"model.{prefix}.{expert}.{projection}.weight"
