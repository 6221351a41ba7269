"""In-place weight updates: checkpoint tensors copied into the parameters the graphs read.

An update is planned whole before anything is copied: every name is mapped to its slice of our
(stacked, sharded) parameters and every shape checked, so a bad tensor leaves the model as it
was. The copies then go into the existing storage, so captured CUDA graphs stay valid.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from tandem.config import ModelConfig
from tandem.model import hf_names
from tandem.model.decoder import Decoder
from tandem.model.loader import destination, iter_safetensors
from tandem.parallel import TensorParallel, shard_tensor
from tandem.quant.int4 import Int4Linear
from tandem.quant.linear import Fp8Linear

NamedTensors = Iterable[tuple[str, torch.Tensor]]


def check_named_tensors(named_tensors: NamedTensors) -> list[tuple[str, torch.Tensor]]:
    """The pairs as a list; TypeError naming the first one that is not (str, floating tensor)."""
    if isinstance(named_tensors, dict):
        named_tensors = named_tensors.items()
    if not isinstance(named_tensors, Iterable) or isinstance(named_tensors, str | bytes):
        raise TypeError(
            "named_tensors must be a dict or an iterable of (name, tensor) pairs, "
            f"got {type(named_tensors).__name__}"
        )
    pairs = []
    for index, item in enumerate(named_tensors):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise TypeError(
                f"named_tensors[{index}] must be a (name, tensor) pair, got {item!r:.80}"
            )
        name, tensor = item
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            raise TypeError(f"weight {name!r} must be a floating-point torch.Tensor")
        pairs.append((name, tensor))
    return pairs


def plan_update(
    model: Decoder, cfg: ModelConfig, tp: TensorParallel, pairs: list[tuple[str, torch.Tensor]]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(destination view, this rank's source slice) per tensor; ValueError naming the first
    unknown name or mismatched shape. `cfg` is the whole model's shape."""
    if any(isinstance(module, Fp8Linear) for module in model.modules()):
        raise ValueError(
            "update_weights does not re-quantize FP8 layers yet; load the new weights with a "
            "fresh LLM(..., quantization='fp8')"
        )
    if any(isinstance(module, Int4Linear) for module in model.modules()):
        raise ValueError(
            "update_weights takes weights in the model dtype; this model's layers hold int4 "
            "codes (a GPTQ, AWQ or compressed-tensors checkpoint): load a new checkpoint instead"
        )
    params = dict(model.named_parameters())
    copies = []
    # under the loader's names, as a checkpoint is loaded (Mixtral's experts, Phi-3's fused
    # matrices split, Gemma's norms stored as 1 + w)
    for name, tensor in hf_names.normalized(pairs, cfg):
        source = shard_tensor(name, tensor, cfg, tp)
        found = destination(model, params, name, source)
        if found is not None:
            copies.append((found[1], found[2]))
    return copies


def apply_update(
    copies: list[tuple[torch.Tensor, torch.Tensor]],
    stream: torch.cuda.Stream | None,
    synchronize: bool = True,
) -> None:
    """Copy on `stream` (the compute stream on CUDA: after every step launched before, before
    every step launched after); returns once the copies are done, so the caller may free its
    tensors, unless `synchronize` is False (the caller then keeps them until `stream` has
    run the copies)."""
    if stream is None:
        for dest, source in copies:
            dest.copy_(source)
        return
    stream.wait_stream(torch.cuda.current_stream(stream.device))  # the caller's producers
    with torch.cuda.stream(stream):
        for dest, source in copies:
            dest.copy_(source, non_blocking=True)
    if synchronize:
        stream.synchronize()


def read_checkpoint(path: str | Path) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of a checkpoint folder's safetensors files."""
    if not isinstance(path, str | Path) or not str(path):
        raise ValueError(f"a checkpoint folder's path is a non-empty string, got {path!r}")
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a checkpoint folder")
    return list(iter_safetensors(folder))
