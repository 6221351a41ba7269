"""Logits processors with per-request state on the device: presence, frequency and repetition
penalties, logit_bias, allowed_token_ids and bad_words.

A request with any of them keeps a state row (its RunningRows row; the rows without one share
a scratch row, `max_num_seqs`, which they read as all-neutral):

    counts   [rows, vocab]  how often each token occurs among the outputs
    flags    [rows, vocab]  PROMPT: occurs in the prompt; BANNED: outside allowed_token_ids, or a
                            one-token bad word
    history  [rows, H]      the last H output tokens (output j in slot j % H), for bad words of
                            up to H + 1 tokens

The steps keep the state themselves, inside their graphs: each step with a penalized row counts
its input tokens (after the carry-over) into their rows, a prompt token as PROMPT and an output
token, fed back or re-fed after preemption, as one occurrence. So when output k is sampled,
outputs 0..k-1 are counted, and nothing is ever read back to the host. A request taking a row
resets it (`admit`, on the compute stream, before its first step), so a preempted request that
resumes rebuilds its state from the tokens it recomputes (such a request is never swapped,
swap.py: a swapped one would resume without feeding them again).

Order, as vLLM's sampler: bans (allowed ids, bad words), logit_bias, the repetition penalty
(prompt and outputs), then the frequency and presence penalties (outputs):
    logit -= frequency_penalty * count + presence_penalty * (count > 0)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from tandem.io_slot import PackedBuffers
from tandem.model import fused

if TYPE_CHECKING:
    from tandem.request import Request
    from tandem.sampling import SamplingParams
    from tandem.tokenizer import Tokenizer

MAX_LOGIT_BIAS = 1024  # logit_bias entries per request
MAX_BAD_WORD_SEQUENCES = 64  # bad-word token sequences of two tokens or more, per request
MAX_BAD_WORD_TOKENS = 16  # tokens in one such sequence
HISTORY = MAX_BAD_WORD_TOKENS - 1
PROMPT, BANNED = 1, 2  # bits of `flags`
NO_TOKEN = -1  # history before the outputs reach back that far
ANY = -2  # a bad-word prefix slot before a shorter word's first token: matches anything
UNUSED = -3  # a bad-word slot no word fills: matches nothing


def count_dtype(max_tokens: int) -> torch.dtype:
    """int16 counts while a step adds at most 2**14 tokens (they saturate at 2**15 - 1 - that)."""
    return torch.int16 if max_tokens <= 1 << 14 else torch.int32


def state_bytes(max_seqs: int, vocab_size: int, max_tokens: int) -> int:
    """Device bytes of the state for `max_seqs` rows plus the scratch row."""
    rows = max_seqs + 1
    per_token = count_dtype(max_tokens).itemsize + 1  # counts, flags
    per_row = MAX_LOGIT_BIAS * (8 + 4) + MAX_BAD_WORD_SEQUENCES * MAX_BAD_WORD_TOKENS * 4
    return rows * (vocab_size * per_token + per_row + HISTORY * 4 + 4) + HISTORY * 8  # lanes


def bad_word_token_ids(tokenizer: Tokenizer, words: list[str]) -> list[list[int]]:
    """Each bad word as tokens, alone and after a space (as it reads mid-text), once each."""
    sequences: list[list[int]] = []
    for word in words:
        alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        sequences.append(alone)
        # the spaced form is its own word when it starts with another token (and is no longer)
        if spaced and alone and spaced[0] != alone[0] and len(spaced) == len(alone):
            sequences.append(spaced)
    return [s for s in sequences if s]


def check_request(params: SamplingParams, bad_words: list[list[int]], vocab_size: int) -> None:
    """Raise a ValueError naming the field when the request's processors do not fit the model
    or this module's limits."""
    for name, ids in (
        ("logit_bias", list(params.logit_bias or ())),
        ("allowed_token_ids", params.allowed_token_ids or []),
    ):
        bad = next((t for t in ids if t >= vocab_size), None)
        if bad is not None:
            raise ValueError(f"{name} token ids must be in [0, {vocab_size}), got {bad}")
    # a tokenizer may know more ids than the model has logits (added special tokens)
    bad = next((t for s in bad_words for t in s if t >= vocab_size), None)
    if bad is not None:
        raise ValueError(
            f"bad_words make token id {bad}, past the model's vocabulary of {vocab_size}"
        )
    if len(params.logit_bias or ()) > MAX_LOGIT_BIAS:
        raise ValueError(
            f"logit_bias has {len(params.logit_bias)} entries; at most {MAX_LOGIT_BIAS}"
        )
    longer = [s for s in bad_words if len(s) > 1]
    if len(longer) > MAX_BAD_WORD_SEQUENCES:
        raise ValueError(
            f"bad_words make {len(longer)} sequences of several tokens; at most "
            f"{MAX_BAD_WORD_SEQUENCES}"
        )
    if any(len(s) > MAX_BAD_WORD_TOKENS for s in longer):
        raise ValueError(f"bad_words must be at most {MAX_BAD_WORD_TOKENS} tokens each")


