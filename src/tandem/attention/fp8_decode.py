"""Decode attention over an e4m3 KV cache, written in Gluon (Triton's explicit-layout language)
for Hopper: the pipeline and the registers' layouts are the kernel's own, not Triton's choice.

Where `decode_kernel` (attention/triton_kernels.py) takes an FP8 cache, Triton's pipeliner makes
each key loop wait for every copy in flight (sm_90 SASS: DEPBAR.LE SB0, 0x0), so a program's
next tile loads only while nothing else of it runs, and V's tile goes through shared memory
twice (copied as e4m3, then written back as float16 for ldmatrix.trans). Here:

- one warp a program (a sequence's KV head, its query heads as the rows of 16-row products);
- STAGES tiles of BLOCK_N keys in shared memory, STAGES - 1 of them in flight while one is
  computed (cp.async, waits that leave STAGES - 2 groups outstanding); each tile's block-table
  entries are loaded a tile before its copies are issued;
- K and V are read from shared memory straight into the registers the tensor cores read, 16 or
  32 contiguous bytes a thread (LDS.128), then widened to float16 in those registers.

The products' summed dimensions may be taken in any order, so the kernel takes them in the order
its registers hold the bytes. QK^T sums over the head's dimensions: they are numbered so that
each thread's K operand is 32 contiguous bytes of a key's row, and q is loaded once in that same
order (`Plan.q_dims`). PV sums over keys: they are numbered as the score tile's registers hold
them (so the probabilities are an operand with no data moved), and V's output dimensions so
that each thread reads 16 contiguous bytes of a key's row; the output is stored back through
`Plan.out_dims`. The reorderings in the kernel are reshapes and permutes of its register
tensors, which move no data (their layouts are derived, not converted).

`takes` says which calls it serves: an e4m3 cache under a 16-bit model, head size 128, at most
16 query heads a KV head, one split (a batch that fills the device), no shared prefix, window,
soft cap or fused rotary. Everything else keeps `decode_kernel`.
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
ENABLED = envs.fp8_decode() == "gluon"
# how far (log2 units) a row's scores may pass its running max before acc is rescaled
RESCALE = gl.constexpr(8.0)

# the layouts (constexpr, as the kernels read globals): the products' accumulator and operands
MMA = gl.constexpr(
    gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
)
A_OPERAND = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA.value, k_width=4))
B_OPERAND = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA.value, k_width=4))
# copies: a thread 16 bytes of a key's row at a time, ROW_LANES threads a row. At 8 an
# instruction copies 4 whole 128-byte rows (a thread's 8 keys look up 8 table entries). H200,
# graph-replayed, µs at 2 / 4 / 8 (small's 256 x 100-1,100; Llama-3-8B's 256 x 1K): 103.2 /
# 89.9 / 86.0; 180.4 / 153.3 / 145.2 (session 36)
ROW_LANES = envs.fp8_decode_row_lanes()
COPY = gl.constexpr(gl.BlockedLayout([1, 16], [32 // ROW_LANES, ROW_LANES], [1, 1], [1, 0]))
# 16-byte chunks of each 128-byte row swizzled by the row: the K and V reads hit no bank twice
SHARED = gl.constexpr(gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=8, order=[1, 0]))


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
    # K^T [HEAD_DIM, block_n] as the product's B operand: its K positions' bits, in the order
    # a thread's registers and then its lanes hold them, become the head dimension's bits from
    # the lowest: a thread's registers then cover contiguous bytes of a key's row
    kt = linear_layout(B_OPERAND.value, [HEAD_DIM, block_n])
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
    scores = linear_layout(MMA.value, [ROWS, block_n])
    a = linear_layout(A_OPERAND.value, [ROWS, block_n])
    score_keys = [_bit(b[1]) for b in scores.reg_bases + scores.lane_bases if b[1]]
    operand_keys = [_bit(b[1]) for b in a.reg_bases + a.lane_bases if b[1]]
    to_key = dict(
        zip(operand_keys, score_keys, strict=True)
    )  # operand key bit -> score tile key bit
    p_order = (0, *(key_bits - to_key[b] for b in reversed(range(key_bits))))
    # V [block_n, HEAD_DIM] as the B operand of p @ V: keys in the probabilities' order, and
    # the output dims numbered so that a thread's registers cover contiguous bytes of a row
    vb = linear_layout(B_OPERAND.value, [block_n, HEAD_DIM])
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
    k_smem, v_smem, cache_ptr, kv_half_stride, blocks, keys, seq_len, kv_head,
    BLOCK_SIZE: gl.constexpr, NUM_KV_HEADS: gl.constexpr, HEAD_DIM: gl.constexpr,
):  # fmt: skip
    """Copies of one tile's K and V rows (`keys`, their cache blocks `blocks`) into a stage;
    keys past the sequence are zeros."""
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, COPY))
    slots = blocks.to(gl.int64) * BLOCK_SIZE + keys % BLOCK_SIZE
    rows = cache_ptr + ((slots * NUM_KV_HEADS + kv_head) * HEAD_DIM)[:, None] + dims[None, :]
    live = (keys < seq_len)[:, None]
    async_copy.async_copy_global_to_shared(k_smem, rows, mask=live)
    async_copy.async_copy_global_to_shared(v_smem, rows + kv_half_stride, mask=live)
    async_copy.commit_group()


@gluon.jit
def _tile_blocks(table, keys, seq_len, BLOCK_SIZE: gl.constexpr):
    """The cache blocks of a tile's keys (0 past the sequence)."""
    return gl.load(table + keys // BLOCK_SIZE, mask=keys < seq_len, other=0)


@gluon.jit(do_not_specialize=["q_token_stride"])
def fp8_decode_kernel(
    q_ptr,  # [num_seqs, num_heads, HEAD_DIM] (rows q_token_stride apart)
    out_ptr,  # [num_seqs, num_heads, HEAD_DIM]
    cache_ptr,  # one layer's [2, num_blocks + 1, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM] e4m3
    block_tables_ptr,
    seq_lens_ptr,
    seq_order_ptr,  # [num_seqs] int32: sequences in launch order (longest first), if ORDERED
    q_dims_ptr,  # [HEAD_DIM] int32: Plan.q_dims
    out_dims_ptr,  # [HEAD_DIM] int32: Plan.out_dims
    q_token_stride,
    block_table_stride,
    kv_half_stride,
    scale,  # of the softmax, in log2 units, times the cache's k_scale
    v_scale,
    GROUP: gl.constexpr,
    NUM_KV_HEADS: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    ROWS: gl.constexpr,
    BLOCK_SIZE: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    ORDERED: gl.constexpr,
    PDL: gl.constexpr,
    K_LAYOUT: gl.constexpr,
    V_LAYOUT: gl.constexpr,
    K_SHAPE: gl.constexpr,
    K_ORDER: gl.constexpr,
    P_SHAPE: gl.constexpr,
    P_ORDER: gl.constexpr,
    V_SHAPE: gl.constexpr,
    V_ORDER: gl.constexpr,
):
    """One sequence's KV head over all its keys, output normalized and stored (one split)."""
    _grid_wait(PDL)
    kv_head = gl.program_id(0)
    seq = gl.program_id(1)
    if ORDERED:
        seq = gl.load(seq_order_ptr + seq)
    seq_len = gl.load(seq_lens_ptr + seq)
    num_tiles = gl.cdiv(seq_len, BLOCK_N)
    table = block_tables_ptr + seq.to(gl.int64) * block_table_stride
    k_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, HEAD_DIM], SHARED)
    v_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, HEAD_DIM], SHARED)
    copy_keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, COPY))

    # q [ROWS, HEAD_DIM], its dimensions in the order of K's operand, as float16: it holds every
    # e4m3 value and a bfloat16 query's 8 significant bits exactly (while |q| < 65,504)
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, A_OPERAND))
    q_dims = gl.load(q_dims_ptr + gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, A_OPERAND)))
    q_rows = q_ptr + seq.to(gl.int64) * q_token_stride + (kv_head * GROUP + rows) * HEAD_DIM
    q = gl.load(q_rows[:, None] + q_dims[None, :], mask=(rows < GROUP)[:, None], other=0.0)
    q = q.to(gl.float16)

    for s in gl.static_range(STAGES - 1):  # the first STAGES - 1 tiles in flight
        keys = s * BLOCK_N + copy_keys
        blocks = _tile_blocks(table, keys, seq_len, BLOCK_SIZE)
        _issue_tile(
            k_smem.index(s), v_smem.index(s), cache_ptr, kv_half_stride, blocks, keys, seq_len,
            kv_head, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM,
        )  # fmt: skip
    next_blocks = _tile_blocks(table, (STAGES - 1) * BLOCK_N + copy_keys, seq_len, BLOCK_SIZE)

    row_max = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, MMA))
    row_sum = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(1, MMA))
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=MMA)
    score_keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, MMA))
    for t in range(num_tiles):
        async_copy.wait_group(STAGES - 2)  # tile t has landed (each thread's own copies) ...
        gl.thread_barrier()  # ... every thread's, and tile t - 1's stage is no longer read
        ahead = t + STAGES - 1
        _issue_tile(
            k_smem.index(ahead % STAGES), v_smem.index(ahead % STAGES), cache_ptr,
            kv_half_stride, next_blocks, ahead * BLOCK_N + copy_keys, seq_len, kv_head,
            BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM,
        )  # fmt: skip
        next_blocks = _tile_blocks(table, (ahead + 1) * BLOCK_N + copy_keys, seq_len, BLOCK_SIZE)

        k = k_smem.index(t % STAGES).load(K_LAYOUT).to(gl.float16)
        kt = gl.reshape(gl.permute(gl.reshape(k, K_SHAPE), K_ORDER.value), [HEAD_DIM, BLOCK_N])
        zeros = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=MMA)
        scores = mma_v2(q, gl.convert_layout(kt, B_OPERAND), zeros)
        scores = gl.where(
            (t * BLOCK_N + score_keys < seq_len)[None, :], scores * scale, -float("inf")
        )
        # the running max moves only when a row's scores pass it by more than RESCALE (log2
        # units): until then p < 2^RESCALE, exact enough in float16, and acc is not rescaled
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
            gl.permute(gl.reshape(p.to(gl.float16), P_SHAPE), P_ORDER.value), [ROWS, BLOCK_N]
        )
        v = v_smem.index(t % STAGES).load(V_LAYOUT).to(gl.float16)
        v = gl.reshape(gl.permute(gl.reshape(v, V_SHAPE), V_ORDER.value), [BLOCK_N, HEAD_DIM])
        acc = mma_v2(gl.convert_layout(p, A_OPERAND), gl.convert_layout(v, B_OPERAND), acc)
    async_copy.wait_group(0)  # the copies past the last tile (masked) before the program ends

    out = acc * v_scale / gl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, MMA))
    out_dims = gl.load(out_dims_ptr + gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, MMA)))
    out_rows = (
        out_ptr + (seq.to(gl.int64) * (GROUP * NUM_KV_HEADS) + kv_head * GROUP + rows) * HEAD_DIM
    )
    gl.store(
        out_rows[:, None] + out_dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=(rows < GROUP)[:, None],
    )


