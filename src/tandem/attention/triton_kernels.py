"""Triton kernels over the paged KV cache: prefill (ragged, causal) and split-KV decode.

Cache layout per layer: [2, num_blocks + 1, block_size, num_kv_heads, head_dim]. Keys and
values are read a tile of BLOCK_N positions at a time, each position's block looked up in the
block table, so any block size works. The query heads that share a KV head are processed by
one program as extra rows of the same tile (GQA packing), so the tiles feed tensor cores.

Any head size up to 256: tiles are HEAD_PAD = the next power of two wide, the dimensions past
HEAD_DIM loaded as zeros and never stored (no mask at all where the two are equal). A sliding
window (query p sees keys p - window + 1 .. p) starts each program's key loop at the window's
first tile, so keys outside it are never read; a soft cap maps scores s to cap * tanh(s / cap)
before the softmax.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tandem import envs, pdl
from tandem.model.fused import fp8_range, normed_rotated

# Triton's CPU interpreter (the tests without a GPU), which runs no inline PTX; it is chosen
# when the kernels are defined, as here
INTERPRETED = tl.constexpr(triton.knobs.runtime.interpret)
# V tiles of an FP8 cache widen to float16 by integer bit operations (TANDEM_FP8_V_BITS=0: cvt)
V_BITS = tl.constexpr(envs.fp8_v_bits())
# An e4m3 byte b read as the float16 with bits (b & 0x80) << 8 | (b & 0x7f) << 7 is b's value
# / 256, exactly (subnormals included; e4m3's NaN, never stored, would read as a finite value):
# two byte permutes, then a shift and masks per pair, all on the integer pipes.
E4M3_BITS_SCALE = tl.constexpr(256.0)
_E4M3_BITS_ASM = tl.constexpr(
    "{ .reg .b32 a, b, s, t;"
    " prmt.b32 a, $2, 0, 0x1404; prmt.b32 b, $2, 0, 0x3424;"
    " shr.b32 s, a, 1; and.b32 s, s, 0x3F803F80; and.b32 a, a, 0x80008000; or.b32 $0, a, s;"
    " shr.b32 t, b, 1; and.b32 t, t, 0x3F803F80; and.b32 b, b, 0x80008000; or.b32 $1, b, t; }"
)


@triton.jit
def _product_dtype(q, cache_ptr):
    """q in the dtype the tiles' products take: an FP8 cache under a bfloat16 model computes in
    float16, which holds every e4m3 value and a bfloat16 query's 8 significant bits exactly
    (while |q| < 65,504) and which e4m3 converts to in hardware, a pair at a time; otherwise
    q's own dtype. H200, small's decode shape (256 ragged contexts, 16 heads over 8 KV heads):
    120.7 µs against 168.0 with bfloat16 products (an earlier call; 158.6 over a bfloat16 cache
    in the same one). Scores as e4m3 products, the keys never converted and q in two e4m3
    parts with a scale per row each (one part was too coarse), took 131.5 µs."""
    if cache_ptr.dtype.element_ty == tl.float8e4nv and q.dtype == tl.bfloat16:
        q = q.to(tl.float16)
    return q


@triton.jit
def _cache_tile_as(x, q):
    """A K or V tile [BLOCK_N, HEAD_PAD] of the cache in q's dtype. An e4m3 tile to float16 by
    PTX's cvt.rn.f16x2.e4m3x2 (exact), as inline asm with side effects: Triton moves a `.to()`
    or pure asm conversion after the tile's change to the layout of a dot operand, and for V
    (p @ v: the keys are the dot's K dimension, 128 bytes apart in the cache) each thread then
    read the e4m3 tile from shared memory a byte at a time. The asm is a barrier it does not
    move across: the float16 tile goes to the dot through shared memory and ldmatrix.trans, as
    a bfloat16 cache's V does. sm_90 SASS of decode_kernel, small's shape at block_n 64, 2
    warps, 2 stages, with V through here: LDS.U8 384 before, none after; 6,687 instructions
    against 4,376; 255 registers against 190. K's dot reads 4 contiguous bytes a thread
    anyway; K through here too: 4,170 instructions, 226 registers, 53 KB of shared memory
    against 39 (fewer programs fit an SM).

    With V_BITS (the default) V's e4m3 bytes widen by bit operations instead: the cvt
    instructions halve, and the conversion of V no longer waits on their pipe (sm_90: 168
    registers against 190). H200, graph-replayed: small's ragged decode shapes 111.7 / 177.2 µs
    against 119.6 / 190.5 with cvt; its uniform 256 x 600 123.0 against 121.5, and Llama-3-8B's
    256 x 1K 189.3 against 185.5. K by bits too, or half of V's pairs by each, gained nothing.

    Not kept: the cache holding each block's V transposed ([kv_heads, head_dim, block_size]), so
    that V widens in the registers the products read, as K does, with no float16 tile through
    shared memory (no ldmatrix.trans). Its kernel held 221 registers against 168 (4 programs an
    SM against 5; sm_90, compiled on the CPU): small's ragged shapes took 123.2 / 193.8 µs
    against 111.7 / 177.4, small-fp8kv ran 30,748 tok/s against 33,597-33,621 (H200, session
    26)."""
    if x.dtype == tl.float8e4nv and q.dtype == tl.float16 and not INTERPRETED and V_BITS:
        return tl.inline_asm_elementwise(  # the values / 256 (`_v_factor`)
            _E4M3_BITS_ASM, "=r,=r,r", [x], dtype=tl.float16, is_pure=False, pack=4
        )
    if x.dtype == tl.float8e4nv and q.dtype == tl.float16 and not INTERPRETED:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2;"
            " cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r",
            [x],
            dtype=tl.float16,
            is_pure=False,
            pack=4,
        )
    return x.to(q.dtype)


@triton.jit
def _v_factor(cache_ptr, q):
    """256 where V tiles of this cache widen by bits (their values come out / 256), else 1."""
    fp8 = cache_ptr.dtype.element_ty == tl.float8e4nv
    if fp8 and q.dtype == tl.float16 and V_BITS and not INTERPRETED:
        return E4M3_BITS_SCALE
    return 1.0


@triton.jit
def _attend_tile(
    q,  # [ROWS, HEAD_DIM]
    row_max,  # [ROWS] running max, in log2 units
    row_sum,  # [ROWS] running sum
    acc,  # [ROWS, HEAD_DIM] running numerator
    cache_ptr,
    table_ptr,  # this sequence's block table row
    kv_half_stride,
    kv_head,
    key_start,
    query_pos,  # [ROWS] position of each row's query token (keys past it are masked)
    seq_len,
    window,  # keys more than window - 1 before a row's query are masked (1 << 30: no window)
    scale,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,  # HEAD_DIM's next power of two: the tile width
    BLOCK_N: tl.constexpr,
    SOFT_CAP: tl.constexpr,  # 0.0: none
    MASKED: tl.constexpr,  # False when every key of the tile is in the sequence and visible to every row
):
    """One online-softmax update over keys [key_start, key_start + BLOCK_N)."""
    key_pos = key_start + tl.arange(0, BLOCK_N)
    in_seq = key_pos < seq_len
    # Triton's pipeliner gives these loads of the block table and the K and V copies whose
    # addresses they make (num_stages - 1) // 2 stages each, the table's as 4-byte copies to
    # shared memory: at 2-4 stages K and V are copied one tile ahead and each key loop's wait
    # drains every copy group in flight (sm_90 SASS: DEPBAR.LE SB0, 0x0), so a tile loads only
    # while the one before it is computed (Nsight Compute, moe's shape: 38% of the stall samples
    # at that wait). From 5 stages they are copied two tiles ahead and the waits leave groups in
    # flight: `SHARED_PREFIX_TILES` takes 5; the decode kernel's tiles at 5-7 stages gained
    # nothing on small, small-fp8kv or seed (H200, session 27). Loaded in registers instead
    # (ld.global.nc by inline asm), the 3-stage waits kept two groups in flight (0x2), but each
    # key's entry was a load of its own: seed's 32 x 1K took 49.2 µs against 37.6, Llama-3-8B's
    # 256 x 1K 270.7 against 250.6. One load a block, broadcast to its keys: moe's 32 x 640 22.0
    # against 14.3 and seed's 47.2 against 37.4 (each tile's copies then wait for a load on the
    # program's own path), small's bf16 shapes 1-2% faster and its e4m3 ones 9% slower (H200,
    # session 26).
    if MASKED:
        block = tl.load(table_ptr + key_pos // BLOCK_SIZE, mask=in_seq, other=0).to(tl.int64)
    else:
        block = tl.load(table_ptr + key_pos // BLOCK_SIZE).to(tl.int64)
    slot = block * BLOCK_SIZE + key_pos % BLOCK_SIZE
    dims = tl.arange(0, HEAD_PAD)
    offsets = (slot * NUM_KV_HEADS + kv_head)[:, None] * HEAD_DIM + dims[None, :]
    if MASKED:
        kv_mask = in_seq[:, None] & (dims < HEAD_DIM)[None, :]
        k = tl.load(cache_ptr + offsets, mask=kv_mask, other=0.0)
        v = tl.load(cache_ptr + kv_half_stride + offsets, mask=kv_mask, other=0.0)
    elif HEAD_PAD != HEAD_DIM:
        k = tl.load(cache_ptr + offsets, mask=(dims < HEAD_DIM)[None, :], other=0.0)
        v = tl.load(
            cache_ptr + kv_half_stride + offsets, mask=(dims < HEAD_DIM)[None, :], other=0.0
        )
    else:
        k = tl.load(cache_ptr + offsets)
        v = tl.load(cache_ptr + kv_half_stride + offsets)
    # an FP8 cache's e4m3 values are exact in q's dtype (`_product_dtype`); their scales are
    # applied outside (k_scale within the softmax scale, v_scale on the output)
    k, v = k.to(q.dtype), _cache_tile_as(v, q)
    if q.dtype == tl.float32:  # float32 models: exact products, not TF32 (a static branch)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [ROWS, BLOCK_N] float32
    else:
        s = tl.dot(q, tl.trans(k)) * scale
    if SOFT_CAP > 0.0:  # cap * tanh(s / cap), tanh(x) = 1 - 2 / (exp(2x) + 1)
        s = SOFT_CAP * (1.0 - 2.0 / (tl.exp(s * (2.0 / SOFT_CAP)) + 1.0))
    s = s * 1.4426950408889634  # log2 units, so exp2 does the exponent
    if MASKED:
        visible = in_seq[None, :] & (key_pos[None, :] <= query_pos[:, None])
        visible = visible & (key_pos[None, :] > query_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(row_max, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(row_max - m_safe)
    row_sum = row_sum * alpha + tl.sum(p, axis=1)
    if q.dtype == tl.float32:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:  # v / 256 where widened by bits: p * 256 <= 256, as precise as p (else p * 1)
        acc = acc * alpha[:, None] + tl.dot((p * _v_factor(cache_ptr, q)).to(q.dtype), v)
    return m_new, row_sum, acc


@triton.jit
def _merge_partials(
    row_max,  # [ROWS] log2 units
    row_sum,  # [ROWS]
    acc,  # [ROWS, HEAD_PAD]
    partial_out_ptr,
    partial_ml_ptr,
    first,  # [ROWS] int64: each row's first partial to merge (its index in the partials' rows)
    count,
    row_valid,
    row_dims,
    dims,
    HEAD_DIM: tl.constexpr,
    CACHE: tl.constexpr,  # the loads' cache modifier: ".cg" for partials of this launch
):
    """The online softmax's state after `count` more partials of the same rows (as
    `reduce_kernel` merges them, one at a time)."""
    for i in range(count):
        at = first + i
        part_max = tl.load(
            partial_ml_ptr + at * 2, mask=row_valid, other=float("-inf"), cache_modifier=CACHE
        )
        part_sum = tl.load(
            partial_ml_ptr + at * 2 + 1, mask=row_valid, other=0.0, cache_modifier=CACHE
        )
        part_acc = tl.load(
            partial_out_ptr + at[:, None] * HEAD_DIM + dims[None, :],
            mask=row_dims,
            other=0.0,
            cache_modifier=CACHE,
        )
        m_new = tl.maximum(row_max, part_max)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        ours, theirs = tl.exp2(row_max - m_safe), tl.exp2(part_max - m_safe)
        row_sum = row_sum * ours + part_sum * theirs
        acc = acc * ours[:, None] + part_acc * theirs[:, None]
        row_max = m_new
    return row_max, row_sum, acc


# Triton compiles a kernel once per class of each int argument (1, a multiple of 16, other). The
# values that change from step to step are left out of that, so that eager steps of any shape
# run the kernels compiled before. (On a fresh Triton cache, kernels first met in mixed steps
# made the small workload's first timed run 0.9 s slower on the H200: BENCHMARKS.md.)
@triton.jit(do_not_specialize=["first_seq"])
def prefill_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim], heads contiguous
    out_ptr,  # same shape, contiguous
    cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    first_seq,  # the sequences before it are left to the decode kernel
    q_token_stride,
    block_table_stride,
    kv_half_stride,
    scale,  # of the softmax, times an FP8 cache's k_scale
    v_scale,  # an FP8 cache's V scale (1.0 otherwise)
    window,  # sliding window in tokens (1 << 30: none)
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # next power of two
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query tokens per program; rows = BLOCK_M * GROUP_PAD
    BLOCK_N: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.wait(PDL)
    seq = first_seq + tl.program_id(0)
    tile = tl.num_programs(1) - 1 - tl.program_id(1)  # the longest (last) tiles start first
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if tile * BLOCK_M < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        # row r is query token tile * BLOCK_M + r // GROUP_PAD, head kv_head * GROUP + r % GROUP_PAD
        rows = tl.arange(0, BLOCK_M * GROUP_PAD)
        token = tile * BLOCK_M + rows // GROUP_PAD
        head = kv_head * GROUP + rows % GROUP_PAD
        row_valid = (token < q_len) & (rows % GROUP_PAD < GROUP)
        dims = tl.arange(0, HEAD_PAD)
        row_dims = row_valid[:, None] & (dims < HEAD_DIM)[None, :]
        token_offset = (q_start + token).to(tl.int64)
        q_offsets = (token_offset * q_token_stride + head * HEAD_DIM)[:, None] + dims[None, :]
        q = _product_dtype(tl.load(q_ptr + q_offsets, mask=row_dims, other=0.0), cache_ptr)
        query_pos = seq_len - q_len + token
        row_max = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), tl.float32)
        row_sum = tl.zeros([BLOCK_M * GROUP_PAD], tl.float32)
        acc = tl.zeros([BLOCK_M * GROUP_PAD, HEAD_PAD], tl.float32)
        table = block_tables_ptr + seq.to(tl.int64) * block_table_stride
        # Keys [first_query - window + 1, first_query] cover the tile's first row; of them,
        # those in the window of its last row too are visible to every row: no mask there.
        # Before them (the window's edge) and after (the causal diagonal) tiles are masked;
        # tiles before the first row's window are never read. E.g. BLOCK_N 16, window 40,
        # queries 50-65: masked [0, 32), unmasked [32, 48), masked [48, 66).
        first_query = seq_len - q_len + tile * BLOCK_M
        last_query = tl.minimum(first_query + BLOCK_M, seq_len) - 1
        window_start = tl.maximum(first_query - window + 1, 0) // BLOCK_N * BLOCK_N
        unmasked_start = tl.cdiv(tl.maximum(last_query - window + 1, 0), BLOCK_N) * BLOCK_N
        unmasked_end = (first_query + 1) // BLOCK_N * BLOCK_N
        for key_start in range(window_start, tl.minimum(unmasked_start, unmasked_end), BLOCK_N):
            row_max, row_sum, acc = _attend_tile(
                q, row_max, row_sum, acc, cache_ptr, table, kv_half_stride, kv_head, key_start,
                query_pos, seq_len, window, scale, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, HEAD_PAD,
                BLOCK_N, SOFT_CAP, True,
            )  # fmt: skip
        for key_start in range(unmasked_start, unmasked_end, BLOCK_N):
            row_max, row_sum, acc = _attend_tile(
                q, row_max, row_sum, acc, cache_ptr, table, kv_half_stride, kv_head, key_start,
                query_pos, seq_len, window, scale, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, HEAD_PAD,
                BLOCK_N, SOFT_CAP, False,
            )  # fmt: skip
        for key_start in range(unmasked_end, last_query + 1, BLOCK_N):
            row_max, row_sum, acc = _attend_tile(
                q, row_max, row_sum, acc, cache_ptr, table, kv_half_stride, kv_head, key_start,
                query_pos, seq_len, window, scale, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, HEAD_PAD,
                BLOCK_N, SOFT_CAP, True,
            )  # fmt: skip
        out = acc * v_scale / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
        out_offsets = (token_offset * (GROUP * NUM_KV_HEADS * HEAD_DIM) + head * HEAD_DIM)[:, None]
        out_ptrs = out_ptr + out_offsets + dims[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_dims)


@triton.jit(do_not_specialize=["num_splits", "num_prefix_splits"])  # per step: see prefill_kernel
def decode_kernel(
    q_ptr,  # [num_seqs, num_heads, head_dim]
    out_ptr,  # [num_seqs, num_heads, head_dim], written here when DIRECT
    partial_out_ptr,  # [num_seqs, num_heads, MAX_SPLITS, head_dim] float32
    partial_ml_ptr,  # [num_seqs, num_heads, MAX_SPLITS, 2] float32: running max (log2), sum
    cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    seq_order_ptr,  # [num_seqs] int32: the sequences in launch order (longest first), if ORDERED
    prefix_lens_ptr,  # [num_seqs] int32: leading keys shared_prefix_kernel covers, if CASCADE
    arrivals_ptr,  # [max_seqs, num_kv_heads] int32, zeros between launches: splits done, if MERGE
    q_token_stride,
    block_table_stride,
    kv_half_stride,
    scale,  # of the softmax, times an FP8 cache's k_scale
    v_scale,  # an FP8 cache's V scale (1.0 otherwise)
    num_splits,
    num_prefix_splits,  # shared_prefix_kernel's partials of a grouped row, after its own split
    window,  # sliding window in tokens (1 << 30: none)
    k_ptr,  # with ROPE: this step's k and v [num_seqs, NUM_KV_HEADS, HEAD_DIM] (strided rows)
    v_ptr,
    k_token_stride,
    v_token_stride,
    slot_ptr,  # [num_seqs] int: the cache slot of each row's new key (-1: none, padding)
    cos_sin_ptr,  # [max_position, HEAD_DIM] float32: cos | sin
    q_norm_ptr,  # [HEAD_DIM] per-head RMSNorm weights of q and k, with HAS_NORM
    k_norm_ptr,
    eps,
    k_scale,  # an FP8 cache stores k / k_scale and v / v_scale (1.0 otherwise)
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,  # >= 16 rows for tl.dot
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    DIRECT: tl.constexpr,  # one split: normalize and write the output, no reduce step
    ORDERED: tl.constexpr,
    CASCADE: tl.constexpr,  # keys before prefix_lens[seq] are left to shared_prefix_kernel
    EARLY_START: tl.constexpr,  # DIRECT with CASCADE: run beside shared_prefix_kernel, see below
    MERGE: tl.constexpr,  # not DIRECT: the last split of a sequence's KV head to finish merges
    ROPE: tl.constexpr,  # q is as projected: normed and rotated here, k and v stored here
    HAS_NORM: tl.constexpr,
    PDL: tl.constexpr,
):
    """Split s of a sequence covers an equal share of the key tiles in its window (past its
    shared prefix, with CASCADE); `reduce_kernel` merges them, or with MERGE the last of them to
    finish (counted in `arrivals`, which it sets back to zero), with no launch of its own.
    DIRECT with CASCADE: the one split merges the shared prefix's partials of its rows itself,
    which shared_prefix_kernel wrote before this launch began (the PDL wait orders it after
    that kernel).

    Programs start in grid order, the KV heads of one sequence together, sequences in
    `seq_order`: longest first, so a ragged batch does not end on one long sequence's programs
    running alone.

    EARLY_START: shared_prefix_kernel lets this kernel start beside it, so the rows' own keys are
    read while it reads the shared ones; the wait comes before the merge of its partials. The
    keys and queries read before it were written before that kernel began (its programs have
    all passed their own wait when this one starts), and they are read from the L2 (queries
    `.cg`, keys by 16-byte copies: a 16-bit cache).

    ROPE (decode-only steps without shared prefixes): q, k and v come as the QKV projection
    made them. Each program norms and rotates its rows' q as `fused.rope_qk` does (by position
    seq_len - 1), and the one whose split holds that position stores the new k and v at the
    row's slot (the block table's slot of that position, as the engine maps them), then waits
    at a barrier of its threads before it reads a tile: the key is read back by the program
    that stored it, and by no other. One launch a layer less.
    """
    if not EARLY_START:
        pdl.wait(PDL)
    kv_head = tl.program_id(0)
    seq = tl.program_id(1)
    if ORDERED:
        seq = tl.load(seq_order_ptr + seq)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    first_key = tl.maximum(seq_len - window, 0)  # the query at seq_len - 1 sees keys from here
    # keys are read from key_base on, in tiles of BLOCK_N: 0, or the end of a shared prefix
    # (the engine groups no rows of windowed models, so the window then starts at 0)
    key_base = tl.load(prefix_lens_ptr + seq) if CASCADE else 0
    window_tile = first_key // BLOCK_N
    num_tiles = tl.cdiv(seq_len - key_base, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles - window_tile, num_splits)
    first_tile = window_tile + split * tiles_per_split
    last_tile = tl.minimum(first_tile + tiles_per_split, num_tiles)
    rows = tl.arange(0, GROUP_PAD)
    head = kv_head * GROUP + rows
    row_valid = rows < GROUP
    dims = tl.arange(0, HEAD_PAD)
    row_dims = row_valid[:, None] & (dims < HEAD_DIM)[None, :]
    q_rows = q_ptr + seq.to(tl.int64) * q_token_stride + head * HEAD_DIM
    if ROPE:
        position = seq_len - 1
        q = normed_rotated(
            q_rows, row_valid, dims, position, cos_sin_ptr, q_norm_ptr, eps, HEAD_DIM, HAS_NORM
        )
        # the program whose keys hold the new one stores it, before any of its tiles is read
        _store_new_key(
            k_ptr + seq.to(tl.int64) * k_token_stride + kv_head * HEAD_DIM,
            v_ptr + seq.to(tl.int64) * v_token_stride + kv_head * HEAD_DIM, cache_ptr,
            kv_half_stride, tl.load(slot_ptr + seq).to(tl.int64), dims, position, cos_sin_ptr,
            k_norm_ptr, eps, k_scale, v_scale,
            (first_tile * BLOCK_N <= position) & (position < last_tile * BLOCK_N), NUM_KV_HEADS,
            kv_head, HEAD_DIM, HAS_NORM,
        )  # fmt: skip
        tl.debug_barrier()  # every thread's stores visible to the program's loads after it
    else:
        q = tl.load(q_rows[:, None] + dims[None, :], mask=row_dims, other=0.0, cache_modifier=".cg")
    q = _product_dtype(q, cache_ptr)
    query_pos = tl.full([GROUP_PAD], seq_len - 1, tl.int32)
    row_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    row_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_PAD], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * block_table_stride
    # masked: the tile the window starts inside of and the tile past the last full one
    unmasked_first = tl.cdiv(first_key, BLOCK_N)
    full_tiles = (seq_len - key_base) // BLOCK_N  # tiles with no position past the end
    for t in range(first_tile, tl.minimum(last_tile, tl.minimum(unmasked_first, full_tiles))):
        row_max, row_sum, acc = _attend_tile(
            q, row_max, row_sum, acc, cache_ptr, table, kv_half_stride, kv_head, key_base + t * BLOCK_N, query_pos,
            seq_len, window, scale, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, HEAD_PAD, BLOCK_N, SOFT_CAP,
            True,
        )  # fmt: skip
    for t in range(tl.maximum(first_tile, unmasked_first), tl.minimum(last_tile, full_tiles)):
        row_max, row_sum, acc = _attend_tile(
            q, row_max, row_sum, acc, cache_ptr, table, kv_half_stride, kv_head, key_base + t * BLOCK_N, query_pos,
            seq_len, window, scale, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, HEAD_PAD, BLOCK_N, SOFT_CAP,
            False,
        )  # fmt: skip
    for t in range(tl.maximum(first_tile, full_tiles), last_tile):
        row_max, row_sum, acc = _attend_tile(
            q, row_max, row_sum, acc, cache_ptr, table, kv_half_stride, kv_head, key_base + t * BLOCK_N, query_pos,
            seq_len, window, scale, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, HEAD_PAD, BLOCK_N, SOFT_CAP,
            True,
        )  # fmt: skip
    acc = acc * v_scale
    if EARLY_START:  # shared_prefix_kernel's partials (every program waits: see pdl.py)
        pdl.wait(PDL)
    if DIRECT:
        row = seq.to(tl.int64) * (GROUP * NUM_KV_HEADS) + head
        if key_base > 0:  # a grouped row (CASCADE): its prefix partials follow its own split
            row_max, row_sum, acc = _merge_partials(
                row_max, row_sum, acc, partial_out_ptr, partial_ml_ptr, row * MAX_SPLITS + 1,
                num_prefix_splits, row_valid, row_dims, dims, HEAD_DIM, "",
            )  # fmt: skip
        _store_output(out_ptr, row, acc, row_sum, row_dims, dims, HEAD_DIM)
    else:
        base = (seq.to(tl.int64) * (GROUP * NUM_KV_HEADS) + head) * MAX_SPLITS + split
        tl.store(partial_out_ptr + base[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_dims)
        tl.store(partial_ml_ptr + base * 2, row_max, mask=row_valid)
        tl.store(partial_ml_ptr + base * 2 + 1, row_sum, mask=row_valid)
        if MERGE:
            _fence()  # each thread's partials visible on the device before the count
            tl.debug_barrier()
            arrival = arrivals_ptr + seq * NUM_KV_HEADS + kv_head
            if tl.atomic_add(arrival, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
                _fence()  # the other splits' partials, read from the L2 (.cg)
                tl.store(arrival, 0)
                row = seq.to(tl.int64) * (GROUP * NUM_KV_HEADS) + head
                row_max, row_sum, acc = _merge_partials(
                    tl.full([GROUP_PAD], float("-inf"), tl.float32),
                    tl.zeros([GROUP_PAD], tl.float32), tl.zeros([GROUP_PAD, HEAD_PAD], tl.float32),
                    partial_out_ptr, partial_ml_ptr, row * MAX_SPLITS, num_splits, row_valid,
                    row_dims, dims, HEAD_DIM, ".cg",
                )  # fmt: skip
                _store_output(out_ptr, row, acc, row_sum, row_dims, dims, HEAD_DIM)


@triton.jit
def _store_output(out_ptr, row, acc, row_sum, row_dims, dims, HEAD_DIM: tl.constexpr):
    """The rows' attention, acc / row_sum (0 where no key was seen), at their output rows."""
    out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
    tl.store(
        out_ptr + row[:, None] * HEAD_DIM + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_dims,
    )


