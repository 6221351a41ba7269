"""Decode attention over a paged KV cache, written in Gluon (Triton's explicit-layout language)
for Hopper: the pipeline and the registers' layouts are the kernel's own, not Triton's choice.
It serves large decode batches over an e4m3 cache by default, and over a 16-bit cache with
TANDEM_GLUON_DECODE=all (not faster than `decode_kernel` there: see `TILES`).

Where `decode_kernel` (attention/triton_kernels.py) takes an FP8 cache, Triton's pipeliner makes
each key loop wait for every copy in flight (sm_90 SASS: DEPBAR.LE SB0, 0x0), so a program's
next tile loads only while nothing else of it runs, and V's tile goes through shared memory
twice (copied as e4m3, then written back as float16 for ldmatrix.trans). Here:

- one warp a program (a sequence's KV head, its query heads as the rows of 16-row products);
- STAGES tiles of BLOCK_N keys in shared memory, STAGES - 1 of them in flight while one is
  computed (cp.async, waits that leave STAGES - 2 groups outstanding); each tile's block-table
  entries are loaded a tile before its copies are issued;
- K and V are read from shared memory straight into the registers the tensor cores read, 16 or
  32 contiguous bytes a thread (LDS.128), then widened to float16 in those registers;
- rows whose leading blocks a group shares (`SharedPrefixes`) read only their own keys, after
  the prefix, and merge `shared_prefix_kernel`'s partials of the prefix before the store; the
  kernel starts beside that one (EARLY_START, as `decode_kernel`'s) and waits before the merge.

The products' summed dimensions may be taken in any order, so the kernel takes them in the order
its registers hold the bytes. QK^T sums over the head's dimensions: they are numbered so that
each thread's K operand is 32 contiguous bytes of a key's row, and q is loaded once in that same
order (`Plan.q_dims`). PV sums over keys: they are numbered as the score tile's registers hold
them (so the probabilities are an operand with no data moved), and V's output dimensions so
that each thread reads 16 contiguous bytes of a key's row; the output is stored back through
`Plan.out_dims`. The reorderings in the kernel are reshapes and permutes of its register
tensors, which move no data (their layouts are derived, not converted).

`takes` says which calls it serves: an e4m3 cache under a 16-bit model (or a 16-bit cache of
q's dtype, when enabled), head size 128, at most 16 query heads a KV head, one split (a batch
that fills the device), no window, soft cap or fused rotary. Everything else keeps
`decode_kernel`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from tandem import envs

HEAD_DIM = 128
ROWS = 16  # query rows of a product: a KV head's query heads, padded
BLOCK_N = 32  # keys a tile
STAGES = envs.fp8_decode_stages()  # tiles in shared memory: 4 x 8 KB a program
# which caches' large decode batches take this kernel (TANDEM_GLUON_DECODE)
ENABLED = envs.gluon_decode() != "none"  # over an e4m3 cache
SIXTEEN_BIT = envs.gluon_decode() == "all"  # over a 16-bit cache
# how far (log2 units) a row's scores may pass its running max before acc is rescaled
RESCALE = gl.constexpr(8.0)


@functools.cache
def product_layouts() -> tuple:
    """(accumulator, A operand, B operand) layouts of the products, one warp's."""
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    a = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=4)
    b = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=4)
    return mma, a, b


# copies: a thread 16 bytes of a key's row at a time, ROW_LANES threads a row. At 8 an
# instruction copies 4 whole 128-byte rows of e4m3 (a thread's 8 keys look up 8 table entries).
# H200, graph-replayed, µs at 2 / 4 / 8 (small's 256 x 100-1,100; Llama-3-8B's 256 x 1K): 103.2
# / 89.9 / 86.0; 180.4 / 153.3 / 145.2 (session 36). A 16-bit cache's 256-byte rows take 16.
ROW_LANES = envs.fp8_decode_row_lanes()


class Tiles(NamedTuple):
    """A launch's shape for one cache element size."""

    block_n: int  # keys a tile
    stages: int  # tiles in shared memory
    row_lanes: int  # threads that copy one key's row