def takes(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    head_dim: int,
    group: int,
    splits: int,
    plain: bool,
) -> bool:
    """Whether `fp8_decode_kernel` can serve a decode call: `plain` is one with no shared
    prefix, window, soft cap or fused rotary."""
    return (
        ENABLED
        and plain
        and splits == 1
        and kv_cache.dtype == torch.float8_e4m3fn
        and q.dtype in (torch.bfloat16, torch.float16)
        and q.is_cuda
        and torch.cuda.get_device_capability(q.device)[0] >= 9
        and head_dim == HEAD_DIM
        and group <= ROWS
    )


@functools.cache
def _dims(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Plan.q_dims and Plan.out_dims on `device`."""
    p = plan()
    return (
        torch.tensor(p.q_dims, dtype=torch.int32, device=device),
        torch.tensor(p.out_dims, dtype=torch.int32, device=device),
    )


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
) -> None:
    """The first `num_seqs` rows of q attend to their keys; `pdl`: `pdl.launch_args`."""
    p = plan()
    q_dims, out_dims = _dims(q.device)
    fp8_decode_kernel[(num_kv_heads, num_seqs)](
        q, out, kv_cache, block_tables, seq_lens, seq_lens if seq_order is None else seq_order,
        q_dims, out_dims, q.stride(0), block_tables.stride(0), kv_cache.stride(0),
        scale * 1.4426950408889634, v_scale,
        GROUP=group, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=HEAD_DIM, ROWS=ROWS, BLOCK_SIZE=kv_cache.shape[2], BLOCK_N=BLOCK_N,
        STAGES=STAGES, ORDERED=seq_order is not None, K_LAYOUT=p.k_layout, V_LAYOUT=p.v_layout,
        K_SHAPE=p.k_shape, K_ORDER=p.k_order, P_SHAPE=p.p_shape, P_ORDER=p.p_order,
        V_SHAPE=p.v_shape, V_ORDER=p.v_order, num_warps=1, **pdl,
    )  # fmt: skip
