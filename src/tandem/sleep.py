"""Sleep mode: the device memory of the weights and the KV cache given back, and taken again.

The tensors stay the same Python objects (the model, the runner and the pieces keep their
references): only their storage is resized to nothing and back. Level 1 first copies the
weights to host memory (pinned on CUDA) and copies them back on wake-up; level 2 drops them,
for a caller that sends new ones with `update_weights`. A re-allocated storage may land at
another device address, so the engine frees its captured CUDA graphs before sleeping and
captures them again on wake-up (docs/ARCHITECTURE.md, "Sleep mode", says why not cuMem).
"""

from __future__ import annotations

import torch

LEVELS = (1, 2)


class DeviceMemory:
    """The storages one engine can give back: its weights and its KV cache."""

    def __init__(self, weights: list[torch.Tensor], kv_cache: torch.Tensor):
        self.weights = weights
        self.kv_cache = kv_cache  # a view of the one cache tensor every layer's cache views
        self.weight_bytes = [w.untyped_storage().nbytes() for w in weights]
        self.kv_bytes = kv_cache.untyped_storage().nbytes()
        self.host_weights: list[torch.Tensor] | None = None  # level 1 while asleep
        self.level: int | None = None  # while asleep

    def sleep(self, level: int) -> int:
        """Give the memory back; returns the bytes freed on the device."""
        assert self.level is None, "already asleep"
        if level == 1:
            pin = self.kv_cache.is_cuda
            self.host_weights = [to_host(w, pin) for w in self.weights]
        if self.kv_cache.is_cuda:
            torch.cuda.synchronize(self.kv_cache.device)  # the host copies have landed
        for w in self.weights:
            w.untyped_storage().resize_(0)
        self.kv_cache.untyped_storage().resize_(0)
        self.level = level
        return sum(self.weight_bytes) + self.kv_bytes

    def wake_up(self) -> None:
        """Storages back at their sizes: the level-1 weights copied back, the KV cache zeroed;
        after level 2 the weights hold garbage until `update_weights` fills them."""
        assert self.level is not None, "not asleep"
        for w, nbytes in zip(self.weights, self.weight_bytes, strict=True):
            w.untyped_storage().resize_(nbytes)
        if self.host_weights is not None:
            for w, host in zip(self.weights, self.host_weights, strict=True):
                w.copy_(host, non_blocking=True)
        self.kv_cache.untyped_storage().resize_(self.kv_bytes)
        self.kv_cache.untyped_storage().fill_(0)
        if self.kv_cache.is_cuda:
            torch.cuda.synchronize(self.kv_cache.device)  # before the pinned copies are freed
        self.host_weights, self.level = None, None


def to_host(tensor: torch.Tensor, pin: bool) -> torch.Tensor:
    host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
    return host.copy_(tensor, non_blocking=pin)
