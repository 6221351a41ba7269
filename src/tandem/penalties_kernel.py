"""The dense part of penalties.py in one pass over a step's logits: bans, the repetition penalty,
then the frequency and presence penalties, reading each row's counts and flags where they lie.

In torch these are a dozen [seqs, vocab] kernels (some 600 MB moved at 32 rows of Llama-3's
vocabulary); here each element is read and written once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem import pdl
from tandem.config import cdiv

BLOCK = 2048


@triton.jit
def apply_penalties_kernel(
    logits_ptr,  # [seqs, vocab] float32, updated in place
    counts_ptr,  # [state rows, vocab] int16 or int32
    flags_ptr,  # [state rows, vocab] uint8: PROMPT 1, BANNED 2
    rows_ptr,  # [seqs] int32: each row's state row
    presence_ptr,  # [seqs] float32
    frequency_ptr,  # [seqs] float32
    repetition_ptr,  # [seqs] float32
    logits_stride,
    vocab,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.wait(PDL)
    seq = tl.program_id(0)
    token = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = token < vocab
    state = tl.load(rows_ptr + seq).to(tl.int64) * vocab + token
    presence = tl.load(presence_ptr + seq)
    frequency = tl.load(frequency_ptr + seq)
    repetition = tl.load(repetition_ptr + seq)
    at = logits_ptr + seq.to(tl.int64) * logits_stride + token
    logit = tl.load(at, mask=in_vocab, other=0.0)
    count = tl.load(counts_ptr + state, mask=in_vocab, other=0).to(tl.float32)
    flag = tl.load(flags_ptr + state, mask=in_vocab, other=0).to(tl.int32)
    logit = tl.where((flag & 2) != 0, float("-inf"), logit)
    seen = (count > 0) | ((flag & 1) != 0)
    penalized = tl.where(logit > 0, logit / repetition, logit * repetition)
    logit = tl.where(seen, penalized, logit)
    logit = logit - frequency * count - presence * (count > 0).to(tl.float32)
    tl.store(at, logit, mask=in_vocab)


def apply_penalties(
    logits: torch.Tensor,
    counts: torch.Tensor,
    flags: torch.Tensor,
    rows: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> None:
    """In place on [seqs, vocab] float32 `logits`; `rows` [seqs] index `counts` and `flags`."""
    num_seqs, vocab = logits.shape
    apply_penalties_kernel[(num_seqs, cdiv(vocab, BLOCK))](
        logits, counts, flags, rows, presence, frequency, repetition, logits.stride(0), vocab,
        BLOCK=BLOCK, num_warps=4, **pdl.launch_args(logits.device),
    )  # fmt: skip
