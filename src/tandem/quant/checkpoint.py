"""Quantized checkpoints: which scheme a config.json asks for (`weight_scheme`: FP8 here, int4
in `int4`), and how FP8 tensors map onto `Fp8Linear`'s [out, in] e4m3 weight and [out, groups]
float32 scales.

Two checkpoint formats (`quantization_config.quant_method`):
- "compressed-tensors", format "float-quantized": `weight` e4m3 and `weight_scale` float32, per
  tensor ([] or [1]), per channel ([out, 1]) or per block ([out / rows, in / cols] for a
  `block_structure` [rows, cols]); activations per token, dynamic (a static `input_scale` is
  read past: activations are always quantized per token here).
- "fp8" (DeepSeek-V3, Qwen3-FP8): `weight` e4m3 and `weight_scale_inv` float32 per block of
  `weight_block_size` (128 x 128), the factor that dequantizes (w = q * weight_scale_inv).
`quantization="fp8"` on a checkpoint without a quantization_config quantizes each linear
weight at load, one scale per output channel.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tandem.config import INT4_QUANTIZATIONS, cdiv
from tandem.quant import int4
from tandem.quant.fp8 import FP8_DTYPE, quantize_rows
from tandem.quant.int4 import Int4Config

logger = logging.getLogger(__name__)

LINEAR_LEAVES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
METHODS = ("awq", "compressed-tensors", "fp8", "gptq")  # quant_method values read
STRATEGIES = ("tensor", "channel", "block")
# an FP8 KV cache's scales by the names checkpoints give them -> the scales they set (vLLM
# reads the same: llm-compressor's, its older projections' output scales, AutoFP8's one kv_scale)
KV_SCALES = {
    "self_attn.k_scale": ("k_scale",),
    "self_attn.v_scale": ("v_scale",),
    "self_attn.k_proj.output_scale": ("k_scale",),
    "self_attn.v_proj.output_scale": ("v_scale",),
    "self_attn.kv_scale": ("k_scale", "v_scale"),
}


@dataclass(frozen=True)
class Fp8Config:
    """The FP8 scheme of the decoder's linear layers (embeddings, norms and LM head stay in the
    model dtype)."""

    quantize_at_load: bool  # the checkpoint has high-precision weights: quantized per channel
    strategy: str  # of the checkpoint's weight scales: "tensor", "channel" or "block"
    block: tuple[int, int] | None = None  # (rows, cols) of a block scale

    @property
    def group_size(self) -> int | None:
        """Input columns per scale in `Fp8Linear` (None: one scale per row)."""
        return None if self.block is None else self.block[1]


def weight_scheme(
    hf_config: dict[str, Any],
    quantization: str | None,
    load_format: str,
    folder: Path | None = None,
) -> Fp8Config | Int4Config | None:
    """How the decoder's linear layers hold their weights: FP8 (`fp8_config`), int4
    (`int4.int4_config`) or None (the model dtype). A `quantization` naming another method
    than the checkpoint's is a ValueError; on random weights (`load_format="dummy"`) it
    picks the scheme they are quantized into at load. Older GPTQ and AWQ checkpoints keep
    their settings in a file of their own beside config.json (`int4.separate_config`)."""
    wanted = INT4_QUANTIZATIONS.get(quantization, quantization)
    qc = hf_config.get("quantization_config") or int4.separate_config(folder, wanted)
    if qc is not None and wanted is not None and qc.get("quant_method") != wanted:
        raise ValueError(
            f"quantization={quantization!r} does not match the checkpoint's "
            f"quantization_config.quant_method {qc.get('quant_method')!r}"
        )
    scheme = None if qc is None else int4.int4_config(qc)
    asked = qc is None and quantization in INT4_QUANTIZATIONS  # int4 without an int4 checkpoint
    if asked and load_format != "dummy":
        raise ValueError(
            f"quantization={quantization!r} needs a checkpoint quantized that way (its "
            "config.json's quantization_config); 4-bit weights are not made at load"
        )
    if scheme is not None or asked:
        return int4.dummy_config() if load_format == "dummy" else scheme
    fp8 = fp8_config(hf_config, quantization)
    if fp8 is not None and load_format == "dummy":  # random weights, quantized here per channel
        fp8 = Fp8Config(quantize_at_load=True, strategy="channel")
    return fp8


def fp8_config(hf_config: dict[str, Any], quantization: str | None) -> Fp8Config | None:
    """The FP8 scheme of a checkpoint's config.json, or of `quantization="fp8"` on a
    checkpoint without one; None: no FP8 weights. Raises ValueError naming what is not
    supported."""
    qc = hf_config.get("quantization_config")
    if qc is None:
        return Fp8Config(True, "channel") if quantization == "fp8" else None
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "fp8":
        return _fp8_method(qc)
    raise ValueError(
        f"quantization_config.quant_method {method!r} in config.json is not supported; "
        f"supported: {', '.join(repr(m) for m in METHODS)}"
    )


def _compressed_tensors(qc: dict[str, Any]) -> Fp8Config:
    groups = list((qc.get("config_groups") or {}).values())
    if not groups:
        raise ValueError("quantization_config.config_groups is empty in config.json")
    schemes = set()
    for group in groups:
        fmt = group.get("format") or qc.get("format")
        if fmt != "float-quantized":
            raise ValueError(
                f"compressed-tensors format {fmt!r} is not supported; supported: "
                "'float-quantized' (FP8 e4m3), 'pack-quantized' (int4)"
            )
        weights = group.get("weights") or {}
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise ValueError(
                f"compressed-tensors weights {weights!r}: only 8-bit float (e4m3) is supported"
            )
        strategy = weights.get("strategy")
        if strategy not in STRATEGIES:
            raise ValueError(
                f"compressed-tensors weight strategy {strategy!r} is not supported; "
                f"supported: {', '.join(repr(s) for s in STRATEGIES)}"
            )
        inputs = group.get("input_activations")
        if inputs is not None and (inputs.get("type") != "float" or inputs.get("num_bits") != 8):
            raise ValueError(
                f"compressed-tensors input_activations {inputs!r}: only 8-bit float is supported"
            )
        block = weights.get("block_structure") if strategy == "block" else None
        schemes.add((strategy, _block(block, "block_structure") if strategy == "block" else None))
    if len(schemes) > 1:
        raise ValueError(
            f"compressed-tensors config_groups with different weight schemes {sorted(schemes)}; "
            "one FP8 scheme for every linear layer is supported"
        )
    strategy, block = schemes.pop()
    return Fp8Config(False, strategy, block)


def _fp8_method(qc: dict[str, Any]) -> Fp8Config:
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"fp8 quantization_config fmt {qc['fmt']!r}: only 'e4m3' is supported")
    block = qc.get("weight_block_size")
    if block is None:
        return Fp8Config(False, "tensor")
    return Fp8Config(False, "block", _block(block, "weight_block_size"))


def _block(block: Any, field: str) -> tuple[int, int]:
    if not (isinstance(block, list | tuple) and len(block) == 2 and all(
        isinstance(b, int) and b > 0 for b in block
    )):  # fmt: skip
        raise ValueError(f"quantization_config.{field} must be two positive ints, got {block!r}")
    return block[0], block[1]


MOE_MODULES = {"experts", "shared_expert", "shared_experts"}  # stay in the model dtype


def is_linear_weight(hf_name: str) -> bool:
    """Whether a checkpoint tensor is the weight of a quantized projection: a decoder layer's
    attention or dense MLP, not a MoE expert's (`Decoder`)."""
    module, _, kind = hf_name.rpartition(".")
    parts = module.split(".")
    return kind == "weight" and parts[-1] in LINEAR_LEAVES and not MOE_MODULES & set(parts)


