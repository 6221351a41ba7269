"""Triton GEMMs against cuBLAS at a decode step's shapes: whether a Triton kernel could take a
projection from cuBLAS, and stream-K with it (one program an SM over equal runs of the product's
(tile, K step) iterations, so that no wave runs part-empty: Llama-3-8B's gate_up at 256 rows is
224 tiles of 256 x 128 on 132 SMs, 1.70 waves).

Each way is timed from a CUDA graph replay on cold weights (gemm.py's `Rotation`) and checked
against F.linear first. Ways (tile shapes as BMxBNxBK w<warps> s<stages>):
  linear       F.linear (cuBLAS), what the decoder runs;
  ptr          a one-tile-a-program kernel loading through pointers (cp.async), tiles grouped
               8 row tiles a column;
  tma          the same over TMA descriptors; `swap`: out^T = W x^T, the weight's tile as the
               MMA's A (m64 x n256 products for 256 rows);
  persistent   one program an SM looping over tiles, TMA; `ws`: Triton's warp specialization;
  streamk      stream-K through pointers: the program holding a tile's first K step adds the
               float32 partials the later programs of that tile left in a workspace, flagged
               (release) and taken back to 0 (acquire); `dp`: a program a tile, no partials;
  tmastreamk   stream-K over TMA, out^T = W x^T (the weight's 128-feature tile the MMA's A,
               all 256 rows its B): whole tiles in rounds of one a program, then equal runs
               of the rest's K steps, partials as above; `dp`: a program a tile;
  flattmastreamk  the same with each run's loop over its tiles flattened with their K-step
               loops, as the rounds' loop is (loads may run ahead across a tile's end).
  lasttmastreamk  the flattened form with no waits: each program leaves its partial sums in a
               slot of the tile, and the last to finish the tile (a count taken with acq_rel)
               adds all its slots, 32 features at a time, and stores it.
Usage: PYTHONPATH=src python benchmarks/triton_gemm.py [--model llama-3-8b] [--rows 256]
[--matrices qkv o gate_up] [--ways tmastreamk persistent] (ways whose names start so)
[--timeline] (instead: one stamped launch of each stream-K form over TMA, `timeline`: while,
flattened and last)
"""

from __future__ import annotations

import argparse
import itertools
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from gemm import Rotation, matrices, time_us
from triton.tools.tensor_descriptor import TensorDescriptor

from tandem.config import ModelConfig
from tandem.model.loader import read_hf_config


@triton.jit
def pointer_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr
):  # fmt: skip
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    group = 8 * tiles_n  # 8 row tiles of a column of tiles side by side
    first_m = pid // group * 8
    group_size = min(tiles_m - first_m, 8)
    tile_m = first_m + (pid % group) % group_size
    tile_n = (pid % group) // group_size
    m = tile_m * BM + tl.arange(0, BM)
    n = tile_n * BN + tl.arange(0, BN)
    k = tl.arange(0, BK)
    x_ptrs = x_ptr + m[:, None] * K + k[None, :]
    w_ptrs = w_ptr + n[None, :] * K + k[:, None]
    acc = tl.zeros((BM, BN), tl.float32)
    for _ in range(0, K, BK):
        acc = tl.dot(tl.load(x_ptrs, mask=m[:, None] < M, other=0.0), tl.load(w_ptrs), acc)
        x_ptrs += BK
        w_ptrs += BK
    tl.store(out_ptr + m[:, None] * N + n[None, :], acc.to(tl.bfloat16), mask=m[:, None] < M)


@triton.jit
def tma_kernel(
    x_desc, w_desc, out_desc, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    SWAP: tl.constexpr,
):  # fmt: skip
    tiles_m = tl.cdiv(M, BM)
    tile_m, tile_n = tl.program_id(0) % tiles_m, tl.program_id(0) // tiles_m
    if SWAP:
        acc = tl.zeros((BN, BM), tl.float32)
        for k in range(0, K, BK):
            x = x_desc.load([tile_m * BM, k])
            acc = tl.dot(w_desc.load([tile_n * BN, k]), x.T, acc)
        out_desc.store([tile_m * BM, tile_n * BN], acc.T.to(tl.bfloat16))
    else:
        acc = tl.zeros((BM, BN), tl.float32)
        for k in range(0, K, BK):
            w = w_desc.load([tile_n * BN, k])
            acc = tl.dot(x_desc.load([tile_m * BM, k]), w.T, acc)
        out_desc.store([tile_m * BM, tile_n * BN], acc.to(tl.bfloat16))


