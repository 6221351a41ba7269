"""Custom logits processors for the `seed-processors` workloads (scripts/gpu_check.sh): every
row of every step has the first BANNED ids of the vocabulary set to -inf, as a vocabulary
filter written against vLLM's interface would. Named on the command line as
`--logits-processors benchmarks.processors:BanIds` (from the repository root, which
`python3 -m tandem.cli` puts on the import path). BanIds declares that it reads no output ids:
its steps' sampling is launched with their forward pass (the cost measured: eager sampling and
the processor's device work). BanIdsReadingOutputs declares that it does (vLLM's assumption):
its steps' sampling waits for the host's read of the step before (that wait measured too).
"""

from __future__ import annotations

import torch

from tandem.logits_processors import BatchUpdate, LogitsProcessor

BANNED = 100


class BanIds(LogitsProcessor):
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        self.banned = torch.arange(BANNED, device=device)

    @classmethod
    def needs_output_token_ids(cls) -> bool:
        return False

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        pass  # every row alike

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        # not `logits[:, self.banned] = -inf`: assigning through an index tensor synchronizes
        # with the device (torch's sync debug mode flags it), which would stall the step loop
        return logits.index_fill_(1, self.banned, float("-inf"))


class BanIdsReadingOutputs(BanIds):
    @classmethod
    def needs_output_token_ids(cls) -> bool:
        return True