def checkpoint_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]],
    fp8: Fp8Config | Int4Config | None,
    kv_scales: dict[str, tuple[float, ...]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors under the names `load_weights` places: with `fp8`, FP8 weights
    and their `weight_scale` (quantized here when `fp8.quantize_at_load`), static input scales
    dropped; int4 ones in `Int4Linear`'s layout (`int4.checkpoint_tensors`); KV cache scales
    are taken out into `kv_scales` (name -> its distinct values)."""
    tensors = _kv_scales_out(tensors, kv_scales)
    if fp8 is None:
        yield from tensors
        return
    if isinstance(fp8, Int4Config):
        yield from int4.checkpoint_tensors(tensors, fp8)
        return
    dropped = 0
    for name, tensor in tensors:
        if name.endswith(".input_scale"):
            dropped += 1
        elif fp8.quantize_at_load and is_linear_weight(name) and tensor.dtype != FP8_DTYPE:
            weight, scale = quantize_rows(tensor)
            yield name, weight
            yield f"{name}_scale", scale
        else:
            yield name.removesuffix("_inv") if name.endswith(".weight_scale_inv") else name, tensor
    if dropped:
        logger.warning(
            "%d static input_scale tensors not used: activations are quantized per token", dropped
        )


def _kv_scales_out(
    tensors: Iterable[tuple[str, torch.Tensor]], kv_scales: dict[str, tuple[float, ...]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each KV cache scale's distinct values as
    `kv_scales["model.layers.{i}.self_attn.{k,v}_scale"]` (several: one per head)."""
    for name, tensor in tensors:
        known = next((n for n in KV_SCALES if name.endswith(f".{n}")), None)
        if known is None:
            yield name, tensor
            continue
        values = tuple(tensor.float().reshape(-1).unique().tolist())
        attention = name.removesuffix(known) + "self_attn"
        for scale in KV_SCALES[known]:
            kv_scales[f"{attention}.{scale}"] = values


def fit_tensor(
    hf_name: str, tensor: torch.Tensor, dest: torch.Tensor, fp8: Fp8Config
) -> torch.Tensor:
    """A checkpoint tensor in the layout of its place `dest` (a weight_scale [rows, groups] from
    the checkpoint's scale layout); ValueError where the checkpoint and the scheme disagree."""
    if (tensor.dtype == FP8_DTYPE) != (dest.dtype == FP8_DTYPE):
        raise ValueError(
            f"checkpoint tensor {hf_name!r} is {tensor.dtype} where {dest.dtype} is expected: "
            "FP8 checkpoints must quantize every linear layer of the decoder and nothing else"
        )
    if not hf_name.endswith(".weight_scale"):
        return tensor
    rows, groups = dest.shape
    if fp8.strategy == "block":
        accepted = [(cdiv(rows, fp8.block[0]), groups)]
    elif fp8.strategy == "channel":
        accepted = [(rows, 1), (rows,)]
    else:
        accepted = [(), (1,)]
    if tuple(tensor.shape) not in accepted:
        raise ValueError(
            f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}; a {fp8.strategy} "
            f"scale of this {rows}-row weight has shape {accepted[0]}"
        )
    if fp8.strategy == "block":  # each block's scale for each of its rows
        return tensor.repeat_interleave(fp8.block[0], dim=0)[:rows]
    return tensor.reshape(-1, 1).expand(rows, 1)