@triton.jit
def persistent_kernel(
    x_desc, w_desc, out_desc, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    STAGES: tl.constexpr, PROGRAMS: tl.constexpr, WS: tl.constexpr,
):  # fmt: skip
    tiles_m = tl.cdiv(M, BM)
    tiles = tiles_m * tl.cdiv(N, BN)
    for tile in tl.range(tl.program_id(0), tiles, PROGRAMS, flatten=True, warp_specialize=WS):
        tile_m, tile_n = tile % tiles_m, tile // tiles_m
        acc = tl.zeros((BM, BN), tl.float32)
        for k in tl.range(0, K, BK, num_stages=STAGES):
            w = w_desc.load([tile_n * BN, k])
            acc = tl.dot(x_desc.load([tile_m * BM, k]), w.T, acc)
        out_desc.store([tile_m * BM, tile_n * BN], acc.to(tl.bfloat16))


@triton.jit
def streamk_kernel(
    x_ptr, w_ptr, out_ptr, partial_ptr, flag_ptr, M, N, K, total_iters, BM: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, SWAP: tl.constexpr,
):  # fmt: skip
    programs = tl.num_programs(0)
    pid = tl.program_id(0)
    iters_per_tile = K // BK
    first = pid * total_iters // programs
    end = (pid + 1) * total_iters // programs
    m = tl.arange(0, BM)  # one tile of rows: BM >= M
    n_local = tl.arange(0, BN)
    k_local = tl.arange(0, BK)
    # a partial-sum slot's offsets: [BN, BM] under SWAP, else [BM, BN]
    slot = n_local[:, None] * BM + m[None, :] if SWAP else m[:, None] * BN + n_local[None, :]
    it = first
    while it < end:
        tile = it // iters_per_tile
        tile_first = tile * iters_per_tile
        tile_end = tile_first + iters_per_tile
        stop = tl.minimum(end, tile_end)
        n = tile * BN + n_local
        k = (it - tile_first) * BK + k_local
        if SWAP:  # out^T = W x^T
            x_ptrs = x_ptr + m[None, :] * K + k[:, None]  # [BK, BM]
            w_ptrs = w_ptr + n[:, None].to(tl.int64) * K + k[None, :]  # [BN, BK]
            acc = tl.zeros((BN, BM), tl.float32)
            for _ in range(it, stop):
                x = tl.load(x_ptrs, mask=m[None, :] < M, other=0.0)
                acc = tl.dot(tl.load(w_ptrs), x, acc)
                x_ptrs += BK
                w_ptrs += BK
        else:
            x_ptrs = x_ptr + m[:, None] * K + k[None, :]  # [BM, BK]
            w_ptrs = w_ptr + n[None, :].to(tl.int64) * K + k[:, None]  # [BK, BN]
            acc = tl.zeros((BM, BN), tl.float32)
            for _ in range(it, stop):
                x = tl.load(x_ptrs, mask=m[:, None] < M, other=0.0)
                acc = tl.dot(x, tl.load(w_ptrs), acc)
                x_ptrs += BK
                w_ptrs += BK
        if it == tile_first:  # the owner: the later programs' partials of this tile, then out
            later = pid + 1
            while (later < programs) & (later * total_iters // programs < tile_end):
                while tl.atomic_cas(flag_ptr + later, 1, 0, sem="acquire") != 1:
                    pass
                acc += tl.load(partial_ptr + later * BM * BN + slot, cache_modifier=".cg")
                later += 1
            if SWAP:
                out = out_ptr + m[None, :] * N + n[:, None]
                tl.store(out, acc.to(tl.bfloat16), mask=m[None, :] < M)
            else:
                out = out_ptr + m[:, None] * N + n[None, :]
                tl.store(out, acc.to(tl.bfloat16), mask=m[:, None] < M)
        else:
            tl.store(partial_ptr + pid * BM * BN + slot, acc, cache_modifier=".cg")
            tl.debug_barrier()  # every thread's partials stored before the flag says so
            tl.atomic_xchg(flag_ptr + pid, 1, sem="release")
        it = stop


@triton.jit
def finish_run(
    acc, tile, owner, pid, programs, base, total, iters_per_tile, out_desc, partial_ptr, flag_ptr,
    BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    """A run's end in `tile`: its owner adds the later programs' partials and stores the tile;
    any other program leaves its partial sums [BN, BM] in its slot and flags them."""
    slot = tl.arange(0, BN)[:, None] * BM + tl.arange(0, BM)[None, :]
    if owner:
        tile_end = (tile + 1) * iters_per_tile
        later = pid + 1
        start = base + later * total // programs
        while (later < programs) & (start < tile_end):
            later_end = base + (later + 1) * total // programs
            if later_end > start:  # an empty run leaves no partial
                while tl.atomic_cas(flag_ptr + later, 1, 0, sem="acquire") != 1:
                    pass
                acc += tl.load(partial_ptr + later * BN * BM + slot, cache_modifier=".cg")
            later += 1
            start = later_end
        out_desc.store([0, tile * BN], acc.T.to(out_desc.dtype))
    else:
        tl.store(partial_ptr + pid * BN * BM + slot, acc, cache_modifier=".cg")
        tl.debug_barrier()  # every thread's partials stored before the flag says so
        tl.atomic_xchg(flag_ptr + pid, 1, sem="release")


@triton.jit
def finish_last(
    acc, tile, lo, hi, iters_per_tile, tiles, whole, programs, base, total, rows_in, out_desc,
    out_ptr, partial_ptr, count_ptr, SLOTS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    """A run's end in `tile` (its K steps lo..hi): a whole tile is stored; otherwise the
    partial sums [BM, BN] go to the tile's next free slot, and the program that finishes the
    tile last adds its slots, 32 features at a time, all slots' loads at once (no layout
    change of the accumulator, no waits), stores the tile and takes its two counters back to 0
    for the next launch.
    count_ptr: [2, tiles after the rounds] int32, slots taken and slots filled."""
    tile_first = tile * iters_per_tile
    tile_end = tile_first + iters_per_tile
    if (lo == tile_first) & (hi == tile_end):
        out_desc.store([0, tile * BN], acc.T.to(out_desc.dtype))
    else:
        split = tile - whole
        split_tiles = tl.cdiv(total, iters_per_tile)
        # the programs whose runs cross this tile: first run ending past its start, last run
        # starting before its end (runs are never empty: total >= programs)
        p_lo = tl.cdiv((tile_first - base + 1) * programs, total) - 1
        p_hi = tl.cdiv((tile_end - base) * programs, total) - 1
        slot = tl.atomic_add(count_ptr + split, 1, sem="relaxed")
        rows = tl.arange(0, BM)
        cols = tl.arange(0, BN)
        partials = partial_ptr + (split * SLOTS).to(tl.int64) * BM * BN
        tl.store(partials + slot * BM * BN + rows[:, None] * BN + cols[None, :], acc.T,
                 cache_modifier=".cg")  # fmt: skip
        tl.debug_barrier()  # every thread's partials stored before the count says so
        filled = tl.atomic_add(count_ptr + split_tiles + split, 1, sem="acq_rel")
        if filled == p_hi - p_lo:  # the last
            tl.debug_barrier()
            chunk = tl.arange(0, 32)
            for c in tl.static_range(0, BN, 32):
                offsets = rows[:, None] * BN + (c + chunk)[None, :]
                sums = tl.zeros((BM, 32), tl.float32)
                for s in tl.static_range(SLOTS):
                    sums += tl.load(partials + s * BM * BN + offsets, mask=s <= p_hi - p_lo,
                                    other=0.0, cache_modifier=".cg")  # fmt: skip
                outs = out_ptr + rows[:, None] * (tiles * BN) + tile * BN + c + chunk[None, :]
                tl.store(outs, sums.to(out_ptr.dtype.element_ty), mask=rows[:, None] < rows_in)
            tl.atomic_xchg(count_ptr + split, 0, sem="relaxed")
            tl.atomic_xchg(count_ptr + split_tiles + split, 0, sem="relaxed")


@triton.jit
def tma_streamk_kernel(
    x_desc, w_desc, out_desc, partial_ptr, flag_ptr, times_ptr, out_ptr, rows_in, tiles,
    iters_per_tile, SLOTS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    STAGES: tl.constexpr, FLAT: tl.constexpr, LAST: tl.constexpr, LAST_FIRST: tl.constexpr,
    TIMES: tl.constexpr,
):  # fmt: skip
    """FLAT: a run's loop over its tiles flattened with their K-step loops (as the persistent
    loop over whole tiles is), so loads may run ahead across a tile's end; else a loop a tile
    inside a `while` over the run's tiles. LAST (flattened only): no program waits; each
    leaves its partial sums in a slot of its tile, and the last to finish the tile adds them
    all (`finish_last`, SLOTS a tile). LAST_FIRST: program ids reversed, for the
    interpreter, which runs programs in order (a tile's later programs must store first).
    TIMES: each program stamps its timeline into times_ptr (`STAMPS`)."""
    programs = tl.num_programs(0)
    pid = programs - 1 - tl.program_id(0) if LAST_FIRST else tl.program_id(0)
    stamp(times_ptr, pid, 0, TIMES)
    whole = tiles - tiles % programs  # whole tiles, in rounds of one a program
    for tile in tl.range(pid, whole, programs, flatten=True):
        acc = tl.zeros((BN, BM), tl.float32)
        for k in tl.range(0, iters_per_tile, num_stages=STAGES):
            x = x_desc.load([0, k * BK])
            acc = tl.dot(w_desc.load([tile * BN, k * BK]), x.T, acc)
        out_desc.store([0, tile * BN], acc.T.to(out_desc.dtype))
    stamp(times_ptr, pid, 1, TIMES)
    base = whole * iters_per_tile  # the other tiles' K steps in equal runs
    total = (tiles - whole) * iters_per_tile
    first = base + pid * total // programs
    end = base + (pid + 1) * total // programs
    if FLAT:
        tiles_in_run = tl.cdiv(end, iters_per_tile) - first // iters_per_tile
        for run_tile in tl.range(0, tiles_in_run, flatten=True):
            tile = first // iters_per_tile + run_tile
            lo = tl.maximum(first, tile * iters_per_tile)
            hi = tl.minimum(end, (tile + 1) * iters_per_tile)
            acc = tl.zeros((BN, BM), tl.float32)
            for i in tl.range(lo, hi, num_stages=STAGES):
                k = i - tile * iters_per_tile
                x = x_desc.load([0, k * BK])
                acc = tl.dot(w_desc.load([tile * BN, k * BK]), x.T, acc)
            stamp(times_ptr, pid, 2 + 2 * tl.minimum(run_tile, 2), TIMES)
            if LAST:
                finish_last(acc, tile, lo, hi, iters_per_tile, tiles, whole, programs, base,
                            total, rows_in, out_desc, out_ptr, partial_ptr, flag_ptr, SLOTS, BM,
                            BN)  # fmt: skip
            else:
                finish_run(acc, tile, lo == tile * iters_per_tile, pid, programs, base, total,
                           iters_per_tile, out_desc, partial_ptr, flag_ptr, BM, BN)  # fmt: skip
            stamp(times_ptr, pid, 3 + 2 * tl.minimum(run_tile, 2), TIMES)
    else:
        it = first
        run_tile = 0
        while it < end:
            tile = it // iters_per_tile
            tile_first = tile * iters_per_tile
            stop = tl.minimum(end, tile_first + iters_per_tile)
            acc = tl.zeros((BN, BM), tl.float32)
            for i in tl.range(it, stop, num_stages=STAGES):
                x = x_desc.load([0, (i - tile_first) * BK])
                acc = tl.dot(w_desc.load([tile * BN, (i - tile_first) * BK]), x.T, acc)
            stamp(times_ptr, pid, 2 + 2 * tl.minimum(run_tile, 2), TIMES)
            finish_run(acc, tile, it == tile_first, pid, programs, base, total, iters_per_tile,
                       out_desc, partial_ptr, flag_ptr, BM, BN)  # fmt: skip
            stamp(times_ptr, pid, 3 + 2 * tl.minimum(run_tile, 2), TIMES)
            it = stop
            run_tile += 1
    stamp(times_ptr, pid, 8, TIMES)
    if TIMES:
        tl.store(times_ptr + pid * 10 + 9, tl.extra.cuda.smid().to(tl.int64))


# a program's timeline (ns, globaltimer): start, rounds done, then for each of its run's first
# three tiles the K loop done and the finish (partials stored and flagged, or the owner's waits
# and store) done, end; then its SM
STAMPS = ["start", "rounds", "loop1", "finish1", "loop2", "finish2", "loop3", "finish3", "end",
          "sm"]  # fmt: skip


@triton.jit
def stamp(times_ptr, pid, slot, TIMES: tl.constexpr):
    if TIMES:
        tl.store(times_ptr + pid * 10 + slot, tl.extra.cuda.globaltimer())


def descriptors(x, weight, out, bm, bn, bk):
    return (
        TensorDescriptor.from_tensor(x, [bm, bk]),
        TensorDescriptor.from_tensor(weight, [bn, bk]),
        TensorDescriptor.from_tensor(out, [bm, bn]),
    )


def ways(rows: int, out_features: int, sms: int) -> dict:
    """name -> fn(x, weight, out) for each Triton way and tile shape: the product in `out`, or
    returned."""
    found = {}
    for bm, bn, bk, warps, stages in [(128, 128, 64, 4, 4), (128, 256, 64, 8, 3),
                                      (256, 128, 64, 8, 3), (128, 128, 128, 8, 3)]:  # fmt: skip
        shape = f"{bm}x{bn}x{bk}w{warps}s{stages}"
        grid = (triton.cdiv(rows, bm) * triton.cdiv(out_features, bn),)
        options = dict(num_warps=warps, num_stages=stages)
        found[f"ptr {shape}"] = lambda x, w, out, bm=bm, bn=bn, bk=bk, g=grid, o=options: (
            pointer_kernel[g](x, w, out, rows, out_features, x.shape[1], bm, bn, bk, **o)
        )
        for swap in (False, True):
            found[f"tma {shape}{' swap' * swap}"] = (
                lambda x, w, out, bm=bm, bn=bn, bk=bk, g=grid, o=options, s=swap: tma_kernel[g](
                    *descriptors(x, w, out, bm, bn, bk), rows, out_features, x.shape[1], bm, bn,
                    bk, s, **o,
                )
            )  # fmt: skip
    for (bm, bn, bk, warps, stages), ws in itertools.product(
        [(128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (256, 128, 64, 8, 3)], (False, True)
    ):
        programs = min(sms, triton.cdiv(rows, bm) * triton.cdiv(out_features, bn))
        name = f"persistent {bm}x{bn}x{bk}w{warps}s{stages}{' ws' * ws}"
        found[name] = lambda x, w, out, bm=bm, bn=bn, bk=bk, p=programs, s=stages, ws=ws, nw=warps: (
            persistent_kernel[(p,)](
                *descriptors(x, w, out, bm, bn, bk), rows, out_features, x.shape[1], bm, bn, bk,
                s, p, ws, num_warps=nw,
            )
        )  # fmt: skip
    for (bn, warps, stages), swap, one_tile in itertools.product(
        [(128, 8, 3), (128, 8, 4), (64, 4, 4)], (False, True), (False, True)
    ):
        name = f"streamk 256x{bn}x64w{warps}s{stages}{' swap' * swap}{' dp' * one_tile}"
        found[name] = lambda x, w, out, bn=bn, nw=warps, ns=stages, s=swap, d=one_tile: streamk(
            x, w, out, bn, nw, ns, s, programs=out_features // bn if d else sms
        )
    for (bn, warps, stages), flat, one_tile in itertools.product(
        [(128, 8, 3), (64, 4, 4)], (False, True), (False, True)
    ):
        if flat and one_tile:  # a program a tile has no runs
            continue
        name = f"{'flat' * flat}tmastreamk 256x{bn}x64w{warps}s{stages}{' dp' * one_tile}"
        found[name] = lambda x, w, out, bn=bn, nw=warps, ns=stages, f=flat, d=one_tile: tma_streamk(
            x, w, out, bn, nw, ns, out_features // bn if d else sms, f
        )
    for bn, warps, stages in [(128, 8, 3), (64, 4, 4)]:
        found[f"lasttmastreamk 256x{bn}x64w{warps}s{stages}"] = (
            lambda x, w, out, bn=bn, nw=warps, ns=stages: tma_streamk(
                x, w, out, bn, nw, ns, sms, flat=True, last=True
            )
        )
    return found


WORKSPACES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def workspace(
    programs: int, bn: int, device: torch.device, slots: int = 0, counts: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(partials, flags at 0), made before the timing's graph capture and kept: a slot of
    256 x bn float32 partials and a flag a program; or, given `slots` (partial slots) and
    `counts` (counters), those."""
    key = (programs, bn, device, slots, counts)
    if key not in WORKSPACES:
        WORKSPACES[key] = (
            torch.empty((slots or programs) * 256 * bn, device=device, dtype=torch.float32),
            torch.zeros(counts or programs, device=device, dtype=torch.int32),
        )
    return WORKSPACES[key]


def streamk(x, weight, out, bn, num_warps, num_stages, swap, programs):
    rows, in_features = x.shape
    total_iters = weight.shape[0] // bn * (in_features // 64)
    programs = min(programs, total_iters)
    partials, flags = workspace(programs, bn, x.device)
    streamk_kernel[(programs,)](
        x, weight, out, partials, flags, rows, weight.shape[0], in_features, total_iters, 256, bn,
        64, swap, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip


def tma_streamk(x, weight, out, bn, num_warps, num_stages, programs, flat=False, bk=64,
                times=None, last=False):  # fmt: skip
    """`times`: an int64 tensor [programs, 10] to stamp each program's timeline into. `last`
    (with `flat`): the last program to finish a tile adds its partials (`finish_last`)."""
    tiles, iters_per_tile = weight.shape[0] // bn, x.shape[1] // bk
    programs = min(programs, tiles * iters_per_tile)
    slots = 0
    if last:  # runs never empty: the runs' K steps at least one a program
        while (tiles % programs) * iters_per_tile < programs and tiles % programs:
            programs -= 1
        split_tiles, total = tiles % programs, tiles % programs * iters_per_tile
        slots = triton.cdiv(iters_per_tile, max(total // programs, 1)) + 1
        # `slots` slots a split tile; two counters a split tile (slots taken, slots filled)
        partials, flags = workspace(programs, bn, x.device, max(split_tiles, 1) * slots,
                                    2 * max(split_tiles, 1))  # fmt: skip
    else:
        partials, flags = workspace(programs, bn, x.device)
    tma_streamk_kernel[(programs,)](
        *descriptors(x, weight, out, 256, bn, bk), partials, flags,
        flags if times is None else times, out, x.shape[0], tiles, iters_per_tile, slots, 256,
        bn, bk, num_stages, flat, last, os.environ.get("TRITON_INTERPRET") == "1",
        times is not None, num_warps=num_warps,
    )  # fmt: skip
    return programs


def timeline(x: torch.Tensor, weight: torch.Tensor, form: str, sms: int) -> None:
    """One stream-K launch over TMA (256 x 128 tiles, 3 stages) with each program's timeline
    stamped: µs of each phase over the programs (min / median / max), then the last three to
    end. A program that starts late or waits long in a finish shows here. `form`: while,
    flattened or last (`tma_streamk_kernel`'s FLAT and LAST)."""
    out = torch.empty(x.shape[0], weight.shape[0], device="cuda", dtype=x.dtype)
    flat, last = form != "while", form == "last"
    tma_streamk(x, weight, out, 128, 8, 3, sms, flat, last=last)  # compiled, workspace made
    times = torch.zeros(sms, len(STAMPS), dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()
    programs = tma_streamk(x, weight, out, 128, 8, 3, sms, flat, times=times, last=last)
    torch.cuda.synchronize()
    print("\n".join(timeline_report(times[:programs].cpu(), form)))


def timeline_report(times: torch.Tensor, form: str) -> list[str]:
    """Lines of `timeline`'s report from the stamps [programs, len(STAMPS)] (0: not reached)."""
    t = times.double()
    origin = t[:, 0].min()
    phases = {"start": (None, 0), "rounds": (0, 1), "end": (None, 8)}
    for r in range(3):
        phases[f"loop{r + 1}"] = (1 + 2 * r, 2 + 2 * r)
        phases[f"finish{r + 1}"] = (2 + 2 * r, 3 + 2 * r)
    cells = []
    for name, (a, b) in phases.items():
        present = t[:, b] > 0
        if not present.any():
            continue
        us = (t[present, b] - (origin if a is None else t[present, a])) / 1000
        cells.append(
            f"{name} {us.min():.1f}/{us.median():.1f}/{us.max():.1f} ({int(present.sum())})"
        )
    lines = [f"  {form}: {len(t)} programs on "
             f"{len(set(t[:, 9].tolist()))} SMs; µs min/median/max: " + " | ".join(cells)]  # fmt: skip
    for pid in t[:, 8].argsort(descending=True)[:3].tolist():
        stamps = [f"{(v - origin) / 1000:.1f}" if v > 0 else "-" for v in t[pid, :9].tolist()]
        lines.append(f"    program {pid} (SM {int(t[pid, 9])}): " + " ".join(stamps))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--rows", type=int, nargs="+", default=[256])
    parser.add_argument("--matrices", nargs="+", default=["qkv", "o", "gate_up"])
    parser.add_argument("--ways", nargs="+", help="only ways whose names start so")
    parser.add_argument(
        "--timeline", action="store_true", help="only stream-K over TMA, each program stamped"
    )
    args = parser.parse_args()
    cfg = ModelConfig.from_hf(read_hf_config(args.model)[0])
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name in args.matrices:
        out_features, in_features = matrices(cfg)[name]
        weight = torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16)
        weight /= 64
        rotation = Rotation(weight)
        for rows in args.rows:
            x = torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(rows, out_features, device="cuda", dtype=torch.bfloat16)
            if args.timeline:
                print(f"{name} {out_features}x{in_features} M={rows} stream-K timeline")
                for form in ("while", "flattened", "last"):
                    timeline(x, weight, form, sms)
                continue
            expected = F.linear(x, weight)
            cells = [f"linear {time_us(lambda x, r=rotation: F.linear(x, r.next()), x):.1f}"]
            for way, fn in ways(rows, out_features, sms).items():
                if args.ways and not way.startswith(tuple(args.ways)):
                    continue
                try:
                    out.zero_()
                    got = fn(x, weight, out)
                    got = got if isinstance(got, torch.Tensor) else out
                    torch.testing.assert_close(got, expected, atol=3e-2, rtol=3e-2)
                    us = time_us(lambda x, fn=fn, r=rotation, o=out: fn(x, r.next(), o), x)
                    cells.append(f"{way} {us:.1f}")
                except Exception as error:  # a shape the compiler refuses: the rest run
                    cells.append(f"{way} {type(error).__name__}")
            print(f"{name} {out_features}x{in_features} M={rows} us: " + " | ".join(cells),
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
