"""Prompt logprobs: the log-probability of every prompt token after the first, as vLLM returns them.

The hidden row at position p predicts the token at p + 1, so a request's prompt logprobs come
from the rows of its prompt chunks at positions 0 .. P-2, whatever step computes them: each
chunk contributes its positions. The host lists those rows and their target tokens (all prompt
tokens, known on the host) in the slot's `PromptLogprobBuffers`; on the device the step gathers
the rows after the forward pass and reduces them to the target's logprob and rank plus the
top-k, a few rows at a time (`SUB_CHUNK_BYTES`), never the whole prompt's [rows, vocab] at once.
Only [rows, 1 + k] values, [rows, k] ids and [rows] ranks come back, on the D2H stream with the
step's other outputs.

Steps with such rows run eagerly or as pieces (never a whole decode graph). Filling an entry is
idempotent, so a preempted request that recomputes its prompt writes the same entries again.
Requests that want prompt logprobs take no blocks from a prefix cache (`wants_prompt_logprobs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from tandem.model import fused
from tandem.request import Request

if TYPE_CHECKING:
    from tandem.model.decoder import Decoder

# float32 bytes of one sub-chunk's [rows, vocab] logprobs (Llama-3's vocabulary: 128 rows)
SUB_CHUNK_BYTES = 64 << 20


@dataclass
class Segment:
    """Consecutive prompt-logprob rows of one request in one step."""

    request: Request
    first_row: int  # of the step's prompt-logprob rows
    first_position: int  # prompt position of the first target token
    count: int


@dataclass
class PromptLogprobStep:
    """What the CPU remembers about a step's prompt-logprob rows until they are read back."""

    num_rows: int
    num_top: int  # the most top ids any of its requests asked for
    segments: list[Segment]