@triton.jit
def _store_new_key(
    k_row_ptr, v_row_ptr, cache_ptr, kv_half_stride, slot, dims, position, cos_sin_ptr,
    k_norm_ptr, eps, k_scale, v_scale, holds, NUM_KV_HEADS: tl.constexpr, kv_head,
    HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr,
):  # fmt: skip
    """This step's key (normed, rotated) and value of one KV head stored at `slot` as rope_qk
    stores them (an FP8 cache: k / k_scale and v / v_scale, saturated), where `holds` (the
    program's keys hold its position) and the slot is one (-1: padding)."""
    one = tl.arange(0, 1)
    k = normed_rotated(
        k_row_ptr + one, one == 0, dims, position, cos_sin_ptr, k_norm_ptr, eps, HEAD_DIM,
        HAS_NORM,
    )  # fmt: skip
    in_head = (dims < HEAD_DIM)[None, :]
    v = tl.load(v_row_ptr + one[:, None] + dims[None, :], mask=in_head, other=0.0)
    cache_dtype = cache_ptr.dtype.element_ty
    if cache_dtype == tl.float8e4nv:  # quantized from the model-dtype values, as rope_qk does
        k = fp8_range(k.to(tl.float32) / k_scale)
        v = fp8_range(v.to(tl.float32) / v_scale)
    at = (slot * NUM_KV_HEADS + kv_head) * HEAD_DIM + one[:, None] + dims[None, :]
    store = in_head & (slot >= 0) & holds
    tl.store(cache_ptr + at, k.to(cache_dtype), mask=store)
    tl.store(cache_ptr + kv_half_stride + at, v.to(cache_dtype), mask=store)


