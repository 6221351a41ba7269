"""One IO slot: every per-step input and output, packed so each direction is one copy.

A slot owns a pinned host buffer and a device twin for the step inputs (one int32 and one
float32 block, carved into named views) and the same pair for the sampled outputs. Two slots
alternate so that preparing batch N+1 never touches memory batch N is still reading.
"""

from __future__ import annotations

from math import prod

import numpy as np
import torch

from tandem.pooling import PoolingBuffers
from tandem.prompt_embeds import PromptEmbedBuffers
from tandem.prompt_logprobs import PromptLogprobBuffers
from tandem.structured import MaskBuffers
from tandem.token_logprobs import TokenLogprobBuffers, TopLogprobBuffers

MAX_BANNED_IDS = 32  # EOS ids plus stop_token_ids suppressed while a request is under min_tokens
# the most device memory the two slots' logprob buffers may take (each has a pinned host twin)
MAX_LOGPROB_BUFFER_BYTES = 4 << 30


def input_fields(
    max_tokens: int, max_seqs: int, max_blocks: int, lora: bool = False
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    t, b = max_tokens, max_seqs
    # with LoRA adapters (model/lora.py): each token's adapter slot, -1 for the base model
    adapters = {"lora_slots": ((t,), torch.int32)} if lora else {}
    return adapters | {
        "input_ids": ((t,), torch.int32),  # 0 where the token is carried over
        "positions": ((t,), torch.int32),
        "slot_mapping": ((t,), torch.int32),  # -1 for padding rows
        "carry_index": ((t,), torch.int32),  # row of the previous step's output, or -1
        "query_start_loc": ((b + 1,), torch.int32),
        "seq_lens": ((b,), torch.int32),
        "seq_order": ((b,), torch.int32),  # decode: rows by context length, longest first
        "logits_indices": ((b,), torch.int32),
        "block_tables": ((b, max_blocks), torch.int32),
        # copy-on-write of cached blocks before the forward (prefix_cache.py): at most one
        # per request admitted
        "copy_src": ((b,), torch.int32),
        "copy_dst": ((b,), torch.int32),
        # decode rows that share leading blocks (shared_prefix.py): per row, then per group
        "prefix_lens": ((b,), torch.int32),  # keys the row's group shares, 0 in no group
        "group_rows": ((b,), torch.int32),  # the grouped rows, group after group
        "group_starts": ((b + 1,), torch.int32),
        "group_prefix": ((b,), torch.int32),
        "num_groups": ((1,), torch.int32),
        "top_k": ((b,), torch.int32),
        "seeds": ((b,), torch.int32),
        "sample_positions": ((b,), torch.int32),
        "banned_ids": ((b, MAX_BANNED_IDS), torch.int32),
        "ban_rows": ((b,), torch.int32),
        # penalties.py, read only by steps with a penalized row: each row's and token's state
        # row (the scratch row, max_seqs, where it has none), each token's slot in the history
        "penalty_rows": ((b,), torch.int32),
        "penalty_token_rows": ((t,), torch.int32),
        "penalty_history_slots": ((t,), torch.int32),
        "temperature": ((b,), torch.float32),
        "top_p": ((b,), torch.float32),
        "min_p": ((b,), torch.float32),
        "presence_penalty": ((b,), torch.float32),
        "frequency_penalty": ((b,), torch.float32),
        "repetition_penalty": ((b,), torch.float32),
    }


def output_fields(max_seqs: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    b = max_seqs
    return {
        "sampled": ((b,), torch.int32),
        "sampled_logprob": ((b,), torch.float32),
        "sampled_rank": ((b,), torch.int32),  # 1 + the tokens at least as likely, itself counted
    }


def logprob_buffer_bytes(max_top: int, max_tokens: int, max_seqs: int) -> int:
    """Device bytes of the two slots' logprob buffers `max_top` ids wide: every prompt-logprob
    row of a step (max_num_batched_tokens: values, ids) and every sampled row (max_num_seqs: ids,
    values) has room for them. The KV cache is sized after them."""
    return 2 * 4 * (max_tokens * (2 * max_top + 1) + max_seqs * 2 * max_top)


def check_logprobs_width(max_top: int, max_tokens: int, max_seqs: int, max_logprobs: int) -> None:
    """A ValueError where `max_top` ids a position (max_logprobs') make the two slots' logprob
    buffers larger than MAX_LOGPROB_BUFFER_BYTES."""
    size = logprob_buffer_bytes(max_top, max_tokens, max_seqs)
    if size > MAX_LOGPROB_BUFFER_BYTES:
        raise ValueError(
            f"max_logprobs={max_logprobs} ({max_top} ids a position) needs {size >> 20:,} MiB of "
            f"logprob buffers at max_num_batched_tokens={max_tokens} and max_num_seqs="
            f"{max_seqs}, over {MAX_LOGPROB_BUFFER_BYTES >> 20:,} MiB; lower max_logprobs or "
            "max_num_batched_tokens"
        )


def fill_padding(x: dict[str, np.ndarray], start: int, end: int) -> None:
    """Rows [start, end) of a decode-only step padded up to a graph's size."""
    fill_token_padding(x, start, end)
    x["seq_lens"][start:end] = 1
    x["logits_indices"][start:end] = np.arange(start, end)
    x["temperature"][start:end] = 0.0
    x["top_k"][start:end] = 0
    x["top_p"][start:end] = 1.0
    x["min_p"][start:end] = 0.0
    x["ban_rows"][start:end] = 0


def fill_token_padding(x: dict[str, np.ndarray], start: int, end: int) -> None:
    """Token rows [start, end) padded up to a graph's size: token 0 at position 0, no cache slot."""
    x["input_ids"][start:end] = 0
    x["positions"][start:end] = 0
    x["slot_mapping"][start:end] = -1
    x["carry_index"][start:end] = -1
    if "lora_slots" in x:
        x["lora_slots"][start:end] = -1


class PackedBuffers:
    """Named tensors carved out of one int32 and one float32 allocation (views share storage)."""

    def __init__(
        self,
        fields: dict[str, tuple[tuple[int, ...], torch.dtype]],
        device: torch.device,
        pin: bool,
    ):
        sizes = {dtype: 0 for dtype in (torch.int32, torch.float32)}
        for shape, dtype in fields.values():
            sizes[dtype] += prod(shape)
        self.blocks = {
            dtype: torch.zeros(size, dtype=dtype, device=device, pin_memory=pin)
            for dtype, size in sizes.items()
        }
        offsets = dict.fromkeys(sizes, 0)
        self.views: dict[str, torch.Tensor] = {}
        for name, (shape, dtype) in fields.items():
            n = prod(shape)
            self.views[name] = self.blocks[dtype][offsets[dtype] : offsets[dtype] + n].view(shape)
            offsets[dtype] += n

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.views[name]

    def copy_from(self, other: PackedBuffers) -> None:
        """One non-blocking copy per block, on the current stream."""
        for dtype, block in self.blocks.items():
            block.copy_(other.blocks[dtype], non_blocking=True)

    def numpy(self) -> dict[str, np.ndarray]:
        """NumPy views of host buffers (writes land in the pinned memory)."""
        return {name: view.numpy() for name, view in self.views.items()}


class IOSlot:
    def __init__(
        self,
        index: int,
        max_tokens: int,
        max_seqs: int,
        max_blocks: int,
        device: torch.device,
        mask_vocab_size: int | None = None,
        hidden_size: int = 1,
        num_labels: int = 0,
        lora: bool = False,
        embeds_dtype: torch.dtype | None = None,
        max_top: int = 20,
    ):
        """`max_top`: the most top ids a position's logprobs return (`logprobs_width`)."""
        pin = device.type == "cuda"
        self.index = index
        fields = input_fields(max_tokens, max_seqs, max_blocks, lora)
        self.host_in = PackedBuffers(fields, torch.device("cpu"), pin)
        self.dev_in = PackedBuffers(fields, device, False) if pin else self.host_in
        self.host_out = PackedBuffers(output_fields(max_seqs), torch.device("cpu"), pin)
        self.dev_out = (
            PackedBuffers(output_fields(max_seqs), device, False) if pin else self.host_out
        )
        self.np_in = self.host_in.numpy()
        self.np_out = self.host_out.numpy()
        # sample logprobs' top ids, copied only in steps with logprobs, and only their k
        self.top_logprobs = TopLogprobBuffers(max_seqs, max_top, device)
        # copied only in steps with prompt-logprob rows, and only those rows
        self.prompt_logprobs = PromptLogprobBuffers(max_tokens, max_top, device)
        # logprob_token_ids' ids and values, copied only in steps with rows that name ids
        self.token_logprobs = TokenLogprobBuffers(max_seqs, device)
        # embedding requests' rows and vectors, copied only in steps that pool rows
        self.pooling = PoolingBuffers(max_seqs, hidden_size, device, num_labels)
        # prompts of embeddings' rows (enable_prompt_embeds: embeds_dtype), copied only in
        # steps that compute such prompt positions
        self.prompt_embeds = (
            PromptEmbedBuffers(max_tokens, hidden_size, embeds_dtype, device)
            if embeds_dtype is not None
            else None
        )
        # structured outputs' token masks, copied only in steps with constrained rows
        self.masks = (
            MaskBuffers(max_seqs, mask_vocab_size, device) if mask_vocab_size is not None else None
        )

    def reset_device(self) -> None:
        """The device inputs as a decode step of padding rows (`fill_padding`: one key each,
        no KV written, in row order) and the outputs zeroed. Graph capture's warm-ups run on
        them; after steps they hold rows of different steps, which together may name blocks,
        lengths and groups no step has (sleep mode captures again after waking). Zeroed rows
        would be sequences of no keys, whose query the decode kernel rotates at position -1:
        a read before the rotary table, which faulted at chat's engine start (an illegal
        address, on the H200 and the H100)."""
        for block in self.host_in.blocks.values():
            block.zero_()
        x = self.host_in.numpy()
        fill_token_padding(x, 0, len(x["input_ids"]))
        fill_padding(x, 0, len(x["seq_lens"]))
        x["seq_order"][:] = np.arange(len(x["seq_order"]))  # each row its own, as in a step
        if self.dev_in is not self.host_in:
            self.dev_in.copy_from(self.host_in)
        for block in self.dev_out.blocks.values():
            block.zero_()


def carry_over(
    input_ids: torch.Tensor, carry_index: torch.Tensor, prev_sampled: torch.Tensor
) -> torch.Tensor:
    """Add the previous step's sampled ids where the carry index points (placeholders are 0).

    E.g. prev_sampled [7, 9], carry_index [-1, 1, -1, 0], input_ids [5, 0, 6, 0] -> [5, 9, 6, 7]
    """
    carried = prev_sampled[carry_index.clamp(min=0).long()] * (carry_index >= 0)
    return input_ids + carried
