"""Triton attention backend: launches the paged kernels with fixed scratch, so decode is graph-safe."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable
from typing import NamedTuple, TypeVar

import torch
import triton

from tandem import envs, pdl
from tandem.attention import (
    AttentionMetadata,
    SharedPrefixes,
    Unrotated,
    gluon_decode,
    rows_per_shared_group,
)
from tandem.attention.triton_kernels import (
    decode_kernel,
    prefill_kernel,
    reduce_kernel,
    shared_prefix_kernel,
)
from tandem.config import cdiv, next_power_of_2
from tandem.model.fused import num_sms

MAX_SPLITS = 32
SPLIT_MERGE = envs.split_merge()
SPLITS_SETTING = envs.decode_splits()
# decode-only steps' rotary and K/V store in the decode kernel (`Unrotated`; TANDEM_FUSED_ROPE=0:
# the decoder's own kernel first)
FUSED_ROPE = envs.fused_rope()
SHARED_PREFIX_SPLITS = 8  # most splits of one group's shared keys
MAX_HEAD_DIM = 256
NO_WINDOW = 1 << 30  # the kernels' window argument when attention is not windowed


class DecodeTiles(NamedTuple):
    """Launch shape of the decode kernel (`benchmarks/kernels.py --sweep-decode` compares them)."""

    block_n: int = 128  # keys per tile
    num_warps: int = 4
    num_stages: int = 3


class PrefillTiles(NamedTuple):
    """Launch shape of the prefill kernel (`benchmarks/kernels.py --sweep-prefill` compares them)."""

    rows: int = 128  # query rows per program: query tokens x padded GQA group
    block_n: int = 128  # keys per tile
    num_warps: int = 8
    num_stages: int = 3


Tiles = TypeVar("Tiles", DecodeTiles, PrefillTiles)


LARGE_BATCH = 128  # sequences from which a decode batch takes LARGE_BATCH_TILES
# Large batches have ragged contexts, launched longest first: short, light programs even out
# their tail. H200, 256 sequences (BENCHMARKS.md ninth run): Qwen3-0.6B, contexts 100-1,100,
# 148 against 155 µs; Llama-3-8B, 100-1,900, 228 against 235 µs. At 32 x 1K (seed) and at 256
# equal contexts the default tiles are 3-10% faster.
LARGE_BATCH_TILES = DecodeTiles(block_n=64, num_warps=2, num_stages=2)
# The shared-prefix kernel at 5 stages: the block table's entries are loads that the K and V
# copies depend on, so Triton's pipeliner gives each (num_stages - 1) // 2 stages, and from 5 K
# and V are copied two tiles ahead (sm_90 SASS: the key loop's waits leave 3 copy groups in
# flight, against none at 2-4 stages). H200, rollout's decode call (`kernels.py
# --sweep-deep-stages`), µs at 64 / 256 / 500 own keys: 68.7 / 112.2 / 170.1 against 73.1 /
# 116.8 / 175.3 at 2 stages; rollout 19,534 tok/s against 19,403 (session 27). The decode
# kernel's tiles gained nothing from it: their programs share SMs four to six at a time.
SHARED_PREFIX_TILES = DecodeTiles(block_n=64, num_warps=4, num_stages=5)


def decode_tiles_setting() -> DecodeTiles | None:
    """TANDEM_DECODE_TILES: one shape for every decode batch of more than one sequence, for
    comparisons; unset: None (the default shapes)."""
    setting = envs.decode_tiles()
    return None if setting is None else DecodeTiles(*setting)


def decode_launch_options(device: torch.device) -> dict:
    """Compile options of the decode kernel's launches: a register cap from
    TANDEM_DECODE_MAXNREG on CUDA, for comparisons (the interpreter takes none)."""
    cap = envs.decode_maxnreg()
    return {"maxnreg": cap} if cap and device.type == "cuda" else {}


def smaller(tiles: Tiles) -> Tiles | None:
    """The next tile shape to try where a program does not fit the device's shared memory:
    fewer pipeline stages, then fewer keys per tile (None: nothing left to drop)."""
    if tiles.num_stages > 1:
        return tiles._replace(num_stages=tiles.num_stages - 1)
    if tiles.block_n > 16:
        return tiles._replace(block_n=tiles.block_n // 2)
    return None


def launch_fitting(fitted: dict, key, tiles: Tiles, launch: Callable[[Tiles], None]) -> None:
    """launch(tiles), or with the first of smaller(tiles), ... that fits the device, remembered
    in fitted[key]. Triton compiles a kernel at its first launch and raises OutOfResources before
    it enqueues anything when the program asks for more shared memory than a block may have
    (fp32 prefill at head_dim 128 and 128x128 tiles asked for 327,680 bytes on the H200, whose
    limit is 232,448, with 2 or 3 stages alike), so a shape that does not fit costs nothing but
    its compile."""
    tiles = fitted.get(key, tiles)
    while True:
        try:
            launch(tiles)
        except triton.runtime.errors.OutOfResources:
            tiles = smaller(tiles)
            if tiles is None:
                raise
            continue
        fitted[key] = tiles
        return


class TritonAttention:
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        max_seqs: int,
        device: torch.device,
        num_splits: int | None = None,
    ):
        check_head_dim(head_dim)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.head_pad = next_power_of_2(head_dim)  # the kernels' tile width
        self.group = num_heads // num_kv_heads
        self.fixed_splits = num_splits
        self.prefill_tiles = PrefillTiles()
        setting = decode_tiles_setting()
        self.decode_tiles = setting or DecodeTiles()
        self.large_batch_tiles = setting or LARGE_BATCH_TILES
        # one sequence is spread over the SMs by its splits; short tiles give each split work
        # (batch 1 x 512 context: 32-key tiles 5.2 µs, 128-key 7.4 µs, graph-timed on the H200)
        self.single_sequence_tiles = DecodeTiles(block_n=32, num_warps=4, num_stages=1)
        # a group's queries fill a 64-row tile: 64-key tiles keep its registers in bounds
        shared_setting = envs.shared_prefix_tiles()
        self.shared_prefix_tiles = (
            DecodeTiles(*shared_setting) if shared_setting else SHARED_PREFIX_TILES
        )
        self.num_sms = num_sms(device)
        self.decode_options = decode_launch_options(device)
        self.rotates = FUSED_ROPE  # see takes_unrotated
        self.fitted: dict[tuple, DecodeTiles | PrefillTiles] = {}  # see launch_fitting
        # split-KV decode partials: [max_seqs, num_heads, MAX_SPLITS, head_dim] and (max, sum) pairs
        self.partial_out = torch.empty(
            max_seqs, num_heads, MAX_SPLITS, head_dim, dtype=torch.float32, device=device
        )
        self.partial_ml = torch.empty(
            max_seqs, num_heads, MAX_SPLITS, 2, dtype=torch.float32, device=device
        )
        # splits of each sequence's KV head done so far in a launch: [max_seqs, num_kv_heads]
        # int32, zero between launches (the merging split sets it back)
        self.arrivals = torch.zeros(max_seqs, num_kv_heads, dtype=torch.int32, device=device)

    def takes_unrotated(self, meta: AttentionMetadata, kv_cache: torch.Tensor) -> bool:
        """Whether a decode-only step's q, k and v come `Unrotated` (`decode_kernel`'s ROPE):
        with `rotates` (TANDEM_FUSED_ROPE), under LARGE_BATCH rows and not over an FP8 cache.
        H200, one call each, without against with it: moe1 3.01 against 2.94 ms/token, latency
        4.27 against 4.24; small (256 rows) 27,129 / 27,131 against 27,076 / 27,044 tok/s;
        small-fp8kv 33,501 against 31,580 (at the large-batch tiles the e4m3 kernel holds 193
        registers with it, 168 without; sm_90, compiled on the CPU)."""
        rows = meta.seq_lens.shape[0]
        return self.rotates and rows < LARGE_BATCH and kv_cache.element_size() > 1

    def __call__(
        self,
        q: torch.Tensor | Unrotated,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        """`k_scale`, `v_scale`: an FP8 cache's per-tensor scales."""
        rows = q.q if isinstance(q, Unrotated) else q
        out = torch.empty(rows.shape, dtype=rows.dtype, device=rows.device) if out is None else out
        options = {
            "v_scale": v_scale,
            "sliding_window": sliding_window,
            "logits_soft_cap": logits_soft_cap,
        }
        assert out.shape == rows.shape and out.is_contiguous()
        if isinstance(q, Unrotated):
            assert meta.decode_only and meta.shared is None, "unrotated q: decode-only steps"
            self.decode(rows, out, kv_cache, meta, scale * k_scale, new=q, k_scale=k_scale,
                        **options)  # fmt: skip
            return out
        scale *= k_scale  # applied with the softmax scale
        if meta.decode_only:
            self.decode(q, out, kv_cache, meta, scale, **options)
            return out
        # A step with prefill leads with its one-token rows (StepPlan.single_tokens_first). They go
        # to the decode kernel: in the prefill kernel each would fill a tile of query rows to use one.
        decodes = leading_single_tokens(meta.query_start_loc_host)
        if decodes:
            self.decode(q, out, kv_cache, meta, scale, num_seqs=decodes, **options)
        if decodes < len(meta.query_start_loc_host) - 1:
            self.prefill(q, out, kv_cache, meta, scale, first_seq=decodes, **options)
        return out

    def num_splits(self, num_seqs: int) -> int:
        """Splits enough for one program per SM; a batch that fills the device alone is not split.

        Splitting costs a reduce launch and partials written and read back: on the H200 one split
        beats two from batch 32 with 8 KV heads (256 programs on 132 SMs) at contexts up to 1K.
        """
        if self.fixed_splits is not None:
            return self.fixed_splits
        if num_seqs > 1 and SPLITS_SETTING is not None:  # TANDEM_DECODE_SPLITS, comparisons
            return SPLITS_SETTING
        wanted = cdiv(self.num_sms, num_seqs * self.num_kv_heads)
        return min(MAX_SPLITS, next_power_of_2(wanted))

    @staticmethod
    def last_split_merges(num_seqs: int, splits: int) -> bool:
        """Whether the last split of each sequence's KV head to finish merges the partials
        (decode_kernel's MERGE) instead of a reduce launch: batches of several sequences in 2-4
        splits. H200, graph-replayed (`kernels.py --sweep-decode-splits`, µs, reduce / merge):
        Qwen3-30B-A3B 32 x 640 in 2 splits 17.0 / 14.3, 32 x 1,152 29.9 / 27.7, 16 x 640 in 4
        11.9 / 11.5; Llama-3-8B 16 x 1K in 2 25.5 / 24.4. One sequence in many splits lost:
        its 4 or 8 merging programs read up to 32 partials each while the rest of the device
        idles (batch 1 x 400 in 32 splits 4.7 / 12.6, in 4 7.5 / 8.4)."""
        return SPLIT_MERGE and num_seqs > 1 and splits <= 4

    def tiles_for(self, num_seqs: int) -> DecodeTiles:
        if num_seqs == 1:
            return self.single_sequence_tiles
        return self.large_batch_tiles if num_seqs >= LARGE_BATCH else self.decode_tiles

    def decode(
        self,
        q,
        out,
        kv_cache,
        meta: AttentionMetadata,
        scale: float,
        v_scale: float = 1.0,
        num_seqs: int | None = None,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        new: Unrotated | None = None,
        k_scale: float = 1.0,
    ) -> None:
        """The first `num_seqs` sequences (all by default), one query token each, in q's first
        rows. With `new`, q is `new.q` as projected: the kernel norms and rotates it and k and
        stores k and v (`decode_kernel`'s ROPE)."""
        assert q.stride(2) == 1 and q.stride(1) == self.head_dim
        num_seqs = q.shape[0] if num_seqs is None else num_seqs
        splits = self.num_splits(num_seqs)
        shared = meta.shared
        soft_cap = logits_soft_cap or 0.0
        prefix_splits = 0 if shared is None else self.prefix_splits(shared)
        splits = min(splits, MAX_SPLITS - prefix_splits)
        if shared is not None:
            self.shared_prefix(q, kv_cache, meta, scale, v_scale, splits, prefix_splits, soft_cap)
        group_pad = max(16, next_power_of_2(self.group))
        tiles, order = self.tiles_for(num_seqs), meta.seq_order
        prefix_lens = meta.seq_lens if shared is None else shared.prefix_lens
        # one split writes the output: with shared prefixes too, merging their partials itself
        # (without it a reduce launch over every row: rollout, 27 µs a layer on the H200)
        direct = splits == 1
        merge = not direct and shared is None and self.last_split_merges(num_seqs, splits)
        # beside the shared-prefix kernel (see decode_kernel), where its reads come from the L2
        early = direct and shared is not None and kv_cache.element_size() == 2

        # an FP8 cache's large batches: the Gluon kernel. H200, graph-replayed, µs against this
        # module's kernel (session 36): small's 256 x 100-1,100 86.0 / 110.6, 256 x 100-2,000
        # 138.8 / 175.5, 256 x 600 91.5 / 122.1, Llama-3-8B's 256 x 1K 145.2 / 187.8; seed's
        # 32 x 1K (256 one-warp programs) 30.8 / 30.6 and, before its copies took whole rows,
        # 36.2 / 30.6: smaller batches keep this kernel. With shared prefixes it merges their
        # partials: rollout's call over e4m3 at 64 / 256 / 500 own keys 73.5 / 98.7 / 130.5
        # against 71.0 / 106.5 / 152.0 (session 37)
        plain = new is None and not sliding_window and not soft_cap
        if num_seqs >= LARGE_BATCH and gluon_decode.takes(
            q, kv_cache, self.head_dim, self.group, splits, plain
        ):
            cascade = None
            if shared is not None:  # its keys by 16-byte copies over either cache: early start
                cascade = (self.partial_out, self.partial_ml, prefix_lens, prefix_splits)
            gluon_decode.decode(
                q, out, kv_cache, meta.block_tables, meta.seq_lens, order, num_seqs,
                self.num_kv_heads, self.group, scale, v_scale, pdl.launch_args(q.device),
                cascade=cascade, early_start=cascade is not None,
            )  # fmt: skip
            return
        rope = new_key_arguments(new, q, k_scale)

        def launch(tiles: DecodeTiles) -> None:
            decode_kernel[(self.num_kv_heads, num_seqs, splits)](
                q, out, self.partial_out, self.partial_ml, kv_cache, meta.block_tables,
                meta.seq_lens, meta.seq_lens if order is None else order, prefix_lens,
                self.arrivals, q.stride(0), meta.block_tables.stride(0), kv_cache.stride(0),
                scale, v_scale, splits, prefix_splits, sliding_window or NO_WINDOW, *rope,
                GROUP=self.group, GROUP_PAD=group_pad,
                NUM_KV_HEADS=self.num_kv_heads, HEAD_DIM=self.head_dim, HEAD_PAD=self.head_pad,
                BLOCK_SIZE=kv_cache.shape[2], BLOCK_N=tiles.block_n, MAX_SPLITS=MAX_SPLITS,
                SOFT_CAP=soft_cap, DIRECT=direct, ORDERED=order is not None,
                CASCADE=shared is not None, EARLY_START=early, MERGE=merge,
                ROPE=new is not None, HAS_NORM=new is not None and new.q_norm_weight is not None,
                num_warps=tiles.num_warps, num_stages=tiles.num_stages, **self.decode_options, **pdl.launch_args(q.device),
            )  # fmt: skip

        launch_fitting(self.fitted, (tiles, q.dtype, kv_cache.dtype), tiles, launch)
        if direct or merge:
            return
        reduce_kernel[(num_seqs * self.num_heads,)](
            self.partial_out, self.partial_ml, out, prefix_lens, splits, prefix_splits,
            NUM_HEADS=self.num_heads, HEAD_DIM=self.head_dim, HEAD_PAD=self.head_pad,
            MAX_SPLITS=MAX_SPLITS, CASCADE=shared is not None, **pdl.launch_args(q.device),
        )  # fmt: skip

    def prefix_splits(self, shared: SharedPrefixes) -> int:
        """Splits of each group's shared keys: enough to spread the groups over the SMs. (More
        were slower: rollout on the H200 ran at 18,706 tok/s with about four programs per SM,
        19,564 with this, in one call.)"""
        groups = cdiv(shared.max_groups, 2)  # a guess: graphs' bounds are twice what most meet
        wanted = cdiv(self.num_sms, groups * self.num_kv_heads)
        return min(SHARED_PREFIX_SPLITS, next_power_of_2(wanted))

    def shared_prefix(
        self,
        q,
        kv_cache,
        meta: AttentionMetadata,
        scale: float,
        v_scale: float,
        first_split: int,
        splits: int,
        soft_cap: float,
    ) -> None:
        """Partials of each group over its shared keys, at splits [first_split, + splits) of its
        rows, after the rows' own."""
        shared = meta.shared
        rows = rows_per_shared_group(self.num_heads, self.num_kv_heads) * self.group
        grid = (self.num_kv_heads, shared.max_groups, splits)

        def launch(tiles: DecodeTiles) -> None:
            shared_prefix_kernel[grid](
                q, self.partial_out, self.partial_ml, kv_cache, meta.block_tables,
                shared.group_rows, shared.group_starts, shared.group_prefix, shared.num_groups,
                q.stride(0), meta.block_tables.stride(0), kv_cache.stride(0), scale, v_scale,
                first_split, GROUP=self.group, NUM_KV_HEADS=self.num_kv_heads,
                HEAD_DIM=self.head_dim, HEAD_PAD=self.head_pad, BLOCK_SIZE=kv_cache.shape[2],
                BLOCK_N=tiles.block_n, SOFT_CAP=soft_cap, MAX_SPLITS=MAX_SPLITS,
                ROWS=max(16, next_power_of_2(rows)), num_warps=tiles.num_warps,
                num_stages=tiles.num_stages, **pdl.launch_args(q.device),
            )  # fmt: skip

        tiles = self.shared_prefix_tiles
        launch_fitting(self.fitted, ("shared", tiles, q.dtype, kv_cache.dtype), tiles, launch)

    def prefill(
        self,
        q,
        out,
        kv_cache,
        meta: AttentionMetadata,
        scale: float,
        v_scale: float = 1.0,
        first_seq: int = 0,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        """Sequences from `first_seq` on, any number of query tokens each."""
        starts = meta.query_start_loc_host
        assert starts is not None, "prefill needs host query lengths (it runs eagerly)"
        assert q.stride(2) == 1 and q.stride(1) == self.head_dim
        max_query_len = max(b - a for a, b in itertools.pairwise(starts[first_seq:]))
        group_pad = next_power_of_2(self.group)
        block_m = max(1, self.prefill_tiles.rows // group_pad)
        grid = (len(starts) - 1 - first_seq, cdiv(max_query_len, block_m), self.num_kv_heads)

        def launch(tiles: PrefillTiles) -> None:
            prefill_kernel[grid](
                q, out, kv_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                first_seq, q.stride(0), meta.block_tables.stride(0), kv_cache.stride(0), scale,
                v_scale, sliding_window or NO_WINDOW, GROUP=self.group, GROUP_PAD=group_pad,
                NUM_KV_HEADS=self.num_kv_heads, HEAD_DIM=self.head_dim, HEAD_PAD=self.head_pad,
                BLOCK_SIZE=kv_cache.shape[2], BLOCK_M=block_m, BLOCK_N=tiles.block_n,
                SOFT_CAP=logits_soft_cap or 0.0, num_warps=tiles.num_warps,
                num_stages=tiles.num_stages, **pdl.launch_args(q.device),
            )  # fmt: skip

        key = (self.prefill_tiles, q.dtype, kv_cache.dtype)
        launch_fitting(self.fitted, key, self.prefill_tiles, launch)


def new_key_arguments(new: Unrotated | None, q: torch.Tensor, k_scale: float) -> tuple:
    """decode_kernel's arguments k_ptr .. k_scale: those of `new`, or placeholders without it."""
    if new is None:
        return (q, q, 0, 0, q, q, q, q, 0.0, 1.0)
    assert new.k.stride(2) == 1 and new.v.stride(2) == 1 and new.cos_sin.is_contiguous()
    norms = (new.q_norm_weight, new.k_norm_weight) if new.q_norm_weight is not None else (q, q)
    return (
        new.k, new.v, new.k.stride(0), new.v.stride(0), new.slot_mapping, new.cos_sin, *norms,
        new.eps, k_scale,
    )  # fmt: skip


def check_head_dim(head_dim: int) -> None:
    """ValueError unless the Triton kernels take `head_dim` (16 to 256, any size: padded tiles)."""
    if not isinstance(head_dim, int) or not 16 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(
            f"the triton attention backend takes head_dim 16 to {MAX_HEAD_DIM}, got {head_dim!r}; "
            "use attention_backend='torch'"
        )


def leading_single_tokens(starts: list[int]) -> int:
    """How many sequences at the front of a step have one query token each, from the step's
    query start offsets: [0, 1, 2, 5, 6] -> 2 (the fourth sequence's one token comes after a
    longer one, so it stays with the prefill). starts[k] == k holds up to that count and never
    after it, so a binary search finds it: each layer asks, and a step may lead with 256 rows."""
    return bisect.bisect_left(range(1, len(starts)), True, key=lambda k: starts[k] > k)