class PromptLogprobBuffers:
    """One slot's prompt-logprob inputs and outputs, host (pinned on CUDA) and device, each a
    flat buffer so that a step's first rows are one contiguous copy."""

    def __init__(self, max_tokens: int, max_top: int, device: torch.device):
        pin = device.type == "cuda"

        def pair(size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
            host = torch.zeros(size, dtype=dtype, pin_memory=pin)
            return host, (torch.zeros(size, dtype=dtype, device=device) if pin else host)

        # [rows, 2] int32: (the row's index among the step's tokens, its target token id)
        self.host_pairs, self.dev_pairs = pair(2 * max_tokens, torch.int32)
        # [rows, 1 + k] float32: the target's logprob, then the top k (k <= max_top)
        self.host_values, self.dev_values = pair((1 + max_top) * max_tokens, torch.float32)
        # [rows, k] int32: the top k ids
        self.host_ids, self.dev_ids = pair(max_top * max_tokens, torch.int32)
        # [rows] int32: the target's rank, the ids at least as likely (itself included: vLLM's)
        self.host_ranks, self.dev_ranks = pair(max_tokens, torch.int32)
        self.np_pairs = self.host_pairs.numpy()
        self.np_values = self.host_values.numpy()
        self.np_ids = self.host_ids.numpy()
        self.np_ranks = self.host_ranks.numpy()

    def copy_in(self, num_rows: int) -> None:
        """H2D of the step's rows, on the current stream (the caller's h2d_stream)."""
        self.dev_pairs[: 2 * num_rows].copy_(self.host_pairs[: 2 * num_rows], non_blocking=True)

    def copy_out(self, num_rows: int, num_top: int) -> None:
        """D2H of the step's results, on the current stream (the caller's d2h_stream)."""
        n, k = num_rows * (1 + num_top), num_rows * num_top
        self.host_values[:n].copy_(self.dev_values[:n], non_blocking=True)
        self.host_ranks[:num_rows].copy_(self.dev_ranks[:num_rows], non_blocking=True)
        if k:
            self.host_ids[:k].copy_(self.dev_ids[:k], non_blocking=True)


def has_rows(requests: list[Request], num_new_tokens: list[int]) -> bool:
    """Whether a planned step computes any prompt-logprob row (num_computed_tokens already
    counts the step's tokens)."""
    return any(
        r.wants_prompt_logprobs and r.num_computed_tokens - n < r.num_prompt_tokens - 1
        for r, n in zip(requests, num_new_tokens, strict=True)
    )


def plan_rows(
    requests: list[Request],
    start: np.ndarray,
    num_new: np.ndarray,
    query_start_loc: np.ndarray,
    buffers: PromptLogprobBuffers,
) -> PromptLogprobStep | None:
    """List the step's rows at prompt positions 0 .. P-2 and their targets in `buffers`' host
    side; None when the step has none. `start`: each request's first position this step."""
    pairs = buffers.np_pairs
    segments, num_rows, num_top = [], 0, 0
    for i, request in enumerate(requests):
        if not request.wants_prompt_logprobs:
            continue
        first = int(start[i])
        end = min(first + int(num_new[i]), request.num_prompt_tokens - 1)
        if end <= first:
            continue
        count = end - first
        # E.g. a 6-token prompt in chunks [0, 4) and [4, 6): rows at 0..3 -> the tokens at 1..4,
        # then the row at 4 -> the token at 5 (the row at 5 predicts the first output)
        view = pairs[2 * num_rows : 2 * (num_rows + count)].reshape(count, 2)
        view[:, 0] = int(query_start_loc[i]) + np.arange(count)
        view[:, 1] = request.prompt_token_ids[first + 1 : end + 1]
        segments.append(Segment(request, num_rows, first + 1, count))
        num_rows += count
        num_top = max(num_top, request.params.prompt_logprobs)
    if not segments:
        return None
    return PromptLogprobStep(num_rows, num_top, segments)


@torch.inference_mode()
def compute(
    model: Decoder,
    hidden: torch.Tensor,
    buffers: PromptLogprobBuffers,
    step_rows: int,
    num_top: int,
) -> None:
    """Reduce the step's prompt-logprob rows of `hidden` [tokens, hidden] to the targets'
    logprobs and ranks and the top `num_top` into the device outputs, a sub-chunk of rows at a
    time."""
    pairs = buffers.dev_pairs[: 2 * step_rows].view(step_rows, 2).long()
    rows, targets = pairs[:, 0], pairs[:, 1]
    values = buffers.dev_values[: step_rows * (1 + num_top)].view(step_rows, 1 + num_top)
    ids = buffers.dev_ids[: step_rows * num_top].view(step_rows, num_top)
    ranks = buffers.dev_ranks[:step_rows]
    weight = fused_lm_head(model, num_top)
    if weight is not None:
        from tandem.prompt_logprobs_kernel import lm_head_logprobs

        cfg = model.cfg
        lm_head_logprobs(
            hidden, rows, weight, targets, cfg.vocab_size, values, ids, ranks,
            softcap=cfg.final_logit_softcapping,
        )  # fmt: skip
        return
    sub_rows = max(1, SUB_CHUNK_BYTES // (4 * model.cfg.vocab_size))
    for a in range(0, step_rows, sub_rows):
        b = min(a + sub_rows, step_rows)
        logprobs = model.compute_logits(hidden[rows[a:b]]).log_softmax(-1, dtype=torch.float32)
        target_logprobs = logprobs.gather(1, targets[a:b, None])
        values[a:b, 0] = target_logprobs[:, 0]
        ranks[a:b] = (logprobs >= target_logprobs).sum(-1)
        if num_top:
            top = logprobs.topk(num_top, dim=-1)
            values[a:b, 1:] = top.values
            ids[a:b] = top.indices


def fused_lm_head(model: Decoder, num_top: int) -> torch.Tensor | None:
    """The LM head's weight when the fused kernel can stand for `compute_logits` (CUDA, one
    device, at most the top-1): it reduces each row over the vocabulary without writing logits.
    It computes what `compute_logits` does: hidden @ weight.T, soft-capped where the model
    caps its final logits (Gemma 2). Not in deterministic mode (`model.linear` is the
    batch-invariant GEMM there): the kernel's vocabulary splits and row tiles follow the step's
    rows, so a prompt's logprobs would change with its neighbours and chunk sizes."""
    weight = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    plain = model.linear is F.linear and model.cfg.logits_scaling is None  # not Granite's
    if num_top > 1 or model.tp.size > 1 or not plain or not fused.use_kernels(weight):
        return None
    return weight


def store(step: PromptLogprobStep, buffers: PromptLogprobBuffers) -> None:
    """Write a read-back step's results into its requests' `prompt_logprobs`: per position, the
    top ids in rank order, then the prompt token (the same form as `Request.logprobs`); and the
    prompt token's rank into `prompt_ranks`."""
    width = 1 + step.num_top
    values = buffers.np_values[: step.num_rows * width].reshape(step.num_rows, width)
    ids = buffers.np_ids[: step.num_rows * step.num_top].reshape(step.num_rows, step.num_top)
    for segment in step.segments:
        request, a, pos, count = (
            segment.request,
            segment.first_row,
            segment.first_position,
            segment.count,
        )
        if request.finished:
            continue  # aborted while the step was in flight
        k = request.params.prompt_logprobs
        chunk_values = values[a : a + count].tolist()
        chunk_ids = ids[a : a + count, :k].tolist()
        targets = request.prompt_token_ids[pos : pos + count]
        entries = request.prompt_logprobs
        for j, (target, row_values, row_ids) in enumerate(
            zip(targets, chunk_values, chunk_ids, strict=True)
        ):
            entry = dict(zip(row_ids, row_values[1 : 1 + k], strict=True))
            entry[target] = row_values[0]
            entries[pos + j] = entry
        request.prompt_ranks[pos : pos + count] = buffers.np_ranks[a : a + count].tolist()
        request.prompt_logprobs_end = max(request.prompt_logprobs_end, pos + count)
