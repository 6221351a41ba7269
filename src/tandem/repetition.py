"""Repetition detection (vLLM's `SamplingParams.repetition_detection`): a request whose output
ends in the same n-gram `min_count` times over, for some n in [min_pattern_size,
max_pattern_size], finishes with finish_reason "repetition" (stop_reason
"repetition_detected"). Checked on the host as each token is read back, beside EOS and stop
strings; a degenerate RL rollout stops paying for its loop."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class RepetitionDetectionParams:
    """vLLM's fields; max_pattern_size 0 turns the check off."""

    max_pattern_size: int = 0
    min_pattern_size: int = 0  # 0: 1
    min_count: int = 0  # at least 2 where max_pattern_size > 0

    def __post_init__(self) -> None:
        for name in ("max_pattern_size", "min_pattern_size", "min_count"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(
                    f"repetition_detection.{name} must be an integer >= 0, got {value!r}"
                )
        if self.min_pattern_size > self.max_pattern_size:
            raise ValueError(
                "repetition_detection.min_pattern_size must be at most max_pattern_size, got "
                f"{self.min_pattern_size} > {self.max_pattern_size}"
            )
        if self.max_pattern_size > 0 and self.min_count < 2:
            raise ValueError(
                "repetition_detection.min_count must be >= 2 (a pattern seen twice or more), "
                f"got {self.min_count}"
            )


def as_params(value: Any) -> RepetitionDetectionParams | None:
    """None, the params, or a dict of their fields (the server's JSON)."""
    if value is None or isinstance(value, RepetitionDetectionParams):
        return value
    if isinstance(value, dict):
        known = {"max_pattern_size", "min_pattern_size", "min_count"}
        if unknown := sorted(set(value) - known):
            raise ValueError(
                f"repetition_detection has unknown fields {unknown}; it takes {sorted(known)}"
            )
        return RepetitionDetectionParams(**value)
    raise ValueError(
        "repetition_detection must be a RepetitionDetectionParams or a dict of its fields, "
        f"got {value!r:.80}"
    )


def ends_in_repetition(tokens: Sequence[int], params: RepetitionDetectionParams) -> bool:
    """Whether `tokens` end in some pattern of min..max_pattern_size tokens `min_count` times
    in a row."""
    count = params.min_count
    if params.max_pattern_size <= 0 or count < 2:
        return False
    for size in range(max(params.min_pattern_size, 1), params.max_pattern_size + 1):
        if size * count > len(tokens):
            return False
        tail = tokens[-size:]
        if all(tokens[-size * (k + 1) : len(tokens) - size * k] == tail for k in range(1, count)):
            return True
    return False