@triton.jit
def _fence():
    """fence.acq_rel.gpu in every thread (the interpreter runs programs one after another)."""
    if not INTERPRETED:
        tl.inline_asm_elementwise(
            "fence.acq_rel.gpu; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
        )


@triton.jit(do_not_specialize=["num_splits"])  # a per-step value: see prefill_kernel
def reduce_kernel(
    partial_out_ptr,
    partial_ml_ptr,
    out_ptr,  # [num_seqs, num_heads, head_dim]
    prefix_lens_ptr,  # [num_seqs] int32, if CASCADE: > 0 where shared_prefix_kernel wrote partials
    num_splits,
    num_prefix_splits,  # its partials follow the sequence's own num_splits
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    CASCADE: tl.constexpr,
    PDL: tl.constexpr,
):
    """out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s over the splits of one head (m in log2 units)."""
    pdl.wait(PDL)
    row = tl.program_id(0)  # seq * num_heads + head
    splits = tl.arange(0, MAX_SPLITS)
    if CASCADE:
        shared = tl.load(prefix_lens_ptr + row // NUM_HEADS) > 0
        used = splits < num_splits + tl.where(shared, num_prefix_splits, 0)
    else:
        used = splits < num_splits
    base = row.to(tl.int64) * MAX_SPLITS + splits
    row_max = tl.load(partial_ml_ptr + base * 2, mask=used, other=float("-inf"))
    row_sum = tl.load(partial_ml_ptr + base * 2 + 1, mask=used, other=0.0)
    weight = tl.where(row_max == float("-inf"), 0.0, tl.exp2(row_max - tl.max(row_max, axis=0)))
    dims = tl.arange(0, HEAD_PAD)
    in_head = dims < HEAD_DIM
    acc = tl.load(
        partial_out_ptr + base[:, None] * HEAD_DIM + dims[None, :],
        mask=used[:, None] & in_head[None, :],
        other=0.0,
    )
    out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(row_sum * weight, axis=0)
    tl.store(
        out_ptr + row.to(tl.int64) * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty), mask=in_head
    )