# By the cache's element size. A 16-bit cache at 16-key tiles, 4 stages (`kernels.py
# --sweep-gluon-decode`, H200, graph-replayed, µs against `decode_kernel`, session 37): small's
# 256 x 100-1,100 150.3 / 155.8 and 256 x 600 154.8 / 155.5, but Llama-3-8B's 256 x 1K 259.5 /
# 245.3 and rollout's call at 64 / 256 / 500 own keys 76.7 / 121.0 / 180.5 against 68.6 /
# 112.1 / 169.9; no shape of 3 or 6 stages, 32-key tiles or half-row copies beat it on those.
# The Triton kernel reads a 16-bit cache near the copy rate already (small: 4.0 TB/s), so
# 16-bit caches keep it by default.
TILES = {1: Tiles(BLOCK_N, STAGES, ROW_LANES), 2: Tiles(16, 4, 16)}


@functools.cache
def copy_layouts(element_size: int, row_lanes: int) -> tuple:
    """(registers, shared memory) layouts of a tile's copies: a thread 16 bytes of a key's row
    at a time, and 16-byte chunks of each row swizzled by the row, so that the K and V reads
    hit no bank twice."""
    vec = 16 // element_size
    registers = gl.BlockedLayout([1, vec], [32 // row_lanes, row_lanes], [1, 1], [1, 0])
    shared = gl.SwizzledSharedLayout(vec=vec, per_phase=1, max_phase=8, order=[1, 0])
    return registers, shared


def linear_layout(layout, shape: list[int]) -> gl.DistributedLinearLayout:
    """`layout` over `shape` as Triton's linear layout: which (row, column) each register,
    lane and warp bit of a thread's index adds."""
    from triton._C.libtriton import gluon_ir, ir

    context = ir.context()
    ir.load_dialects(context)
    builder = gluon_ir.GluonOpBuilder(context)
    return builder.to_linear_layout(layout._to_ir(builder), shape)


def _bit(value: int) -> int:
    assert value > 0 and value & (value - 1) == 0
    return value.bit_length() - 1


def _moved(value: int, to: dict[int, int]) -> int:
    """value with its bit b moved to bit to[b]."""
    return sum(1 << to[b] for b in to if value >> b & 1)


class Plan(NamedTuple):
    """The kernel's layouts and index orders, derived from the products' operand layouts."""

    mma: gl.NVMMADistributedLayout  # the products' accumulator [rows, ...]
    a_operand: gl.DotOperandLayout
    b_operand: gl.DotOperandLayout
    k_layout: gl.DistributedLinearLayout  # a K tile [BLOCK_N, HEAD_DIM] as it is read
    v_layout: gl.DistributedLinearLayout  # a V tile [BLOCK_N, HEAD_DIM] as it is read
    k_shape: tuple  # K's tile split into one dimension a bit of the head's dimensions
    k_order: tuple  # ... permuted to K^T's operand [bits of the product's dims, keys]
    p_shape: tuple  # the probabilities [ROWS, BLOCK_N] split into one dimension a key bit
    p_order: tuple  # ... permuted to the operand's key order
    v_shape: tuple  # V's tile split into one dimension a bit of keys and of dims
    v_order: tuple  # ... permuted to the operand's [keys, output dims] order
    q_dims: tuple  # the head dimension at each of the product's K positions
    out_dims: tuple  # the head dimension of each output column


@functools.cache
def plan(block_n: int = BLOCK_N) -> Plan:
    dim_bits, key_bits = _bit(HEAD_DIM), _bit(block_n)
    mma, a_operand, b_operand = product_layouts()
    # K^T [HEAD_DIM, block_n] as the product's B operand: its K positions' bits, in the order
    # a thread's registers and then its lanes hold them, become the head dimension's bits from
    # the lowest: a thread's registers then cover contiguous bytes of a key's row
    kt = linear_layout(b_operand, [HEAD_DIM, block_n])
    held = [_bit(b[0]) for b in kt.reg_bases + kt.lane_bases if b[0]]
    to_dim = {b: i for i, b in enumerate(held)}

    def k_basis(basis):  # (K position, key) -> (key, head dimension)
        return [basis[1], _moved(basis[0], to_dim)]

    k_layout = gl.DistributedLinearLayout(
        [k_basis(b) for b in kt.reg_bases], [k_basis(b) for b in kt.lane_bases], [], [],
        [block_n, HEAD_DIM],
    )  # fmt: skip
    # [key, dim bits msb first] -> [K position bits msb first, key]
    k_order = (*(dim_bits - to_dim[b] for b in reversed(range(dim_bits))), 0)
    # the probabilities: the A operand's key positions take the score tile's key bits in the
    # same register and lane places, so the operand is the scores' registers as they are
    scores = linear_layout(mma, [ROWS, block_n])
    a = linear_layout(a_operand, [ROWS, block_n])
    score_keys = [_bit(b[1]) for b in scores.reg_bases + scores.lane_bases if b[1]]
    operand_keys = [_bit(b[1]) for b in a.reg_bases + a.lane_bases if b[1]]
    to_key = dict(
        zip(operand_keys, score_keys, strict=True)
    )  # operand key bit -> score tile key bit
    p_order = (0, *(key_bits - to_key[b] for b in reversed(range(key_bits))))
    # V [block_n, HEAD_DIM] as the B operand of p @ V: keys in the probabilities' order, and
    # the output dims numbered so that a thread's registers cover contiguous bytes of a row
    vb = linear_layout(b_operand, [block_n, HEAD_DIM])
    held = [_bit(b[1]) for b in vb.reg_bases + vb.lane_bases if b[1]]
    to_out = {b: i for i, b in enumerate(held)}

    def v_basis(basis):  # (operand key, output column) -> (key, head dimension)
        return [_moved(basis[0], to_key), _moved(basis[1], to_out)]

    v_regs = sorted((v_basis(b) for b in vb.reg_bases), key=lambda b: (b[0] != 0, b))
    v_layout = gl.DistributedLinearLayout(
        v_regs, [v_basis(b) for b in vb.lane_bases], [], [], [block_n, HEAD_DIM]
    )
    v_order = tuple(key_bits - 1 - to_key[b] for b in reversed(range(key_bits))) + tuple(
        key_bits + dim_bits - 1 - to_out[b] for b in reversed(range(dim_bits))
    )
    return Plan(
        mma=mma,
        a_operand=a_operand,
        b_operand=b_operand,
        k_layout=k_layout,
        v_layout=v_layout,
        k_shape=(block_n,) + (2,) * dim_bits,
        k_order=k_order,
        p_shape=(ROWS,) + (2,) * key_bits,
        p_order=p_order,
        v_shape=(2,) * (key_bits + dim_bits),
        v_order=v_order,
        q_dims=tuple(_moved(d, to_dim) for d in range(HEAD_DIM)),
        out_dims=tuple(_moved(d, to_out) for d in range(HEAD_DIM)),
    )


@gluon.jit
def _grid_wait(PDL: gl.constexpr):
    """The kernel before this one on the stream has finished writing (PDL's wait)."""
    if PDL:
        gl.inline_asm_elementwise(
            "griddepcontrol.wait; mov.u32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False, pack=1
        )


@gluon.jit
def _issue_tile(
    k_smem, v_smem, cache_ptr, kv_half_stride, blocks, keys, key_end, kv_head,
    BLOCK_SIZE: gl.constexpr, NUM_KV_HEADS: gl.constexpr, HEAD_DIM: gl.constexpr,
    COPY: gl.constexpr,
):  # fmt: skip
    """Copies of one tile's K and V rows (`keys`, their cache blocks `blocks`) into a stage;
    keys from key_end on are zeros."""
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, COPY))
    slots = blocks.to(gl.int64) * BLOCK_SIZE + keys % BLOCK_SIZE
    rows = cache_ptr + ((slots * NUM_KV_HEADS + kv_head) * HEAD_DIM)[:, None] + dims[None, :]
    live = (keys < key_end)[:, None]
    async_copy.async_copy_global_to_shared(k_smem, rows, mask=live)
    async_copy.async_copy_global_to_shared(v_smem, rows + kv_half_stride, mask=live)
    async_copy.commit_group()


