"""Weights from a trainer in another process, taken as vLLM's weight-transfer engines take them.

`LLM(..., weight_transfer_config={"backend": ...})`, then vLLM's calls:
`init_weight_transfer_engine({"init_info": ...})`, `start_weight_update()`,
`update_weights({"update_info": ...})` (any number of times), `finish_weight_update()`. Each
`update_info` names the tensors that come (names, dtype names, shapes), and every name and shape
is checked against the model before a byte is copied: a bad one leaves the weights as they were
(after the tensors announced have been taken and dropped, so the trainer is not left waiting).
Between start and finish the engine takes no step, so no step reads a half-sent model.

- "nccl" (nccl.py): the trainer and every tensor-parallel rank join a process group of their own
  (NCCL on CUDA, gloo on CPU) and the trainer broadcasts the tensors, one by one or packed into
  byte buffers.
- "ipc" (ipc.py): a trainer on the engine's own GPU hands over CUDA IPC handles of its tensors.

The trainer's side keeps vLLM's class and method names (`NCCLWeightTransferEngine.trainer_init`
and `.trainer_send_weights`, `IPCWeightTransferEngine.trainer_send_weights`), so a trainer
switches by its imports.
"""

from __future__ import annotations

import torch

from tandem.weight_transfer.common import (
    WeightReceiver,
    WeightTransferConfig,
    as_config,
    request_field,
    required_field,
    update_info_for,
)
from tandem.weight_transfer.ipc import (
    IPCReceiver,
    IPCTrainerSendWeightsArgs,
    IPCWeightTransferEngine,
    IPCWeightTransferUpdateInfo,
)
from tandem.weight_transfer.nccl import (
    NCCLReceiver,
    NCCLTrainerSendWeightsArgs,
    NCCLWeightTransferEngine,
    NCCLWeightTransferInitInfo,
    NCCLWeightTransferUpdateInfo,
)

__all__ = [
    "IPCTrainerSendWeightsArgs",
    "IPCWeightTransferEngine",
    "IPCWeightTransferUpdateInfo",
    "NCCLTrainerSendWeightsArgs",
    "NCCLWeightTransferEngine",
    "NCCLWeightTransferInitInfo",
    "NCCLWeightTransferUpdateInfo",
    "WeightReceiver",
    "WeightTransferConfig",
    "as_config",
    "make_receiver",
    "request_field",
    "required_field",
    "update_info_for",
]


def make_receiver(
    config: WeightTransferConfig, device: torch.device, rank: int, tp_size: int
) -> WeightReceiver:
    """Tensor-parallel rank `rank`'s end of the backend `config` names."""
    receiver = IPCReceiver if config.backend == "ipc" else NCCLReceiver
    return receiver(config, device, rank, tp_size)
