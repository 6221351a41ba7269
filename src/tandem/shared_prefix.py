"""Which decode rows of a step share leading KV blocks, for cascade attention.

Rows share a block when their block tables hold the same block id: the samples of one prompt,
or requests whose common system prompt the prefix cache found; past those, the first
`block_size - 1` slots of a block that each row holds as a copy on write of one cached block (or
as that block). The groups are found on the host from the step's block tables, with numpy, and
travel in the IO slot; the Triton decode then reads each shared block once per group
(attention/triton_kernels.py, shared_prefix_kernel).
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import numpy as np

MIN_SHARED_BLOCKS = 2  # fewer shared blocks save less than the extra launch costs


class CopiedBlocks(NamedTuple):
    """The decode rows' copies on write (prefix_cache.py): a row whose admission copied a cached
    block holds, at table index `index` (-1: none), that block's first block_size - 1 slots as
    publication number `publication` had them; `published` [num_blocks] is each cached
    block's current publication number (-1: none)."""

    index: np.ndarray  # [num_seqs] int32
    publication: np.ndarray  # [num_seqs] int64
    published: np.ndarray  # [num_blocks] int64

    def shared_slots(self, rows: np.ndarray, tables: np.ndarray, at: int) -> bool:
        """Whether the rows' blocks at table index `at` are copies of one publication, or the
        block of that publication itself: their first block_size - 1 slots are then equal."""
        copied = self.index[rows] == at
        numbers = np.where(copied, self.publication[rows], self.published[tables[rows, at]])
        return bool(copied.any() and numbers[0] >= 0 and (numbers == numbers[0]).all())


def group_shared_prefixes(
    tables: np.ndarray,
    seq_lens: np.ndarray,
    block_size: int,
    max_rows: int,
    x: dict,
    copies: CopiedBlocks | None = None,
) -> int:
    """Write the groups of rows that share leading blocks into the slot's host inputs `x`
    (prefix_lens, group_rows, group_starts, group_prefix, num_groups); returns their number.

    tables [num_seqs, max_blocks] int32 and seq_lens [num_seqs] are the decode rows'. A row never
    shares the block its new token goes to (a published block is never written), so the prefix
    stops before it. E.g. rows 0, 2 and 3 on blocks [7, 8, 9, ...], [7, 8, 5, ...], [7, 8, 9, ...]
    and seq_lens of 3 blocks and more: one group, rows [0, 2, 3], 2 blocks shared.

    With `copies`, where the first block that differs is, in every row, a copy of one cached
    block or that block (the n samples of a block-aligned prompt: each copies its last block
    and computes its last token), the prefix goes on over its first block_size - 1 slots.
    """
    num_seqs = len(seq_lens)
    x["prefix_lens"][:num_seqs] = 0
    x["num_groups"][0] = 0
    if num_seqs < 2:
        return 0
    own = (seq_lens - 1) // block_size  # blocks before the one each row writes
    order = np.argsort(tables[:, 0], kind="stable")
    # E.g. first blocks sorted [3, 7, 7, 7, 9] -> runs [0, 1), [1, 4), [4, 5)
    first = tables[order, 0]
    edges = np.concatenate(([0], np.flatnonzero(first[1:] != first[:-1]) + 1, [num_seqs]))
    runs = [(a, b) for a, b in itertools.pairwise(edges) if b - a >= 2]
    rows_out, starts, prefixes = x["group_rows"], x["group_starts"], x["group_prefix"]
    num_groups, used = 0, 0
    starts[0] = 0
    for a, b in runs:
        rows = order[a:b]
        limit = int(own[rows].min())
        if limit < MIN_SHARED_BLOCKS:
            continue
        same = (tables[rows, :limit] == tables[rows[0], :limit]).all(axis=0)
        shared = limit if same.all() else int(np.argmin(same))
        if shared < MIN_SHARED_BLOCKS:
            continue
        prefix = shared * block_size
        if copies is not None and shared < limit and copies.shared_slots(rows, tables, shared):
            prefix += block_size - 1
        for k in range(0, len(rows), max_rows):
            part = rows[k : k + max_rows]
            if len(part) < 2:
                continue
            rows_out[used : used + len(part)] = part
            used += len(part)
            prefixes[num_groups] = prefix
            num_groups += 1
            starts[num_groups] = used
            x["prefix_lens"][part] = prefix
    x["num_groups"][0] = num_groups
    return num_groups


def shared_kv_tokens(x: dict, num_groups: int) -> int:
    """KV tokens a step with these groups does not read again: (rows - 1) x prefix per group."""
    if not num_groups:
        return 0
    sizes = np.diff(x["group_starts"][: num_groups + 1])
    return int(((sizes - 1) * x["group_prefix"][:num_groups]).sum())
