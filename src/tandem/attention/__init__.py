"""Attention over the paged KV cache, behind one small interface."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

SHARED_PREFIX_ROWS = (
    64  # query rows (sequences x query heads per KV head) of one shared-prefix tile
)


def rows_per_shared_group(num_heads: int, num_kv_heads: int) -> int:
    """Most decode rows one shared-prefix (cascade) program takes; larger groups are cut."""
    return max(1, SHARED_PREFIX_ROWS // (num_heads // num_kv_heads))


@dataclass
class SharedPrefixes:
    """Groups of decode rows whose leading blocks are the same blocks (samples of one prompt, a
    common system prompt): the Triton decode reads each shared block once per group."""

    prefix_lens: torch.Tensor  # [num_seqs] int32, keys the row's group shares; 0: in no group
    group_rows: torch.Tensor  # [num_seqs] int32, the grouped rows, group after group
    group_starts: torch.Tensor  # [max_groups + 1] int32, group g: group_rows[starts[g]:starts[g+1]]
    # [max_groups] int32, keys group g shares: whole blocks, and where its rows copied one cached
    # block on write, that block's first block_size - 1 slots (shared_prefix.py)
    group_prefix: torch.Tensor
    num_groups: torch.Tensor  # [1] int32
    max_groups: int  # a bound on num_groups, for the launch grid


@dataclass
class AttentionMetadata:
    """Where this step's tokens sit in the paged cache; device tensors plus host copies for eager paths."""

    slot_mapping: torch.Tensor  # [num_tokens] int64, cache slot per token, -1 writes nothing
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cu_seqlens of the query tokens
    seq_lens: torch.Tensor  # [num_seqs] int32, context length after this step
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    decode_only: bool  # every sequence has exactly one query token
    query_start_loc_host: list[int] | None = None  # host copies; None inside CUDA graphs
    seq_lens_host: list[int] | None = None
    # [num_seqs] int32: the sequences by context length, longest first (in a step with prefill,
    # of its leading one-token rows only, which the decode kernel takes)
    seq_order: torch.Tensor | None = None
    # decode rows that share leading blocks; None: each row reads its whole context
    shared: SharedPrefixes | None = None


@dataclass
class Unrotated:
    """A decode-only step's q, k and v as the QKV projection made them, handed to a backend
    that norms and rotates them and stores k and v in its decode kernel (`rotates_in_decode`),
    where the decoder would otherwise do it first (`fused.rope_qk`)."""

    q: torch.Tensor  # [num_seqs, num_heads, head_dim], possibly a strided view
    k: torch.Tensor  # [num_seqs, num_kv_heads, head_dim]
    v: torch.Tensor  # [num_seqs, num_kv_heads, head_dim]
    cos_sin: torch.Tensor  # [max_position, head_dim] float32: cos | sin, by position
    slot_mapping: torch.Tensor  # [num_seqs] int, each row's new key's cache slot, -1 none
    q_norm_weight: torch.Tensor | None = None  # [head_dim] per-head RMSNorm (Qwen3), or None
    k_norm_weight: torch.Tensor | None = None
    eps: float = 0.0


@contextlib.contextmanager
def rotated_before(attend) -> Iterator[None]:
    """Within the block, decode-only steps give `attend` q rotated and k and v stored
    (`fused.rope_qk`), as steps with prefill give it their leading decode rows: a warm-up run
    in it compiles the decode kernel those rows take (graph capture compiles the other)."""
    before = getattr(attend, "rotates", None)
    if before is None:
        yield
        return
    attend.rotates = False
    try:
        yield
    finally:
        attend.rotates = before


def rotates_in_decode(attend, meta: AttentionMetadata, kv_cache: torch.Tensor) -> bool:
    """Whether this step's q and k go to `attend` unrotated (`Unrotated`): decode-only steps
    without shared prefixes, where the backend takes them (`takes_unrotated`: the Triton one's)."""
    takes = getattr(attend, "takes_unrotated", None)
    return meta.decode_only and meta.shared is None and takes is not None and takes(meta, kv_cache)


class AttentionBackend(Protocol):
    def __call__(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]; or `Unrotated` (see its doc)
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor | None = None,  # where to write the result (a new tensor if None)
        sliding_window: int | None = None,  # query p sees keys p - sliding_window + 1 .. p
        logits_soft_cap: float | None = None,  # scores s -> cap * tanh(s / cap)
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Attend causally over each sequence's context; this step's K/V are already in the
        cache (the decoder stores them, see `fused.rope_qk`)."""
        ...


def get_backend(
    name: str, num_heads: int, num_kv_heads: int, head_dim: int, max_seqs: int, device: torch.device
) -> AttentionBackend:
    if name == "torch":
        from tandem.attention.torch_ref import torch_attention

        return torch_attention
    if name == "triton":
        from tandem.attention.triton_backend import TritonAttention

        return TritonAttention(num_heads, num_kv_heads, head_dim, max_seqs, device)
    raise ValueError(f"unknown attention_backend {name!r}; supported: 'torch', 'triton'")