class PenaltyState:
    """The state rows on the device, and the three things done with them: reset a row a
    penalized request takes (`admit`), count a step's input tokens (`update`), and process a
    step's logits (`apply`)."""

    def __init__(self, max_seqs: int, vocab_size: int, max_tokens: int, device: torch.device):
        rows, self.scratch, self.device = max_seqs + 1, max_seqs, device
        dtype = count_dtype(max_tokens)
        # a step adds at most max_tokens to a count: below this, no addition overflows
        self.count_cap = torch.iinfo(dtype).max - max_tokens
        self.counts = torch.zeros(rows, vocab_size, dtype=dtype, device=device)  # [rows, vocab]
        self.flags = torch.zeros(rows, vocab_size, dtype=torch.uint8, device=device)
        self.prompt_len = torch.zeros(rows, dtype=torch.int32, device=device)  # [rows]
        self.bias_ids = torch.zeros(rows, MAX_LOGIT_BIAS, dtype=torch.int64, device=device)
        self.bias = torch.zeros(rows, MAX_LOGIT_BIAS, dtype=torch.float32, device=device)
        # [rows, sequences, H + 1] int32: a prefix right-aligned in [:H], the banned token at H
        shape = (rows, MAX_BAD_WORD_SEQUENCES, MAX_BAD_WORD_TOKENS)
        self.bad_words = torch.full(shape, UNUSED, dtype=torch.int32, device=device)
        self.history = torch.full((rows, HISTORY), NO_TOKEN, dtype=torch.int32, device=device)
        self.lanes = torch.arange(HISTORY, device=device)  # [H]

    def admit(self, rows: list[int], requests: list[Request]) -> None:
        """Reset the rows penalized requests just took and write what the requests fix; eager,
        on the step's stream, so after every earlier step that used the rows."""
        index = self._to_device(np.asarray(rows, dtype=np.int64))
        # index_fill_ takes its value as a scalar argument: `state[index] = 0` would copy a
        # host scalar to the device and wait for it
        for state in (self.counts, self.flags, self.bias_ids, self.bias):
            state.index_fill_(0, index, 0)
        self.history.index_fill_(0, index, NO_TOKEN)
        self.prompt_len[index] = self._to_device(
            np.array([r.num_prompt_tokens for r in requests], dtype=np.int32)
        )
        bias_ids = np.zeros((len(rows), MAX_LOGIT_BIAS), dtype=np.int64)
        bias = np.zeros((len(rows), MAX_LOGIT_BIAS), dtype=np.float32)
        words = np.full((len(rows), MAX_BAD_WORD_SEQUENCES, MAX_BAD_WORD_TOKENS), UNUSED, np.int32)
        restricted, allowed, banned = [], ([], []), ([], [])
        for i, (row, request) in enumerate(zip(rows, requests, strict=True)):
            params = request.params
            if params.logit_bias:
                bias_ids[i, : len(params.logit_bias)] = list(params.logit_bias)
                bias[i, : len(params.logit_bias)] = list(params.logit_bias.values())
            if params.allowed_token_ids is not None:
                restricted.append(row)
                allowed[0].extend([row] * len(params.allowed_token_ids))
                allowed[1].extend(params.allowed_token_ids)
            longer = [s for s in request.bad_words_token_ids if len(s) > 1]
            singles = [s[0] for s in request.bad_words_token_ids if len(s) == 1]
            banned[0].extend([row] * len(singles))
            banned[1].extend(singles)
            for j, sequence in enumerate(longer):
                # E.g. [5, 6, 7] with H = 4 -> [ANY, ANY, 5, 6, 7]: 5, 6 the last outputs, 7 banned
                words[i, j, : MAX_BAD_WORD_TOKENS - len(sequence)] = ANY
                words[i, j, MAX_BAD_WORD_TOKENS - len(sequence) :] = sequence
        self.bias_ids[index] = self._to_device(bias_ids)
        self.bias[index] = self._to_device(bias)
        self.bad_words[index] = self._to_device(words)
        if restricted:
            self.flags.index_fill_(0, self._to_device(np.asarray(restricted, np.int64)), BANNED)
            self._set_flags(allowed, 0)
        if banned[0]:
            self._set_flags(banned, BANNED)

    def update(self, x: PackedBuffers, input_ids: torch.Tensor) -> None:
        """Count the step's input tokens (after the carry-over, [tokens] int32) into their rows'
        state; fixed shapes, so capturable."""
        num_tokens = input_ids.shape[0]
        ids = input_ids.long()
        rows = x["penalty_token_rows"][:num_tokens].long()
        is_output = x["positions"][:num_tokens] >= self.prompt_len[rows]
        vocab = self.counts.shape[1]
        at = rows * vocab + ids
        counts, flags = self.counts.view(-1), self.flags.view(-1)
        added = is_output & (counts[at] < self.count_cap)  # saturates, never wraps
        counts.scatter_add_(0, at, added.to(counts.dtype))
        # prompt tokens set PROMPT; output tokens set it in the scratch row, which no one reads as
        # such: every write to one element writes the same value, whatever the order
        marked = torch.where(is_output, self.scratch * vocab + ids, at)
        flags[marked] = flags[marked] | PROMPT
        self.history.view(-1)[x["penalty_history_slots"][:num_tokens].long()] = input_ids

    def apply(self, logits: torch.Tensor, x: PackedBuffers, num_seqs: int) -> torch.Tensor:
        """[seqs, vocab] logits -> new float32 logits with every processor applied: the sparse
        ones (logit_bias, bad words) first, then the dense ones over the whole vocabulary."""
        rows = x["penalty_rows"][:num_seqs]
        index = rows.long()
        logits = logits.to(torch.float32, copy=True)
        logits.scatter_add_(1, self.bias_ids[index], self.bias[index])
        self._ban_bad_words(logits, index, x)
        presence, frequency, repetition = (
            x[name][:num_seqs]
            for name in ("presence_penalty", "frequency_penalty", "repetition_penalty")
        )
        if fused.use_kernels(logits):
            from tandem.penalties_kernel import apply_penalties

            apply_penalties(logits, self.counts, self.flags, rows, presence, frequency, repetition)
            return logits
        counts, flags = self.counts[index], self.flags[index]
        return apply_dense(logits, counts, flags, presence, frequency, repetition)

    def _ban_bad_words(self, logits: torch.Tensor, rows: torch.Tensor, x: PackedBuffers) -> None:
        """-inf at each bad word's last token where the outputs end with the rest of it."""
        words = self.bad_words[rows]  # [seqs, sequences, H + 1]
        prefix, last = words[..., :HISTORY], words[..., HISTORY].long().clamp(min=0)  # UNUSED: 0
        # output j sits in slot j % H: E.g. H = 3, 4 outputs -> slots [1, 2, 0], oldest first
        num_outputs = x["sample_positions"][: rows.shape[0]].long()[:, None]
        oldest_first = (num_outputs + self.lanes) % HISTORY  # [seqs, H]
        recent = self.history[rows].gather(1, oldest_first)[:, None, :]  # [seqs, 1, H]
        matched = ((prefix == recent) | (prefix == ANY)).all(dim=-1)  # [seqs, sequences]
        block = torch.where(matched, float("-inf"), float("inf"))
        logits.scatter_reduce_(1, last, block, reduce="amin")  # several may ban one token

    def _set_flags(self, pairs: tuple[list[int], list[int]], value: int) -> None:
        """flags[rows, ids] = value for the (rows, ids) pairs, the value made on the device."""
        rows, ids = (self._to_device(np.asarray(p, dtype=np.int64)) for p in pairs)
        values = torch.full(rows.shape, value, dtype=self.flags.dtype, device=self.device)
        self.flags.index_put_((rows, ids), values)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """A host array on the device without a host wait: through pinned memory, which torch's
        host allocator keeps until the copy is done."""
        tensor = torch.from_numpy(array)
        if self.device.type != "cuda":
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)


