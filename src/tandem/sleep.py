"""Sleep mode: the device memory of the weights and the KV cache given back, and taken again.

The tensors stay the same Python objects (the model, the runner and the pieces keep their
references): only their storage is resized to nothing and back. Level 1 first copies the
weights to host memory (pinned on CUDA) and copies them back on wake-up; level 2 drops them,
for a caller that sends new ones with `update_weights`. A re-allocated storage may land at
another device address, so the engine frees its captured CUDA graphs before sleeping and
captures them again on wake-up (docs/ARCHITECTURE.md, "Sleep mode", says why not cuMem).
The two parts wake together or one at a time (vLLM's tags), the weights first for a trainer
that sends new ones before the cache takes its memory.
"""

from __future__ import annotations

import torch

LEVELS = (1, 2)
PARTS = ("weights", "kv_cache")  # what wake_up's tags name


class DeviceMemory:
    """The storages one engine can give back: its weights and its KV cache."""

    def __init__(self, weights: list[torch.Tensor], kv_cache: torch.Tensor):
        self.weights = weights
        self.kv_cache = kv_cache  # a view of the one cache tensor every layer's cache views
        self.weight_bytes = [w.untyped_storage().nbytes() for w in weights]
        self.kv_bytes = kv_cache.untyped_storage().nbytes()
        self.host_weights: list[torch.Tensor] | None = None  # level 1 while the weights sleep
        self.level: int | None = None  # while asleep
        self.asleep: set[str] = set()  # the parts with no device memory: PARTS, then fewer

    def sleep(self, level: int) -> int:
        """Give the memory back; returns the bytes freed on the device."""
        assert not self.asleep, "already asleep"
        if level == 1:
            pin = self.kv_cache.is_cuda
            self.host_weights = [to_host(w, pin) for w in self.weights]
        if self.kv_cache.is_cuda:
            torch.cuda.synchronize(self.kv_cache.device)  # the host copies have landed
        self.drop_storages()
        self.level = level
        return sum(self.weight_bytes) + self.kv_bytes

    def wake_up(self, parts: set[str]) -> None:
        """Storages of the `parts` asleep back at their sizes: the level-1 weights copied back,
        the KV cache zeroed; after level 2 the weights hold garbage until `update_weights`."""
        assert parts <= set(PARTS), parts
        if "weights" in parts & self.asleep:
            for w, nbytes in zip(self.weights, self.weight_bytes, strict=True):
                w.untyped_storage().resize_(nbytes)
            if self.host_weights is not None:
                for w, host in zip(self.weights, self.host_weights, strict=True):
                    w.copy_(host, non_blocking=True)
        if "kv_cache" in parts & self.asleep:
            self.kv_cache.untyped_storage().resize_(self.kv_bytes)
            self.kv_cache.untyped_storage().fill_(0)
        if self.kv_cache.is_cuda:
            torch.cuda.synchronize(self.kv_cache.device)  # before the pinned copies are freed
        self.asleep -= parts
        if "weights" not in self.asleep:
            self.host_weights = None
        if not self.asleep:
            self.level = None

    def release(self) -> None:
        """Give the memory back for good (a shut-down engine): nothing copied, nothing to wake.
        Whoever still holds the engine (a web framework's caches of a server's routes, say)
        then holds no device memory through these tensors."""
        self.host_weights = None
        self.drop_storages()

    def drop_storages(self) -> None:
        """Every storage resized to nothing; the parts marked asleep."""
        for w in self.weights:
            w.untyped_storage().resize_(0)
        self.kv_cache.untyped_storage().resize_(0)
        self.asleep = set(PARTS)


def to_host(tensor: torch.Tensor, pin: bool) -> torch.Tensor:
    host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
    return host.copy_(tensor, non_blocking=pin)