@gluon.jit
def _tile_blocks(table, keys, key_end, BLOCK_SIZE: gl.constexpr):
    """The cache blocks of a tile's keys (0 from key_end on)."""
    return gl.load(table + keys // BLOCK_SIZE, mask=keys < key_end, other=0)


@gluon.jit
def _attend(
    q, cache_ptr, table, kv_half_stride, kv_head, key_start, key_end, scale,
    NUM_KV_HEADS: gl.constexpr, HEAD_DIM: gl.constexpr, ROWS: gl.constexpr,
    BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    PRODUCT: gl.constexpr, COPY: gl.constexpr, SHARED: gl.constexpr,
    MMA: gl.constexpr, A_OPERAND: gl.constexpr, B_OPERAND: gl.constexpr,
    K_LAYOUT: gl.constexpr, V_LAYOUT: gl.constexpr, K_SHAPE: gl.constexpr,
    K_ORDER: gl.constexpr, P_SHAPE: gl.constexpr, P_ORDER: gl.constexpr,
    V_SHAPE: gl.constexpr, V_ORDER: gl.constexpr,
):  # fmt: skip
    """The online softmax's state (row_max in log2 units, row_sum, acc [ROWS, HEAD_DIM] by
    `Plan.out_dims`) of q's rows ([ROWS, HEAD_DIM] by `Plan.q_dims`, in PRODUCT) over keys
    [key_start, key_end) of one block table, STAGES tiles of BLOCK_N keys in shared memory."""
    num_tiles = gl.cdiv(key_end - key_start, BLOCK_N)
    element = cache_ptr.dtype.element_ty
    k_smem = gl.allocate_shared_memory(element, [STAGES, BLOCK_N, HEAD_DIM], SHARED)
    v_smem = gl.allocate_shared_memory(element, [STAGES, BLOCK_N, HEAD_DIM], SHARED)
    copy_keys = key_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, COPY))
    for s in gl.static_range(STAGES - 1):  # the first STAGES - 1 tiles in flight
        keys = s * BLOCK_N + copy_keys
        blocks = _tile_blocks(table, keys, key_end, BLOCK_SIZE)
        _issue_tile(
            k_smem.index(s), v_smem.index(s), cache_ptr, kv_half_stride, blocks, keys, key_end,
            kv_head, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, COPY,
        )  # fmt: skip
    next_blocks = _tile_blocks(table, (STAGES - 1) * BLOCK_N + copy_keys, key_end, BLOCK_SIZE)

    row_max = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, MMA))
    row_sum = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(1, MMA))
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=MMA)
    score_keys = key_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, MMA))
    for t in range(num_tiles):
        async_copy.wait_group(STAGES - 2)  # tile t has landed (each thread's own copies) ...
        gl.thread_barrier()  # ... every thread's, and tile t - 1's stage is no longer read
        ahead = t + STAGES - 1
        _issue_tile(
            k_smem.index(ahead % STAGES), v_smem.index(ahead % STAGES), cache_ptr,
            kv_half_stride, next_blocks, ahead * BLOCK_N + copy_keys, key_end, kv_head,
            BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, COPY,
        )  # fmt: skip
        next_blocks = _tile_blocks(table, (ahead + 1) * BLOCK_N + copy_keys, key_end, BLOCK_SIZE)

        k = k_smem.index(t % STAGES).load(K_LAYOUT).to(PRODUCT)
        kt = gl.reshape(gl.permute(gl.reshape(k, K_SHAPE), K_ORDER.value), [HEAD_DIM, BLOCK_N])
        zeros = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=MMA)
        scores = mma_v2(q, gl.convert_layout(kt, B_OPERAND), zeros)
        scores = gl.where(
            (t * BLOCK_N + score_keys < key_end)[None, :], scores * scale, -float("inf")
        )
        # the running max moves only when a row's scores pass it by more than RESCALE (log2
        # units): until then p < 2^RESCALE, exact enough in 16 bits, and acc is not rescaled
        tile_max = gl.max(scores, axis=1)
        if gl.max(tile_max - row_max, axis=0) > RESCALE:
            m_new = gl.maximum(row_max, tile_max)
            alpha = gl.exp2(row_max - m_new)
            row_sum = row_sum * alpha
            acc = acc * alpha[:, None]
            row_max = m_new
        p = gl.exp2(scores - row_max[:, None])
        row_sum = row_sum + gl.sum(p, axis=1)
        p = gl.reshape(
            gl.permute(gl.reshape(p.to(PRODUCT), P_SHAPE), P_ORDER.value), [ROWS, BLOCK_N]
        )
        v = v_smem.index(t % STAGES).load(V_LAYOUT).to(PRODUCT)
        v = gl.reshape(gl.permute(gl.reshape(v, V_SHAPE), V_ORDER.value), [BLOCK_N, HEAD_DIM])
        acc = mma_v2(gl.convert_layout(p, A_OPERAND), gl.convert_layout(v, B_OPERAND), acc)
    async_copy.wait_group(0)  # the copies past the last tile (masked) before the program ends
    return row_max, row_sum, acc


