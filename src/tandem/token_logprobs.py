"""Logprobs of chosen tokens: `SamplingParams.logprob_token_ids`, as vLLM returns them; and the
slots' buffers of each row's top ids (`TopLogprobBuffers`), which share their layout.

A request that names token ids gets, at each output position, the logprobs of exactly those
ids (and of the sampled token, as with `logprobs`) in place of the top ones: a label set
scored at every step without reading back the whole vocabulary. The host writes each row's ids
into the slot's `TokenLogprobBuffers` as the step is built; on the device the sampling gathers
their logits less each row's logsumexp (which steps with logprobs compute anyway) and the D2H
stream brings back [rows, width] values with the step's other outputs, so no new wait.

Steps with logprobs sample eagerly (`StepBatch.sampling_graphed`), so nothing here is
captured. The buffers are copied only in steps with such rows, and only their first rows and
columns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.request import Request
from tandem.sampling import MAX_LOGPROB_TOKEN_IDS


@dataclass
class TokenLogprobStep:
    """A step's rows that name token ids: the step's first `num_rows` rows, `width` columns."""

    num_rows: int
    width: int  # the most ids any of its requests named


class RowLogprobBuffers:
    """One slot's ids of each row and their logprobs, host (pinned on CUDA) and device, each flat
    so that a step's [rows, width] is one contiguous copy."""

    def __init__(self, max_seqs: int, max_width: int, device: torch.device):
        pin = device.type == "cuda"
        size = max_seqs * max_width

        def pair(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
            host = torch.zeros(size, dtype=dtype, pin_memory=pin)
            return host, (torch.zeros(size, dtype=dtype, device=device) if pin else host)

        # [rows, width] int32: each row's ids
        self.host_ids, self.dev_ids = pair(torch.int32)
        # [rows, width] float32: their logprobs
        self.host_values, self.dev_values = pair(torch.float32)
        self.np_ids = self.host_ids.numpy()
        self.np_values = self.host_values.numpy()


class TopLogprobBuffers(RowLogprobBuffers):
    """Each row's top k ids, in rank order, and their logprobs (k <= max_logprobs): written by
    the step's sampling, copied back only in steps with logprobs, only the step's [rows, k]."""

    def write(self, ids: torch.Tensor, values: torch.Tensor) -> None:
        """The step's [rows, k] top ids and logprobs into the device buffers' first rows."""
        n = ids.numel()
        self.dev_ids[:n].view_as(ids).copy_(ids)
        self.dev_values[:n].view_as(values).copy_(values)

    def copy_out(self, num_rows: int, k: int) -> None:
        """D2H of the step's [rows, k], on the current stream (the caller's d2h_stream)."""
        n = num_rows * k
        self.host_ids[:n].copy_(self.dev_ids[:n], non_blocking=True)
        self.host_values[:n].copy_(self.dev_values[:n], non_blocking=True)

    def read(self, num_rows: int, k: int) -> tuple[list[list[int]], list[list[float]]]:
        """The read-back step's top ids and logprobs, as lists of its rows."""
        n = num_rows * k
        ids, values = self.np_ids[:n].reshape(num_rows, k), self.np_values[:n].reshape(num_rows, k)
        return ids.tolist(), values.tolist()


class TokenLogprobBuffers(RowLogprobBuffers):
    """The ids each row names (padded with id 0: read, never returned), at most
    MAX_LOGPROB_TOKEN_IDS, in; their logprobs out."""

    def __init__(self, max_seqs: int, device: torch.device):
        super().__init__(max_seqs, MAX_LOGPROB_TOKEN_IDS, device)

    def copy_in(self, step: TokenLogprobStep) -> None:
        """H2D of the step's ids, on the current stream (the caller's h2d_stream)."""
        n = step.num_rows * step.width
        self.dev_ids[:n].copy_(self.host_ids[:n], non_blocking=True)

    def copy_out(self, step: TokenLogprobStep) -> None:
        """D2H of the step's logprobs, on the current stream (the caller's d2h_stream)."""
        n = step.num_rows * step.width
        self.host_values[:n].copy_(self.dev_values[:n], non_blocking=True)


def plan_rows(requests: list[Request], buffers: TokenLogprobBuffers) -> TokenLogprobStep | None:
    """Write the step's rows' ids into `buffers`' host side; None when no request names any."""
    named = [(i, r.params.logprob_token_ids) for i, r in enumerate(requests)]
    named = [(i, ids) for i, ids in named if ids is not None]
    if not named:
        return None
    step = TokenLogprobStep(len(requests), max(len(ids) for _, ids in named))
    rows = buffers.np_ids[: step.num_rows * step.width].reshape(step.num_rows, step.width)
    rows[:] = 0
    for i, ids in named:
        rows[i, : len(ids)] = ids
    return step


def gather(
    values: torch.Tensor, shift: torch.Tensor, buffers: TokenLogprobBuffers, step: TokenLogprobStep
) -> None:
    """[rows, vocab] values (logits) less each row's shift (its logsumexp: see
    `sampling.sampled_logprobs`) at the named ids -> their logprobs in the device buffer."""
    n, rows = step.num_rows * step.width, step.num_rows
    ids = buffers.dev_ids[:n].view(rows, step.width).long()
    out = buffers.dev_values[:n].view(ids.shape)
    torch.sub(values[:rows].gather(1, ids).float(), shift[:rows, None], out=out)


def entry(
    step: TokenLogprobStep, buffers: TokenLogprobBuffers, row: int, ids: list[int]
) -> dict[int, float]:
    """A read-back row's entry: each named id and its logprob, in the order named."""
    values = buffers.np_values[row * step.width : row * step.width + len(ids)].tolist()
    return dict(zip(ids, values, strict=True))


def check_vocab(ids: list[int] | None, vocab_size: int) -> None:
    """A ValueError naming the ids outside the model's vocabulary (as vLLM's)."""
    bad = [t for t in ids or () if t >= vocab_size]
    if bad:
        raise ValueError(
            f"token id(s) {bad[:10]} in logprob_token_ids are outside the vocabulary "
            f"(size {vocab_size})"
        )
