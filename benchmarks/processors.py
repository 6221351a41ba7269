"""A custom logits processor for the `seed-processors` workload (scripts/gpu_check.sh): every
row of every step has the first BANNED ids of the vocabulary set to -inf, as a vocabulary
filter written against vLLM's interface would. Named on the command line as
`--logits-processors benchmarks.processors:BanIds` (from the repository root, which
`python3 -m tandem.cli` puts on the import path); it measures what custom processors cost a
step: the eager sampling and the processor's own device work, beside the same workload without.
"""

from __future__ import annotations

import torch

from tandem.logits_processors import BatchUpdate, LogitsProcessor

BANNED = 100


class BanIds(LogitsProcessor):
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        self.banned = torch.arange(BANNED, device=device)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        pass  # every row alike

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        logits[:, self.banned] = float("-inf")
        return logits