def apply_dense(
    logits: torch.Tensor,
    counts: torch.Tensor,
    flags: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """Bans, then the repetition, frequency and presence penalties, on [seqs, vocab] float32
    logits with their rows' counts and flags (penalties_kernel.py does the same in one pass)."""
    logits = logits.masked_fill((flags & BANNED).bool(), float("-inf"))
    seen = (counts > 0) | (flags & PROMPT).bool()
    repetition = repetition[:, None]
    penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalized, logits)
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)


def fill_step_inputs(
    x: dict[str, np.ndarray],
    state_rows: np.ndarray,
    seq_of_token: np.ndarray,
    positions: np.ndarray,
    prompt_lens: np.ndarray,
    computed_after: np.ndarray,
    penalties: tuple[np.ndarray, np.ndarray, np.ndarray],
) -> None:
    """A step's penalty inputs, for its rows in plan order: `state_rows` [seqs] (the scratch
    row where a row has no state), their prompt lengths and tokens computed after the step,
    and their (presence, frequency, repetition) penalties."""
    n, num_tokens, scratch = len(state_rows), len(seq_of_token), len(x["penalty_rows"])
    x["penalty_rows"][:n] = state_rows
    token_rows = state_rows[seq_of_token]
    x["penalty_token_rows"][:num_tokens] = token_rows
    # output j goes to history slot j % H, but only the last H outputs a row feeds in the step
    # (others would be overwritten in it). E.g. H = 2, prompt 3, positions [3, 4, 5]: outputs
    # [0, 1, 2] -> slots [none, 1, 0]
    output = positions - prompt_lens[seq_of_token]
    fed = (computed_after - prompt_lens)[seq_of_token]
    kept = (output >= 0) & (output >= fed - HISTORY) & (token_rows != scratch)
    slots = np.where(kept, token_rows * HISTORY + output % HISTORY, scratch * HISTORY)
    x["penalty_history_slots"][:num_tokens] = slots
    for name, values in zip(
        ("presence_penalty", "frequency_penalty", "repetition_penalty"), penalties, strict=True
    ):
        x[name][:n] = values


def fill_padding(x: dict[str, np.ndarray], start: int, end: int, token_end: int) -> None:
    """Padding rows [start, end) and token rows [start, token_end) of a graph read the scratch
    row, neutrally."""
    scratch = len(x["penalty_rows"])
    x["penalty_rows"][start:end] = scratch
    x["presence_penalty"][start:end] = 0.0
    x["frequency_penalty"][start:end] = 0.0
    x["repetition_penalty"][start:end] = 1.0
    x["penalty_token_rows"][start:token_end] = scratch
    x["penalty_history_slots"][start:token_end] = scratch * HISTORY
