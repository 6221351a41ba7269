"""Runs a built step on the device: H2D copy, carry-over, forward, sampling, D2H copy.

On CUDA each phase has its own non-default stream and the phases are ordered by events, so
launching a step returns at once and the CPU blocks only in `wait`, on the step's `d2h_done`:

    h2d_stream:     wait compute_done[slot] -> copy inputs  -> record h2d_done[slot]
    compute_stream: wait h2d_done[slot], d2h_done[slot] -> carry-over, forward, sample
                                                            -> record compute_done[slot]
    d2h_stream:     wait compute_done[slot] -> copy outputs -> record d2h_done[slot]

The two slots alternate, so these waits only ever order a slot against its own previous use.
On CPU the same calls run eagerly in program order.
"""

from __future__ import annotations

import numpy as np
import torch

from tandem.attention import AttentionBackend, AttentionMetadata
from tandem.batch import StepBatch
from tandem.io_slot import IOSlot, PackedBuffers
from tandem.model.decoder import Decoder
from tandem.sampling import SamplingTensors, compute_logprobs, sample


class Runner:
    def __init__(
        self,
        model: Decoder,
        kv_caches: list[torch.Tensor],
        attend: AttentionBackend,
        device: torch.device,
        max_tokens: int,
        max_seqs: int,
        max_blocks: int,
    ):
        self.model = model
        self.kv_caches = kv_caches
        self.attend = attend
        self.device = device
        self.slots = [IOSlot(i, max_tokens, max_seqs, max_blocks, device) for i in range(2)]
        self.prev_out: PackedBuffers | None = None  # device outputs of the last launched step
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.h2d_stream, self.compute_stream, self.d2h_stream = (
                torch.cuda.Stream(device) for _ in range(3)
            )
            self.h2d_done = [torch.cuda.Event() for _ in self.slots]
            self.compute_done = [torch.cuda.Event() for _ in self.slots]
            self.d2h_done = [torch.cuda.Event() for _ in self.slots]

    def launch(self, batch: StepBatch) -> None:
        """Enqueue the step's copies and compute; returns without waiting for the device."""
        slot = batch.slot
        if not self.cuda:
            self._compute(batch, self.prev_out)
        else:
            i = slot.index
            with torch.cuda.stream(self.h2d_stream):
                self.h2d_stream.wait_event(self.compute_done[i])  # last reader of dev_in
                slot.dev_in.copy_from(slot.host_in)
                self.h2d_done[i].record()
            with torch.cuda.stream(self.compute_stream):
                self.compute_stream.wait_event(self.h2d_done[i])
                self.compute_stream.wait_event(self.d2h_done[i])  # last reader of dev_out
                self._compute(batch, self.prev_out)
                self.compute_done[i].record()
            with torch.cuda.stream(self.d2h_stream):
                self.d2h_stream.wait_event(self.compute_done[i])
                slot.host_out.copy_from(slot.dev_out)
                self.d2h_done[i].record()
        self.prev_out = slot.dev_out

    def wait(self, batch: StepBatch) -> dict[str, np.ndarray]:
        """Block until the step's outputs are in host memory; the step loop's only CPU wait."""
        if self.cuda:
            self.d2h_done[batch.slot.index].synchronize()
        return batch.slot.np_out

    def wait_inputs_free(self, slot: IOSlot) -> None:
        """Host inputs of `slot` may be overwritten once its last H2D copy has finished."""
        if self.cuda:
            self.h2d_done[slot.index].synchronize()

    @torch.inference_mode()
    def _compute(self, batch: StepBatch, prev_out: PackedBuffers | None) -> None:
        x, out = batch.slot.dev_in, batch.slot.dev_out
        num_tokens, num_seqs = batch.num_tokens, len(batch.requests)
        input_ids = x["input_ids"][:num_tokens]
        if prev_out is not None:
            input_ids = carry_over(input_ids, x["carry_index"][:num_tokens], prev_out["sampled"])
        meta = AttentionMetadata(
            slot_mapping=x["slot_mapping"][:num_tokens].long(),
            query_start_loc=x["query_start_loc"][: num_seqs + 1],
            seq_lens=x["seq_lens"][:num_seqs],
            block_tables=x["block_tables"][:num_seqs],
            decode_only=batch.decode_only,
            query_start_loc_host=batch.query_start_loc,
            seq_lens_host=batch.seq_lens,
        )
        hidden = self.model(
            input_ids, x["positions"][:num_tokens], self.kv_caches, meta, self.attend
        )
        logits = self.model.compute_logits(hidden[x["logits_indices"][:num_seqs].long()])
        ban_tokens(logits, x["banned_ids"][:num_seqs], x["ban_rows"][:num_seqs])
        params = SamplingTensors(
            temperature=x["temperature"][:num_seqs],
            top_k=x["top_k"][:num_seqs],
            top_p=x["top_p"][:num_seqs],
            min_p=x["min_p"][:num_seqs],
            seeds=x["seeds"][:num_seqs],
            positions=x["sample_positions"][:num_seqs],
        )
        sampled = sample(logits, params, batch.use_filters)
        out["sampled"][:num_seqs].copy_(sampled)
        if batch.num_top_logprobs is not None:
            sampled_logprob, top_ids, top_logprobs = compute_logprobs(
                logits, sampled, batch.num_top_logprobs
            )
            out["sampled_logprob"][:num_seqs].copy_(sampled_logprob)
            out["top_ids"][:num_seqs, : batch.num_top_logprobs].copy_(top_ids)
            out["top_logprobs"][:num_seqs, : batch.num_top_logprobs].copy_(top_logprobs)


def carry_over(
    input_ids: torch.Tensor, carry_index: torch.Tensor, prev_sampled: torch.Tensor
) -> torch.Tensor:
    """Add the previous step's sampled ids where the carry index points (placeholders are 0).

    E.g. prev_sampled [7, 9], carry_index [-1, 1, -1, 0], input_ids [5, 0, 6, 0] -> [5, 9, 6, 7]
    """
    carried = prev_sampled[carry_index.clamp(min=0).long()] * (carry_index >= 0)
    return input_ids + carried


def ban_tokens(logits: torch.Tensor, banned_ids: torch.Tensor, ban_rows: torch.Tensor) -> None:
    """Set banned ids' logits to -inf in rows flagged by ban_rows (rows pad their id list by repetition)."""
    ids = banned_ids.long()
    kept = logits.gather(1, ids)
    logits.scatter_(1, ids, torch.where(ban_rows[:, None] > 0, float("-inf"), kept))