@gluon.jit
def _merge_partials(
    row_max, row_sum, acc, partial_out_ptr, partial_ml_ptr, first, count, live, out_dims,
    HEAD_DIM: gl.constexpr,
):  # fmt: skip
    """The online softmax's state after `count` more partials of the same rows, at `first`
    ([ROWS] int64) on (as the Triton kernels' `_merge_partials` merges them); acc's columns
    are the head's dimensions `out_dims`."""
    for i in range(count):
        at = first + i
        part_max = gl.load(partial_ml_ptr + at * 2, mask=live, other=float("-inf"))
        part_sum = gl.load(partial_ml_ptr + at * 2 + 1, mask=live, other=0.0)
        part_acc = gl.load(
            partial_out_ptr + (at * HEAD_DIM)[:, None] + out_dims[None, :],
            mask=live[:, None],
            other=0.0,
        )
        m_new = gl.maximum(row_max, part_max)
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        ours = gl.exp2(row_max - m_safe)
        theirs = gl.exp2(part_max - m_safe)
        row_sum = row_sum * ours + part_sum * theirs
        acc = acc * ours[:, None] + part_acc * theirs[:, None]
        row_max = m_new
    return row_max, row_sum, acc


@gluon.jit(do_not_specialize=["q_token_stride", "num_prefix_splits"])
def gluon_decode_kernel(
    q_ptr,  # [num_seqs, num_heads, HEAD_DIM] (rows q_token_stride apart)
    out_ptr,  # [num_seqs, num_heads, HEAD_DIM]
    partial_out_ptr,  # [max_seqs, num_heads, MAX_SPLITS, HEAD_DIM] float32, if CASCADE
    partial_ml_ptr,  # [max_seqs, num_heads, MAX_SPLITS, 2] float32: (max, sum), log2 units
    cache_ptr,  # one layer's [2, num_blocks + 1, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM]
    block_tables_ptr,
    seq_lens_ptr,
    seq_order_ptr,  # [num_seqs] int32: sequences in launch order (longest first), if ORDERED
    prefix_lens_ptr,  # [num_seqs] int32, if CASCADE: the shared keys, left to the partials
    q_dims_ptr,  # [HEAD_DIM] int32: Plan.q_dims
    out_dims_ptr,  # [HEAD_DIM] int32: Plan.out_dims
    q_token_stride,
    block_table_stride,
    kv_half_stride,
    scale,  # of the softmax, in log2 units, times an FP8 cache's k_scale
    v_scale,
    num_prefix_splits,  # partials of a row's shared keys, after its own (split 0's) place
    GROUP: gl.constexpr,
    NUM_KV_HEADS: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    ROWS: gl.constexpr,
    BLOCK_SIZE: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    MAX_SPLITS: gl.constexpr,
    PRODUCT: gl.constexpr,  # the products' dtype: q's, or float16 over e4m3
    ORDERED: gl.constexpr,
    CASCADE: gl.constexpr,
    EARLY_START: gl.constexpr,
    PDL: gl.constexpr,
    COPY: gl.constexpr,
    SHARED: gl.constexpr,
    MMA: gl.constexpr,
    A_OPERAND: gl.constexpr,
    B_OPERAND: gl.constexpr,
    K_LAYOUT: gl.constexpr,
    V_LAYOUT: gl.constexpr,
    K_SHAPE: gl.constexpr,
    K_ORDER: gl.constexpr,
    P_SHAPE: gl.constexpr,
    P_ORDER: gl.constexpr,
    V_SHAPE: gl.constexpr,
    V_ORDER: gl.constexpr,
):
    """One sequence's KV head over its keys, output normalized and stored (one split). With
    CASCADE a grouped row's keys start after its shared prefix, whose partials
    (`shared_prefix_kernel`'s) it merges before the store; EARLY_START: as `decode_kernel`'s,
    the wait for that kernel comes before the merge."""
    if not EARLY_START:
        _grid_wait(PDL)
    kv_head = gl.program_id(0)
    seq = gl.program_id(1)
    if ORDERED:
        seq = gl.load(seq_order_ptr + seq)
    seq_len = gl.load(seq_lens_ptr + seq)
    key_base = 0
    if CASCADE:
        key_base = gl.load(prefix_lens_ptr + seq)
    table = block_tables_ptr + seq.to(gl.int64) * block_table_stride

    # q [ROWS, HEAD_DIM], its dimensions in the order of K's operand, in the products' dtype:
    # float16 over e4m3 holds every e4m3 value and a bfloat16 query's 8 significant bits
    # exactly (while |q| < 65,504). Read from the L2 (EARLY_START: see decode_kernel).
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, A_OPERAND))
    q_dims = gl.load(q_dims_ptr + gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, A_OPERAND)))
    q_rows = q_ptr + seq.to(gl.int64) * q_token_stride + (kv_head * GROUP + rows) * HEAD_DIM
    q = gl.load(
        q_rows[:, None] + q_dims[None, :],
        mask=(rows < GROUP)[:, None],
        other=0.0,
        cache_modifier=".cg",
    )
    row_max, row_sum, acc = _attend(
        q.to(PRODUCT), cache_ptr, table, kv_half_stride, kv_head, key_base, seq_len, scale,
        NUM_KV_HEADS, HEAD_DIM, ROWS, BLOCK_SIZE, BLOCK_N, STAGES, PRODUCT, COPY, SHARED,
        MMA, A_OPERAND, B_OPERAND, K_LAYOUT, V_LAYOUT, K_SHAPE, K_ORDER, P_SHAPE, P_ORDER,
        V_SHAPE, V_ORDER,
    )  # fmt: skip

    acc = acc * v_scale
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, MMA))
    out_dims = gl.load(out_dims_ptr + gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, MMA)))
    head_rows = seq.to(gl.int64) * (GROUP * NUM_KV_HEADS) + kv_head * GROUP + rows
    if EARLY_START:  # shared_prefix_kernel's partials (every program waits: see pdl.py)
        _grid_wait(PDL)
    if CASCADE:  # noqa: SIM102 (a static branch, then the program's own)
        if key_base > 0:  # a grouped row: its prefix partials follow its own split
            row_max, row_sum, acc = _merge_partials(
                row_max, row_sum, acc, partial_out_ptr, partial_ml_ptr,
                head_rows * MAX_SPLITS + 1, num_prefix_splits, rows < GROUP, out_dims, HEAD_DIM,
            )  # fmt: skip
    out = acc / gl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
    gl.store(
        out_ptr + (head_rows * HEAD_DIM)[:, None] + out_dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=(rows < GROUP)[:, None],
    )