@triton.jit(do_not_specialize=["first_split"])
def shared_prefix_kernel(
    q_ptr,  # [num_seqs, num_heads, head_dim]
    partial_out_ptr,  # as decode_kernel's, written at splits [first_split, first_split + splits)
    partial_ml_ptr,
    cache_ptr,
    block_tables_ptr,
    group_rows_ptr,  # [num_seqs] int32: the sequences of each group, group after group
    group_starts_ptr,  # [max_groups + 1] int32: group g is group_rows[starts[g]:starts[g + 1]]
    group_prefix_ptr,  # [max_groups] int32: the keys its sequences share
    num_groups_ptr,  # [1] int32: groups this step; programs past them return at once
    q_token_stride,
    block_table_stride,
    kv_half_stride,
    scale,  # of the softmax, times an FP8 cache's k_scale
    v_scale,  # an FP8 cache's V scale (1.0 otherwise)
    first_split,
    GROUP: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    ROWS: tl.constexpr,  # >= 16, a power of two: up to ROWS // GROUP sequences x GROUP heads
    PDL: tl.constexpr,
):
    """Attention of a group of decode rows over the blocks they share, each key tile read once for
    all of them (cascade attention): the group's queries are the rows of one tile, split s covers
    an equal share of the shared tiles. `decode_kernel` does each row's keys after the prefix and
    `reduce_kernel` merges both."""
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)  # the decode kernel, over the rows' own keys meanwhile
    kv_head = tl.program_id(0)
    group = tl.program_id(1)
    split = tl.program_id(2)
    if group < tl.load(num_groups_ptr):
        start = tl.load(group_starts_ptr + group)
        count = tl.load(group_starts_ptr + group + 1) - start
        prefix = tl.load(group_prefix_ptr + group)
        # row r is member r // GROUP of the group, head kv_head * GROUP + r % GROUP
        rows = tl.arange(0, ROWS)
        member = rows // GROUP
        row_valid = member < count
        seq = tl.load(group_rows_ptr + start + member, mask=row_valid, other=0).to(tl.int64)
        head = kv_head * GROUP + rows % GROUP
        dims = tl.arange(0, HEAD_PAD)
        row_dims = row_valid[:, None] & (dims < HEAD_DIM)[None, :]
        q = tl.load(
            q_ptr + (seq * q_token_stride + head * HEAD_DIM)[:, None] + dims[None, :],
            mask=row_dims,
            other=0.0,
        )
        q = _product_dtype(q, cache_ptr)
        num_tiles = tl.cdiv(prefix, BLOCK_N)
        tiles_per_split = tl.cdiv(num_tiles, tl.num_programs(2))
        first_tile = split * tiles_per_split
        last_tile = tl.minimum(first_tile + tiles_per_split, num_tiles)
        query_pos = tl.full([ROWS], prefix, tl.int32)  # every shared key is visible
        row_max = tl.full([ROWS], float("-inf"), tl.float32)
        row_sum = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, HEAD_PAD], tl.float32)
        leader = tl.load(group_rows_ptr + start).to(tl.int64)
        table = block_tables_ptr + leader * block_table_stride  # the shared blocks: any member's
        full_tiles = prefix // BLOCK_N
        for t in range(first_tile, tl.minimum(last_tile, full_tiles)):
            row_max, row_sum, acc = _attend_tile(
                q, row_max, row_sum, acc, cache_ptr, table, kv_half_stride, kv_head, t * BLOCK_N,
                query_pos, prefix, 1 << 30, scale, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, HEAD_PAD,
                BLOCK_N, SOFT_CAP, False,
            )  # fmt: skip
        for t in range(tl.maximum(first_tile, full_tiles), last_tile):
            row_max, row_sum, acc = _attend_tile(
                q, row_max, row_sum, acc, cache_ptr, table, kv_half_stride, kv_head, t * BLOCK_N,
                query_pos, prefix, 1 << 30, scale, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, HEAD_PAD,
                BLOCK_N, SOFT_CAP, True,
            )  # fmt: skip
        acc = acc * v_scale
        base = (seq * (GROUP * NUM_KV_HEADS) + head) * MAX_SPLITS + first_split + split
        tl.store(partial_out_ptr + base[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_dims)
        tl.store(partial_ml_ptr + base * 2, row_max, mask=row_valid)
        tl.store(partial_ml_ptr + base * 2 + 1, row_sum, mask=row_valid)