def _serves(q: torch.Tensor, kv_cache: torch.Tensor, head_dim: int) -> bool:
    """The kernels' dtypes (an e4m3 cache under a 16-bit model, or a 16-bit cache of q's
    dtype), head size and device (sm_90 or newer)."""
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    return (
        (fp8 or kv_cache.dtype == q.dtype)
        and q.dtype in (torch.bfloat16, torch.float16)
        and head_dim == HEAD_DIM
        and q.is_cuda
        and torch.cuda.get_device_capability(q.device)[0] >= 9
    )


def takes(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    head_dim: int,
    group: int,
    splits: int,
    plain: bool,
) -> bool:
    """Whether `gluon_decode_kernel` can serve a decode call: `plain` is one with no window,
    soft cap or fused rotary."""
    enabled = ENABLED if kv_cache.dtype == torch.float8_e4m3fn else SIXTEEN_BIT
    return enabled and plain and splits == 1 and group <= ROWS and _serves(q, kv_cache, head_dim)


@functools.cache
def _dims(device: torch.device, block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Plan.q_dims and Plan.out_dims on `device`."""
    p = plan(block_n)
    return (
        torch.tensor(p.q_dims, dtype=torch.int32, device=device),
        torch.tensor(p.out_dims, dtype=torch.int32, device=device),
    )


def _layout_args(p: Plan) -> dict:
    return dict(
        MMA=p.mma, A_OPERAND=p.a_operand, B_OPERAND=p.b_operand, K_LAYOUT=p.k_layout,
        V_LAYOUT=p.v_layout, K_SHAPE=p.k_shape, K_ORDER=p.k_order, P_SHAPE=p.p_shape,
        P_ORDER=p.p_order, V_SHAPE=p.v_shape, V_ORDER=p.v_order,
    )  # fmt: skip


def _product(kv_cache: torch.Tensor):
    """The products' dtype: the cache's, float16 over e4m3."""
    return gl.bfloat16 if kv_cache.dtype == torch.bfloat16 else gl.float16


def decode(
    q: torch.Tensor,
    out: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_order: torch.Tensor | None,
    num_seqs: int,
    num_kv_heads: int,
    group: int,
    scale: float,
    v_scale: float,
    pdl: dict,
    cascade: tuple | None = None,
    early_start: bool = False,
    tiles: Tiles | None = None,
) -> None:
    """The first `num_seqs` rows of q attend to their keys; `pdl`: `pdl.launch_args`.
    `cascade`: (partial_out, partial_ml, prefix_lens, prefix splits), the shared prefixes'
    partials to merge."""
    tiles = tiles or TILES[kv_cache.element_size()]
    p = plan(tiles.block_n)
    q_dims, out_dims = _dims(q.device, tiles.block_n)
    copy, shared = copy_layouts(kv_cache.element_size(), tiles.row_lanes)
    partial_out, partial_ml, prefix_lens, prefix_splits = cascade or (q, q, seq_lens, 0)
    gluon_decode_kernel[(num_kv_heads, num_seqs)](
        q, out, partial_out, partial_ml, kv_cache, block_tables, seq_lens,
        seq_lens if seq_order is None else seq_order, prefix_lens, q_dims, out_dims, q.stride(0),
        block_tables.stride(0), kv_cache.stride(0), scale * 1.4426950408889634, v_scale,
        prefix_splits, GROUP=group, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=HEAD_DIM, ROWS=ROWS,
        BLOCK_SIZE=kv_cache.shape[2], BLOCK_N=tiles.block_n, STAGES=tiles.stages,
        MAX_SPLITS=partial_out.shape[2] if cascade else 1, PRODUCT=_product(kv_cache),
        ORDERED=seq_order is not None, CASCADE=cascade is not None, EARLY_START=early_start,
        COPY=copy, SHARED=shared, num_warps=1, **_layout_args(p), **pdl,
    )  # fmt: skip
