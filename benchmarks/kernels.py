"""Per-kernel benchmark of the Triton kernels on a CUDA device (bf16, Llama-3-8B heads).

Decode: bytes of K and V read per second against the measured copy ceiling.
Prefill: causal attention FLOP/s against the measured bf16 GEMM ceiling.
Sampler: the Gumbel-max sampler's logits read per second against the copy ceiling.
Usage: PYTHONPATH=src python benchmarks/kernels.py [--json PATH] [--sweep-prefill] [--sweep-decode]
[--sweep-sampler] [--sweep-small-ops] [--head-dim N]
(--sweep-prefill: every prefill tile shape, each checked against the torch reference first,
timed on a 4K prompt and on chunks of the small, rollout and chat workloads' prompts;
--sweep-decode: decode time, reduce included, for each split count against the default's choice;
--sweep-sampler: the sampler's chunks per row and warps per program;
--eager SHAPE, alone: one decode call launched 3 times, eagerly, for Nsight Compute (`eager`);
--sweep-small-ops, alone: the add + RMSNorm and rotary kernels' warps per program;
--sweep-fp8-fusion, alone: the add + RMSNorm and SiLU * up quantizing as they store (W8A8
inputs) against each kernel followed by quantize_tokens, and the SiLU kernel's warps;
--sweep-shared-prefix, alone: rollout's decode call (32 prompts x 8 samples over a 1,024-token
shared prefix) under each shared-prefix tile shape and split count, then each decode tile shape;
--head-dim: the attention kernels at another head size, e.g. 96 (tiles padded to 128) beside
128, or 128 on this tree beside main's: a power-of-two size must lose nothing to the padding)
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton.testing

from tandem.attention import (
    AttentionMetadata,
    SharedPrefixes,
    gluon_decode,
    rows_per_shared_group,
    triton_backend,
)
from tandem.attention.torch_ref import decode_attention, prefill_attention
from tandem.attention.triton_backend import (
    LARGE_BATCH_TILES,
    SHARED_PREFIX_TILES,
    DecodeTiles,
    PrefillTiles,
    TritonAttention,
)
from tandem.model.fused import (
    _add_rms_norm_triton,
    _rope_qk_triton,
    _silu_and_mul_fp8_triton,
    _silu_and_mul_triton,
    num_sms,
)
from tandem.quant.fp8 import quantize_tokens
from tandem.roofline import H200
from tandem.sampling_kernel import NUM_WARPS, gumbel_argmax

COPY_CEILING = H200.bandwidth  # bytes/s, device-to-device copy, read + write (DESIGN.md)
GEMM_CEILING = H200.flops  # bf16 FLOP/s, an 8192^3 GEMM (DESIGN.md)
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16


def paged_setup(seq_lens: list[int], dtype=torch.bfloat16, num_kv_heads: int = NUM_KV_HEADS):
    blocks_per_seq = [-(-n // BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(blocks_per_seq)
    cache = torch.randn(
        2, num_blocks + 1, BLOCK_SIZE, num_kv_heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16
    ).to(dtype)  # an e4m3 cache: randn's values rounded to it (scales of 1)
    perm = torch.randperm(num_blocks, device="cuda").to(
        torch.int32
    )  # scattered blocks, like a busy cache
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32, device="cuda")
    used = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = perm[used : used + n]
        used += n
    return cache, tables


def step_meta(seq_lens: list[int], starts: list[int], tables: torch.Tensor) -> AttentionMetadata:
    """The metadata of an eager step: sequences of `seq_lens` tokens after it, whose query
    tokens start at `starts` (their K/V already in the cache of `paged_setup`)."""
    return AttentionMetadata(
        slot_mapping=torch.arange(starts[-1], device="cuda"),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        block_tables=tables,
        decode_only=False,
        query_start_loc_host=starts,
        seq_lens_host=seq_lens,
    )


def decode_setup(
    batch: int,
    context: int,
    splits: int | None = None,
    tiles: DecodeTiles | None = None,
    ragged: tuple[int, int, bool] | None = None,
    num_heads: int = NUM_HEADS,
    kv_dtype: torch.dtype = torch.bfloat16,
    num_kv_heads: int = NUM_KV_HEADS,
) -> tuple:
    """(backend, q, out, cache, meta) of one decode call: `bench_decode`'s arguments."""
    contexts = [context] * batch
    if ragged:
        g = torch.Generator().manual_seed(0)
        contexts = torch.randint(ragged[0], ragged[1] + 1, (batch,), generator=g).tolist()
    cache, tables = paged_setup(contexts, kv_dtype, num_kv_heads)
    lens = torch.tensor(contexts, dtype=torch.int32, device="cuda")
    order = torch.argsort(-lens.long(), stable=True).int() if ragged and ragged[2] else None
    q = torch.randn(batch, num_heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    backend = TritonAttention(
        num_heads, num_kv_heads, HEAD_DIM, batch, torch.device("cuda"), num_splits=splits
    )
    if tiles:
        backend.decode_tiles = backend.large_batch_tiles = backend.single_sequence_tiles = tiles
    meta = AttentionMetadata(lens, lens, lens, tables, decode_only=True, seq_order=order)
    return backend, q, out, cache, meta


def bench_decode(
    batch: int,
    context: int,
    splits: int | None = None,
    tiles: DecodeTiles | None = None,
    check: bool = False,
    ragged: tuple[int, int, bool] | None = None,
    num_heads: int = NUM_HEADS,
    kv_dtype: torch.dtype = torch.bfloat16,
    num_kv_heads: int = NUM_KV_HEADS,
) -> dict:
    """GPU time of one decode call, reduce included, replayed from a CUDA graph as the engine does.

    `ragged=(shortest, longest, ordered)`: contexts drawn uniformly from that range (their mean
    near `context`), launched longest first when `ordered`, else in batch order. `num_heads`
    query heads share `num_kv_heads` KV heads (Llama-3-8B's 32 over 8 by default; Qwen3-0.6B has
    16 over 8, Qwen3-30B-A3B 32 over 4)."""
    backend, q, out, cache, meta = decode_setup(
        batch, context, splits, tiles, ragged, num_heads, kv_dtype, num_kv_heads
    )
    tables, lens, contexts = meta.block_tables, meta.seq_lens, meta.seq_lens.tolist()
    if check:
        backend.decode(q, out, cache, meta, HEAD_DIM**-0.5)
        expected = decode_attention(q.float(), cache.float(), tables, lens, HEAD_DIM**-0.5)
        torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)
    torch.cuda.synchronize()  # the timing runs on a side stream: the set-up above must be done
    ms = triton.testing.do_bench_cudagraph(
        lambda: backend.decode(q, out, cache, meta, HEAD_DIM**-0.5), return_mode="median"
    )
    kv_bytes = 2 * sum(contexts) * num_kv_heads * HEAD_DIM * cache.element_size()
    rate = kv_bytes / (ms / 1e3)
    label = f"decode B={batch} ctx={context}"
    if ragged:
        label = f"decode B={batch} ctx={ragged[0]}-{ragged[1]}{' longest 1st' if ragged[2] else ''}"
    if num_heads != NUM_HEADS:
        label += f" {num_heads} heads"
    return {"kernel": label, "ms": ms, "TB/s": rate / 1e12, "ceiling_pct": 100 * rate / COPY_CEILING,
            "splits": backend.num_splits(batch), "tiles": backend.tiles_for(batch)._asdict()}  # fmt: skip


def shared_decode_setup(
    own: int,
    shared_tiles: DecodeTiles = SHARED_PREFIX_TILES,
    prefix_splits: int | None = None,
    tiles: DecodeTiles | None = None,
    groups: int = 32,
    n: int = 8,
    prefix: int = 1024,
    splits: int | None = None,
    kv_dtype: torch.dtype = torch.bfloat16,
) -> tuple:
    """(backend, q, out, cache, meta) of one rollout-shaped decode call: `bench_shared_decode`'s
    arguments."""
    rows, shared_blocks = groups * n, prefix // BLOCK_SIZE
    own_blocks = -(-own // BLOCK_SIZE)
    cache, _ = paged_setup([groups * prefix + rows * own_blocks * BLOCK_SIZE], kv_dtype)
    blocks = torch.randperm(cache.shape[1] - 1, device="cuda").int()
    shared = blocks[: groups * shared_blocks].view(groups, 1, shared_blocks).expand(groups, n, -1)
    owned = blocks[groups * shared_blocks :][: rows * own_blocks].view(groups, n, own_blocks)
    tables = torch.cat([shared, owned], dim=2).reshape(rows, -1).contiguous()
    lens = torch.full((rows,), prefix + own, dtype=torch.int32, device="cuda")
    max_groups = rows // 2
    starts = torch.zeros(max_groups + 1, dtype=torch.int32, device="cuda")
    starts[: groups + 1] = torch.arange(0, rows + 1, n, dtype=torch.int32, device="cuda")
    starts[groups + 1 :] = rows
    group_prefix = torch.zeros(max_groups, dtype=torch.int32, device="cuda")
    group_prefix[:groups] = prefix
    meta = AttentionMetadata(lens, lens, lens, tables, decode_only=True, shared=SharedPrefixes(
        prefix_lens=torch.full_like(lens, prefix), group_rows=torch.arange(rows, dtype=torch.int32,
        device="cuda"), group_starts=starts, group_prefix=group_prefix,
        num_groups=torch.tensor([groups], dtype=torch.int32, device="cuda"), max_groups=max_groups,
    ))  # fmt: skip
    q = torch.randn(rows, NUM_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    backend = TritonAttention(
        NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, rows, torch.device("cuda"), num_splits=splits
    )
    backend.shared_prefix_tiles = shared_tiles
    if tiles:
        backend.decode_tiles = backend.large_batch_tiles = tiles
    if prefix_splits:
        backend.prefix_splits = lambda _: prefix_splits
    return backend, q, out, cache, meta


def bench_shared_decode(own: int, breakdown: bool = False, **setup) -> dict:
    """One decode call of rollout's shape, graph-replayed: `groups` prompts of `prefix` tokens,
    `n` samples each with `own` keys of their own after it, the samples' shared blocks read once
    per group (the shared-prefix kernel, then the decode kernel over the own keys, which merges
    the prefix partials). The grid bound on groups is the engine's for 256 rows (half the rows).
    Checked against the torch reference over each row's whole context first. `setup`:
    `shared_decode_setup`'s keywords (`splits`: of each row's own keys, the heuristic's by
    default). `breakdown`: each of the two launches timed alone too (shared_us, decode_us), and
    both started at once on two streams (concurrent_us)."""
    backend, q, out, cache, meta = shared_decode_setup(own, **setup)
    tables, lens, rows = meta.block_tables, meta.seq_lens, q.shape[0]
    groups, prefix = int(meta.shared.num_groups[0]), int(meta.shared.group_prefix[0])
    n = rows // groups
    scale = HEAD_DIM**-0.5
    backend.decode(q, out, cache, meta, scale)
    expected = decode_attention(q.float(), cache.float(), tables, lens, scale)
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)
    torch.cuda.synchronize()

    def us(fn) -> float:
        return 1000 * triton.testing.do_bench_cudagraph(fn, return_mode="median")

    total = us(lambda: backend.decode(q, out, cache, meta, scale))
    kv_bytes = 2 * (groups * prefix + rows * own) * NUM_KV_HEADS * HEAD_DIM * cache.element_size()
    rate = kv_bytes / (total / 1e6)
    row = {"kernel": f"shared decode {groups}x{n} prefix={prefix} own={own}", "ms": total / 1e3,
           "TB/s": rate / 1e12, "ceiling_pct": 100 * rate / COPY_CEILING}  # fmt: skip
    if breakdown:  # each launch alone: the shared-prefix kernel, then the decode kernel
        splits = backend.prefix_splits(meta.shared)
        row["shared_us"] = us(
            lambda: backend.shared_prefix(q, cache, meta, scale, 1.0, 1, splits, 0.0)
        )
        shared_prefix, backend.shared_prefix = backend.shared_prefix, lambda *args: None
        row["decode_us"] = us(lambda: backend.decode(q, out, cache, meta, scale))
        # the two on two streams from the start, each unordered to the other (its merge reads
        # partials it did not wait for: timing only): what overlapping them could reach
        side = torch.cuda.Stream()

        def concurrent() -> None:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                shared_prefix(q, cache, meta, scale, 1.0, 1, splits, 0.0)
            backend.decode(q, out, cache, meta, scale)
            torch.cuda.current_stream().wait_stream(side)

        row["concurrent_us"] = us(concurrent)
    return row


SHARED_GRID = [(64, 4, 2), (64, 4, 3), (64, 4, 4), (32, 4, 3), (32, 4, 4), (64, 8, 3), (128, 8, 2),
               (128, 4, 2)]  # fmt: skip
OWN_GRID = [(64, 2, 2), (64, 2, 3), (32, 2, 3), (64, 4, 3), (128, 4, 3), (32, 4, 2)]


def sweep_shared_prefix(
    shared_grid=SHARED_GRID, prefix_splits=(1, 2, 4), own_grid=OWN_GRID, cuts: bool = True
) -> None:
    """µs of rollout's decode call at three lengths of the samples' own keys: each shared-prefix
    tile shape of `shared_grid` at each of `prefix_splits` splits of the shared keys (* the
    defaults), then each decode tile shape of `own_grid` for the own keys (the shared keys at
    the default tiles). `cuts`: first the default tiles with 8 sequences a shared-prefix program
    against the default's."""
    owns = (64, 256, 500)
    for cut in (None, 8) if cuts else ():  # rows per shared-prefix program: default's, and 8
        if cut:
            triton_backend.rows_per_shared_group = lambda *_, c=cut: c
        for own in owns:
            row = bench_shared_decode(own, breakdown=True)
            print(f"{row['kernel']} rows cut at {cut or 'default'}: {1000 * row['ms']:.1f} us "
                  f"({row['TB/s']:.2f} TB/s); alone: shared-prefix {row['shared_us']:.1f}, "
                  f"decode {row['decode_us']:.1f}", flush=True)  # fmt: skip
    triton_backend.rows_per_shared_group = rows_per_shared_group
    default_splits = TritonAttention(
        NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, 256, torch.device("cuda")
    ).prefix_splits(SharedPrefixes(*(None,) * 5, max_groups=128))
    grid = [SHARED_PREFIX_TILES, *(DecodeTiles(*t) for t in shared_grid)]
    for shared_tiles in dict.fromkeys(grid):  # the default once
        for splits in prefix_splits:
            mark = "*" if shared_tiles == SHARED_PREFIX_TILES and splits == default_splits else " "
            try:
                cells = [
                    bench_shared_decode(own, shared_tiles=shared_tiles, prefix_splits=splits)
                    for own in owns
                ]
            except Exception as error:  # out of shared memory, or a wrong result
                print(f"shared {shared_tiles} splits={splits}  failed: "
                      f"{str(error).splitlines()[0][:80]}", flush=True)  # fmt: skip
                break
            print(f"shared {shared_tiles} splits={splits}{mark} us  " + "  ".join(
                f"own={own}:{1000 * c['ms']:.1f} ({c['TB/s']:.2f} TB/s)"
                for own, c in zip(owns, cells, strict=True)), flush=True)  # fmt: skip
    for tiles in (DecodeTiles(*t) for t in own_grid):
        try:
            cells = [bench_shared_decode(own, tiles=tiles) for own in owns]
        except Exception as error:
            print(f"decode {tiles}  failed: {str(error).splitlines()[0][:80]}", flush=True)
            continue
        print(f"decode {tiles} us  " + "  ".join(
            f"own={own}:{1000 * c['ms']:.1f}" for own, c in zip(owns, cells, strict=True)),
            flush=True)  # fmt: skip


def small_chunk(tokens: int = 8192) -> list[int]:
    """Prompt lengths of one of the small workload's prefill chunks: uniform in [100, 1024], as
    many as fit `tokens` (the engine's default chunk), the last one cut to fill it."""
    g = torch.Generator().manual_seed(0)
    lengths: list[int] = []
    while sum(lengths) < tokens:
        lengths.append(min(int(torch.randint(100, 1025, (1,), generator=g)), tokens - sum(lengths)))
    return lengths


def bench_prefill(
    lengths: list[int],
    tiles: PrefillTiles | None = None,
    check: bool = False,
    num_heads: int = NUM_HEADS,
    kv_dtype: torch.dtype = torch.bfloat16,
    cached: int = 0,
) -> dict:
    """One prefill call over prompts whose last `lengths` tokens are computed after `cached`
    tokens already in the cache (0: whole prompts), eager as the engine runs it; `num_heads`
    query heads share the 8 KV heads (see bench_decode)."""
    seq_lens = [cached + n for n in lengths]
    cache, tables = paged_setup(seq_lens)
    starts = [0, *itertools.accumulate(lengths)]
    q = torch.randn(starts[-1], num_heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    backend = TritonAttention(num_heads, NUM_KV_HEADS, HEAD_DIM, len(lengths), torch.device("cuda"))
    backend.prefill_tiles = tiles or backend.prefill_tiles
    meta = step_meta(seq_lens, starts, tables)
    if check:
        backend.prefill(q, out, cache, meta, HEAD_DIM**-0.5)
        expected = prefill_attention(q.float(), cache.float(), meta, HEAD_DIM**-0.5)
        torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)
    ms = triton.testing.do_bench(
        lambda: backend.prefill(q, out, cache, meta, HEAD_DIM**-0.5), return_mode="median"
    )
    # QK^T and PV over the causal (query, key) pairs: cached x L + L(L + 1)/2 a prompt, as the
    # roofline counts them
    pairs = sum(cached * n + n * (n + 1) // 2 for n in lengths)
    flops = 2 * 2 * num_heads * HEAD_DIM * pairs
    rate = flops / (ms / 1e3)
    label = f"prefill L={lengths[0]}"
    if len(lengths) > 1:
        label = f"prefill {len(lengths)} prompts, {sum(lengths)} tokens"
    if cached:
        label += f" after {cached} cached"
    if num_heads != NUM_HEADS:
        label += f" {num_heads} heads"
    return {
        "kernel": label,
        "ms": ms,
        "TFLOP/s": rate / 1e12,
        "ceiling_pct": 100 * rate / GEMM_CEILING,
        "tiles": backend.prefill_tiles._asdict(),
    }


def bench_mixed(decodes: int, context: int, prompt: int, split: bool) -> dict:
    """A step with prefill as the engine sees one: `decodes` running requests' one-token rows at
    `context`, then a `prompt`-token prompt. `split`: the engine's path (the decode rows to the
    decode kernel, the prompt to the prefill kernel); else every row in the prefill kernel.
    'Ceiling' here: K/V bytes of the decode rows over the copy ceiling plus the prompt's causal
    FLOPs over the GEMM ceiling, the two kernels' bounds one after the other."""
    seq_lens = [context] * decodes + [prompt]
    starts = [*range(decodes + 1), decodes + prompt]
    cache, tables = paged_setup(seq_lens)
    q = torch.randn(starts[-1], NUM_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    backend = TritonAttention(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, decodes + 1, torch.device("cuda"))
    meta = step_meta(seq_lens, starts, tables)
    scale = HEAD_DIM**-0.5
    out = torch.empty_like(q)

    def run() -> torch.Tensor:
        if split:
            return backend(q, cache, meta, scale)
        backend.prefill(q, out, cache, meta, scale)
        return out

    expected = prefill_attention(q.float(), cache.float(), meta, scale)
    torch.testing.assert_close(run().float(), expected, atol=3e-2, rtol=3e-2)
    ms = triton.testing.do_bench(run, return_mode="median")
    bound = 2 * decodes * context * NUM_KV_HEADS * HEAD_DIM * 2 / COPY_CEILING + (
        2 * 2 * NUM_HEADS * HEAD_DIM * prompt * prompt / 2 / GEMM_CEILING
    )
    how = "decodes to the decode kernel" if split else "all in the prefill kernel"
    return {"kernel": f"mixed {decodes}x{context} + {prompt}, {how}", "ms": ms,
            "ceiling_pct": 100 * bound / (ms / 1e3)}  # fmt: skip


def bench_sampler(
    rows: int, vocab: int, num_chunks: int | None = None, num_warps: int = NUM_WARPS
) -> dict:
    """One Gumbel-max draw over [rows, vocab] bf16 logits at temperature 1, graph-replayed; its
    tokens checked against the default launch's first."""
    g = torch.Generator(device="cuda").manual_seed(rows)
    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16, generator=g)
    temperature = torch.ones(rows, device="cuda")
    seeds = torch.arange(rows, dtype=torch.int32, device="cuda")
    positions = torch.full((rows,), 700, dtype=torch.int32, device="cuda")
    expected = gumbel_argmax(logits, temperature, seeds, positions)
    assert torch.equal(
        gumbel_argmax(logits, temperature, seeds, positions, num_chunks, num_warps), expected
    )
    torch.cuda.synchronize()
    ms = triton.testing.do_bench_cudagraph(
        lambda: gumbel_argmax(logits, temperature, seeds, positions, num_chunks, num_warps),
        return_mode="median",
    )
    rate = logits.numel() * logits.element_size() / (ms / 1e3)
    return {"kernel": f"sampler rows={rows} vocab={vocab}", "ms": ms, "TB/s": rate / 1e12,
            "ceiling_pct": 100 * rate / COPY_CEILING}  # fmt: skip


def sweep_sampler() -> None:
    """Chunks per row (programs = rows x chunks) and warps per program, in µs per draw."""
    sms = num_sms(torch.device("cuda"))
    for rows in (1, 32, 256):
        for vocab in (128256, 151936):
            for num_warps in (4, 8, 16):
                cells = []
                for per_sm in (1, 2, 4, 8, 16):
                    chunks = -(-per_sm * sms // rows)
                    ms = bench_sampler(rows, vocab, chunks, num_warps)["ms"]
                    cells.append(f"{per_sm}/SM ({chunks}):{1000 * ms:.1f}")
                print(f"sampler rows={rows:<3} vocab={vocab} warps={num_warps:<2} us  "
                      + "  ".join(cells), flush=True)  # fmt: skip


WARPS = (1, 2, 4, 8, 16, 32)


def sweep_small_ops() -> None:
    """The residual add + RMSNorm and the q/k rotary + K/V store under each warp count, in µs per
    call, graph-replayed (their inputs stay in the L2, as in a step, where the kernel before just
    wrote them); each checked against the default launch first."""
    dev = torch.device("cuda")
    # (rows, hidden, split-K parts): seed's and latency's layers, small's, a prefill chunk's
    for rows, hidden, parts in ((1, 4096, 4), (32, 4096, 4), (32, 4096, 0), (128, 1024, 4),
                                (256, 1024, 2), (8192, 1024, 0)):  # fmt: skip
        x = torch.randn(*((parts,) if parts else ()), rows, hidden, device=dev)
        x = x if parts else x.bfloat16()
        residual = torch.randn(rows, hidden, device=dev, dtype=torch.bfloat16)
        weight = torch.randn(hidden, device=dev, dtype=torch.bfloat16)
        expected = _add_rms_norm_triton(x, residual.clone(), weight, 1e-6)[0]
        for warps in WARPS:  # all checked before any timing, which adds to the residual
            out = _add_rms_norm_triton(x, residual.clone(), weight, 1e-6, warps)[0]
            torch.testing.assert_close(out, expected, atol=1e-2, rtol=1e-2)
        cells = []
        for warps in WARPS:
            ms = triton.testing.do_bench_cudagraph(
                lambda w=warps, a=(x, residual, weight): _add_rms_norm_triton(*a, 1e-6, w),
                return_mode="median",
            )
            cells.append(f"{warps}:{1000 * ms:.2f}")
        print(f"add_rms_norm rows={rows:<5} hidden={hidden} parts={parts} us by warps  "
              + "  ".join(cells), flush=True)  # fmt: skip
    # (rows, q heads, kv heads): Llama-3-8B, Qwen3-0.6B (with its q/k norms)
    for rows, q_heads, kv_heads in ((1, 32, 8), (32, 32, 8), (256, 16, 8), (8192, 16, 8)):
        qkv = torch.randn(rows, (q_heads + 2 * kv_heads) * HEAD_DIM, device=dev).bfloat16()
        q, k, v = qkv.view(rows, -1, HEAD_DIM).split([q_heads, kv_heads, kv_heads], dim=1)
        cache = torch.zeros(2, rows // BLOCK_SIZE + 2, BLOCK_SIZE, kv_heads, HEAD_DIM, device=dev,
                            dtype=torch.bfloat16)  # fmt: skip
        positions = torch.arange(rows, device=dev) + 600
        cos_sin = torch.randn(rows + 600, HEAD_DIM, device=dev)
        slots = torch.arange(rows, device=dev)
        norms = (torch.randn(HEAD_DIM, device=dev).bfloat16(),) * 2 if q_heads == 16 else ()
        args = (q, k, v, positions, cos_sin, cache, slots, *(norms or (None, None)), 1e-6)
        expected = _rope_qk_triton(*args)
        cells = []
        for warps in WARPS:  # the q/k norms' sums may round differently by warps
            out = _rope_qk_triton(*args, num_warps=warps)
            torch.testing.assert_close(out, expected, atol=1e-2, rtol=1e-2)
            ms = triton.testing.do_bench_cudagraph(
                lambda w=warps, a=args: _rope_qk_triton(*a, num_warps=w), return_mode="median"
            )
            cells.append(f"{warps}:{1000 * ms:.2f}")
        print(f"rope_qk rows={rows:<5} heads={q_heads}/{kv_heads} us by warps  "
              + "  ".join(cells), flush=True)  # fmt: skip


def sweep_fp8_fusion() -> None:
    """µs per call, graph-replayed, Llama-3-8B's widths: the norm before qkv / gate_up (4
    split-K parts and a residual in) and SiLU * up before down, each as one quantizing kernel
    against the kernel then quantize_tokens (the codes checked equal first)."""
    dev = torch.device("cuda")

    def us(fn) -> str:
        return f"{1000 * triton.testing.do_bench_cudagraph(fn, return_mode='median'):.2f}"

    for rows in (2, 32, 64, 256, 8192):
        parts = torch.randn(4, rows, 4096, device=dev)
        residual = torch.randn(rows, 4096, device=dev, dtype=torch.bfloat16)
        weight = torch.randn(4096, device=dev, dtype=torch.bfloat16)
        norm = (parts, residual, weight, 1e-6)
        fresh = (parts, residual.clone(), weight, 1e-6)  # each call adds to its residual
        fused_codes = _add_rms_norm_triton(*fresh, fp8_out=True)[0].values
        unfused = quantize_tokens(_add_rms_norm_triton(parts, residual, weight, 1e-6)[0])[0]
        assert torch.equal(fused_codes.view(torch.uint8), unfused.view(torch.uint8))
        print(f"add_rms_norm rows={rows:<5} us: then quantize_tokens "
              f"{us(lambda a=norm: quantize_tokens(_add_rms_norm_triton(*a)[0]))}  fused "
              f"{us(lambda a=norm: _add_rms_norm_triton(*a, fp8_out=True))}", flush=True)  # fmt: skip
        gate_up = torch.randn(rows, 2 * 14336, device=dev, dtype=torch.bfloat16)
        unfused = quantize_tokens(_silu_and_mul_triton(gate_up))[0].view(torch.uint8)
        cells = []
        for warps in (8, 16, 32):
            codes = _silu_and_mul_fp8_triton(gate_up, warps).values
            assert torch.equal(codes.view(torch.uint8), unfused)
            fused = lambda w=warps, g=gate_up: _silu_and_mul_fp8_triton(g, w)  # noqa: E731
            cells.append(f"{warps}:{us(fused)}")
        print(f"silu_and_mul rows={rows:<5} us: then quantize_tokens "
              f"{us(lambda g=gate_up: quantize_tokens(_silu_and_mul_triton(g)))}  fused by warps "
              + "  ".join(cells), flush=True)  # fmt: skip


def sweep_decode() -> None:
    """Each split count at a few batch sizes and contexts (* marks the heuristic's pick), then
    each tile shape at the heuristic's split count, checked against the reference first."""
    for batch in (1, 8, 32, 64, 256):
        default = TritonAttention(
            NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, batch, torch.device("cuda")
        ).num_splits(batch)
        for context in (512, 1024, 4096):
            times = []
            for splits in (1, 2, 4, 8, 16, 32):
                row = bench_decode(batch, context, splits)
                times.append(f"{splits}{'*' if splits == default else ''}:{1000 * row['ms']:.1f}")
            print(
                f"decode B={batch:<3} ctx={context:<5} us by splits  " + "  ".join(times),
                flush=True,
            )
    shapes = ((1, 512), (8, 1024), (32, 512), (32, 1024), (32, 4096), (256, 1024))
    for block_n in (32, 64, 128):
        for num_warps in (2, 4, 8):
            for num_stages in (1, 2, 3, 4):
                tiles = DecodeTiles(block_n, num_warps, num_stages)
                try:
                    bench_decode(4, 1000, tiles=tiles, check=True)
                    times = [bench_decode(b, n, tiles=tiles)["ms"] for b, n in shapes]
                except Exception as error:  # out of shared memory, or a wrong result
                    print(f"{tiles}  failed: {str(error).splitlines()[0][:80]}", flush=True)
                    continue
                cells = "  ".join(
                    f"B{b}xctx{n}:{1000 * ms:.1f}" for (b, n), ms in zip(shapes, times, strict=True)
                )
                print(f"{tiles}  us  {cells}", flush=True)


def sweep_decode_splits() -> None:
    """Each split count on the workloads' decode shapes, µs with the reduce (* the heuristic's
    pick): where batch x KV heads nearly fills the SMs (moe: 32 x 4 = 128 programs on 132), is
    one split, without its reduce launch, faster than two?"""
    shapes = {
        "moe 32x640": dict(batch=32, context=640, num_kv_heads=4),
        "moe 32x1152": dict(batch=32, context=1152, num_kv_heads=4),
        "moe1 1x400": dict(batch=1, context=400, num_kv_heads=4),
        "moe 16x640": dict(batch=16, context=640, num_kv_heads=4),
        "seed 32x1K": dict(batch=32, context=1024),
        "seed 16x1K": dict(batch=16, context=1024),
        "latency 1x400": dict(batch=1, context=400),
        # 256 rows: 2,048 programs fill the SMs about 4 times over (ends of waves)
        "llama 256x256": dict(batch=256, context=256),
        "llama 256x1K": dict(batch=256, context=1024),
        "small 256x100-1100": dict(batch=256, context=600, ragged=(100, 1100, True), num_heads=16),
        "small-fp8kv 256x100-1100": dict(
            batch=256,
            context=600,
            ragged=(100, 1100, True),
            num_heads=16,
            kv_dtype=torch.float8_e4m3fn,
        ),
    }
    for name, shape in shapes.items():
        kv_heads = shape.get("num_kv_heads", NUM_KV_HEADS)
        default = TritonAttention(
            NUM_HEADS, kv_heads, HEAD_DIM, shape["batch"], torch.device("cuda")
        ).num_splits(shape["batch"])
        bench_decode(check=True, splits=default, **shape)
        cells = []
        for splits in (1, 2, 4, 8, 16, 32):
            if splits > 4 and shape["batch"] > 1:
                break
            us = 1000 * bench_decode(splits=splits, **shape)["ms"]
            cells.append(f"{splits}{'*' if splits == default else ''}:{us:.1f}")
        print(f"{name:<14} us by splits  " + "  ".join(cells), flush=True)


def decode_times(label: str, check: dict | None, shapes: dict, **launch) -> dict | None:
    """ms of one decode call at each shape under `launch` (bench_decode's tiles, splits, cache
    dtype), after `check` (bench_decode's arguments for a check against the reference; None:
    none); None, with a line saying why, where a launch fails (out of shared memory) or the
    check does."""
    try:
        if check is not None:
            bench_decode(**check)
        return {name: bench_decode(**launch, **shape)["ms"] for name, shape in shapes.items()}
    except Exception as error:
        print(f"{label}  failed: {str(error).splitlines()[0][:80]}", flush=True)
        return None


MOE_GRID = [(32, 2, 2), (32, 4, 2), (64, 2, 2), (64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 4, 3)]


def sweep_moe_decode_tiles(grid=MOE_GRID, split_counts=(1, 2, 4)) -> None:
    """Qwen3-30B-A3B's batch-32 decode (32 query heads over 4 KV heads: 8 rows of a 16-row
    tile a program) by tile shape and split count, µs (* the defaults: 128-key tiles, 4 warps,
    3 stages, 2 splits, merged by the last). At 2 splits of 640 keys, 128-key tiles make 3 and 2
    tiles a split; the question is whether shorter or fewer tiles a program save time."""
    shapes = {
        "32x256": dict(batch=32, context=256, num_kv_heads=4),
        "32x640": dict(batch=32, context=640, num_kv_heads=4),
        "32x1152": dict(batch=32, context=1152, num_kv_heads=4),
    }
    default = DecodeTiles()
    best: tuple[float, DecodeTiles, int] | None = None
    for block_n, num_warps, num_stages in grid:
        tiles = DecodeTiles(block_n, num_warps, num_stages)
        for splits in split_counts:
            check = dict(check=True, splits=splits, tiles=tiles, **shapes["32x640"])
            times = decode_times(f"{tiles} {splits}", check, shapes, splits=splits, tiles=tiles)
            if times is None:
                continue
            mark = "*" if tiles == default and splits == 2 else " "
            cells = "  ".join(f"{name}:{1000 * ms:.1f}" for name, ms in times.items())
            print(
                f"{block_n},{num_warps},{num_stages} splits {splits}{mark} us  {cells}", flush=True
            )
            total = sum(times.values())
            if best is None or total < best[0]:
                best = (total, tiles, splits)
    if best:
        print(f"fastest over the three: {','.join(map(str, best[1]))} splits {best[2]}")


def sweep_deep_stages() -> None:
    """Tiles at 5-9 stages against the defaults. The block table's entries are loads the K and
    V copies depend on, so Triton's pipeliner gives each of the two (num_stages - 1) // 2
    stages: K and V are copied a tile ahead at 2-4 stages and two tiles ahead from 5 (sm_90
    SASS: the key loop's waits leave copy groups in flight, against none). The decode tile
    sweep's shapes over bf16 and e4m3 caches, moe's at one and two splits, rollout's decode call
    by shared-prefix tiles and by the own keys' tiles."""
    deep = [(64, 2, 5), (32, 2, 5), (32, 2, 7), (64, 4, 5), (32, 4, 5), (128, 4, 5), (64, 2, 6),
            (64, 4, 7)]  # fmt: skip
    for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        sweep_decode_tiles(kv_dtype, grid=deep)
    sweep_moe_decode_tiles(
        [(128, 4, 3), (128, 4, 5), (128, 4, 6), (128, 4, 7), (64, 4, 5), (64, 4, 7), (64, 2, 5),
         (64, 2, 7), (128, 8, 5), (32, 4, 7), (32, 2, 9)], split_counts=(1, 2),
    )  # fmt: skip
    sweep_shared_prefix(
        [(64, 4, 2), (64, 4, 5), (64, 4, 6), (64, 4, 7), (32, 4, 7), (32, 4, 9), (128, 4, 5),
         (64, 8, 5), (32, 2, 7)], prefix_splits=(1, 2),
        own_grid=[(64, 2, 2), (64, 2, 5), (32, 2, 5)], cuts=False,
    )  # fmt: skip


# the workloads' own decode shapes (small: Qwen3-0.6B's 16 heads over 8 KV heads, 256 ragged
# contexts longest first; seed: Llama-3-8B at 32 x 1K)
DECODE_SHAPES = {
    "small 256x100-1100": dict(batch=256, context=600, ragged=(100, 1100, True), num_heads=16),
    "small 256x100-2000": dict(batch=256, context=1050, ragged=(100, 2000, True), num_heads=16),
    "small 256x600": dict(batch=256, context=600, num_heads=16),
    "seed 32x1K": dict(batch=32, context=1024),
    "llama 256x1K": dict(batch=256, context=1024),
}
GLUON_GRID = [(16, 4, 16), (16, 3, 16), (16, 6, 16), (32, 3, 16), (32, 4, 16), (16, 4, 8)]


def sweep_gluon_decode(grid=GLUON_GRID) -> None:
    """The Gluon decode kernel over a bf16 cache (TANDEM_GLUON_DECODE=all) at each (block_n,
    stages, row_lanes) of `grid`, then the Triton kernel, µs: the large-batch decode shapes
    (small's 256 ragged rows checked against the torch reference) and rollout's decode call at
    64 / 256 / 500 own keys (checked). Then rollout's call over an e4m3 cache (scales 1,
    checked), each launch alone too: the Triton decode kernel, then the Gluon one."""
    shapes = {n: DECODE_SHAPES[n] for n in ("small 256x100-1100", "small 256x600", "llama 256x1K")}
    for shape in [*grid, None]:
        gluon_decode.SIXTEEN_BIT = shape is not None
        if shape is not None:
            gluon_decode.TILES[2] = gluon_decode.Tiles(*shape)
        label = f"gluon {shape}" if shape else "triton"
        bench_decode(check=True, **shapes["small 256x100-1100"])
        times = {name: 1000 * bench_decode(**s)["ms"] for name, s in shapes.items()}
        for own in (64, 256, 500):
            times[f"rollout own={own}"] = 1000 * bench_shared_decode(own)["ms"]
        print(f"{label:24s} " + "  ".join(f"{n}:{us:.1f}" for n, us in times.items()), flush=True)
    gluon_decode.SIXTEEN_BIT = False
    for gluon in (False, True):
        gluon_decode.ENABLED = gluon
        rows = [bench_shared_decode(own, breakdown=True, kv_dtype=torch.float8_e4m3fn)
                for own in (64, 256, 500)]  # fmt: skip
        print(f"e4m3 rollout, {'gluon' if gluon else 'triton'} decode: " + "  ".join(
            f"{1000 * r['ms']:.1f} (shared {r['shared_us']:.1f}, own {r['decode_us']:.1f})"
            for r in rows), flush=True)  # fmt: skip


def sweep_decode_tiles(
    kv_dtype: torch.dtype = torch.bfloat16, only_default: bool = False, grid=None
) -> None:
    """Each tile shape on the workloads' own decode shapes (small: Qwen3-0.6B's 16 heads over 8 KV
    heads, 256 ragged contexts longest first; seed: Llama-3-8B at 32 x 1K), in µs, * the default.
    `kv_dtype` e4m3: an FP8 cache, with 16- and 256-key tiles and one warp in the sweep too.
    `only_default`: the tiles each shape takes by default, and nothing else. `grid`: these
    (block_n, num_warps, num_stages) and the two defaults (DecodeTiles(), LARGE_BATCH_TILES)
    instead of the full sweep."""
    shapes = DECODE_SHAPES
    default = DecodeTiles()
    best: tuple[float, DecodeTiles] | None = None
    fp8 = kv_dtype != torch.bfloat16
    if only_default:
        times = {
            name: bench_decode(kv_dtype=kv_dtype, **shape)["ms"] for name, shape in shapes.items()
        }
        print("default tiles, us  " + "  ".join(f"{n}:{1000 * ms:.1f}" for n, ms in times.items()))
        return
    if grid is None:
        grid = itertools.product(
            (16, 32, 64, 128, 256) if fp8 else (32, 64, 128),
            (1, 2, 4, 8) if fp8 else (2, 4, 8),
            (2, 3, 4) if fp8 else (1, 2, 3, 4),
        )
    else:
        grid = dict.fromkeys([tuple(default), tuple(LARGE_BATCH_TILES), *grid])
    for shape in grid:
        tiles = DecodeTiles(*shape)
        # the check's reference reads a bf16 cache
        check = None if fp8 else dict(batch=4, context=1000, tiles=tiles, check=True,
                                      num_heads=16)  # fmt: skip
        times = decode_times(str(tiles), check, shapes, tiles=tiles, kv_dtype=kv_dtype)
        if times is None:
            continue
        cells = "  ".join(f"{name}:{1000 * ms:.1f}" for name, ms in times.items())
        print(f"{tiles}{'*' if tiles == default else ' '} us  {cells}", flush=True)
        small = times["small 256x100-1100"] + times["small 256x100-2000"]
        if best is None or small < best[0]:
            best = (small, tiles)
    if best:  # the last word: a TANDEM_DECODE_TILES value
        print(f"fastest on small's two ragged shapes: {','.join(map(str, best[1]))}")


def sweep_prefill() -> None:
    """Each tile shape: checked against the reference on a 1K prompt and on two prompts after
    cached tokens, then timed on a 4K prompt (Llama-3-8B heads), on a chunk of the small
    workload's prompts (Qwen3-0.6B heads), on one of rollout's (8 prompts of 1,024 tokens) and
    on one of chat's (64 prompts' 128 own tokens after a cached 2,048-token system prompt)."""
    shapes = {"4K": dict(lengths=[4096]), "small chunk": dict(lengths=small_chunk(), num_heads=16),
              "rollout chunk": dict(lengths=[1024] * 8),
              "chat chunk": dict(lengths=[128] * 64, cached=2048)}  # fmt: skip
    default = PrefillTiles()
    for rows in (64, 128):
        for block_n in (32, 64, 128):
            for num_warps in (4, 8):
                for num_stages in (2, 3):
                    tiles = PrefillTiles(rows, block_n, num_warps, num_stages)
                    try:
                        bench_prefill([1024], tiles, check=True)
                        bench_prefill([128, 100], tiles, check=True, cached=300)
                        timed = {
                            name: bench_prefill(tiles=tiles, **shape)
                            for name, shape in shapes.items()
                        }
                    except Exception as error:  # out of shared memory, or a wrong result
                        print(f"{tiles}  failed: {str(error).splitlines()[0][:80]}", flush=True)
                        continue
                    cells = "  ".join(
                        f"{name}: {row['ms']:.3f} ms {row['TFLOP/s']:.0f} TFLOP/s "
                        f"{row['ceiling_pct']:.1f}%"
                        for name, row in timed.items()
                    )
                    print(f"{tiles}{'*' if tiles == default else ' '} {cells}", flush=True)


# the decode calls `--eager` launches: small's ragged steps over a bf16 and an e4m3 cache,
# moe's batch 32 (32 query heads over 4 KV heads), rollout's 256 rows at 256 keys of their own
EAGER_SHAPES = {
    "small": dict(batch=256, context=600, ragged=(100, 1100, True), num_heads=16),
    "small-fp8": dict(
        batch=256, context=600, ragged=(100, 1100, True), num_heads=16, kv_dtype=torch.float8_e4m3fn
    ),
    "moe": dict(batch=32, context=640, num_kv_heads=4),
    "seed": dict(batch=32, context=1024),
}


def eager(shape: str, times: int = 3) -> None:
    """One decode call of `shape` (EAGER_SHAPES, or "rollout") launched `times` times eagerly,
    for a profiler that reads one launch's hardware counters, e.g. Nsight Compute:
    ncu --clock-control none -k regex:decode_kernel -s 2 -c 1 python3 benchmarks/kernels.py
    --eager small-fp8"""
    if shape == "rollout":
        backend, q, out, cache, meta = shared_decode_setup(own=256)
    else:
        backend, q, out, cache, meta = decode_setup(**EAGER_SHAPES[shape])
    for _ in range(times):
        backend.decode(q, out, cache, meta, HEAD_DIM**-0.5)
    torch.cuda.synchronize()
    print(f"{shape}: {times} decode calls")


def main() -> None:
    global HEAD_DIM
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--sweep-prefill", action="store_true")
    parser.add_argument("--sweep-decode", action="store_true")
    parser.add_argument("--sweep-sampler", action="store_true")
    parser.add_argument("--sweep-decode-tiles", action="store_true", help="only this sweep")
    parser.add_argument("--sweep-small-ops", action="store_true", help="only this sweep")
    parser.add_argument("--sweep-decode-splits", action="store_true", help="only this sweep")
    parser.add_argument("--sweep-fp8-fusion", action="store_true", help="only this sweep")
    parser.add_argument("--sweep-shared-prefix", action="store_true", help="only this sweep")
    parser.add_argument("--sweep-moe-decode-tiles", action="store_true", help="only this sweep")
    parser.add_argument("--sweep-deep-stages", action="store_true", help="only this sweep")
    parser.add_argument("--sweep-gluon-decode", action="store_true", help="only this sweep")
    parser.add_argument("--decode-shapes", action="store_true",
                        help="only the decode tile sweep's shapes, at the default tiles")  # fmt: skip
    parser.add_argument("--head-dim", type=int, default=HEAD_DIM)
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                        help="--sweep-decode-tiles over an e4m3 cache")  # fmt: skip
    parser.add_argument("--eager", choices=[*EAGER_SHAPES, "rollout"],
                        help="only launch that decode call 3 times, eagerly (for a profiler)")  # fmt: skip
    args = parser.parse_args()
    HEAD_DIM = args.head_dim
    if args.eager:
        eager(args.eager)
        return
    kv_dtype = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else torch.bfloat16
    if args.sweep_decode_tiles or args.decode_shapes:
        sweep_decode_tiles(kv_dtype, only_default=args.decode_shapes)
        return
    if args.sweep_small_ops:
        sweep_small_ops()
        return
    if args.sweep_decode_splits:
        sweep_decode_splits()
        return
    if args.sweep_fp8_fusion:
        sweep_fp8_fusion()
        return
    if args.sweep_shared_prefix:
        sweep_shared_prefix()
        return
    if args.sweep_gluon_decode:
        sweep_gluon_decode()
        return
    if args.sweep_deep_stages:
        sweep_deep_stages()
        return
    if args.sweep_moe_decode_tiles:
        sweep_moe_decode_tiles()
        return
    rows = [
        bench_decode(32, 4096),
        bench_decode(256, 1024),
        bench_decode(1, 4096),
        bench_decode(1, 512),
        bench_decode(256, 1000, ragged=(100, 1900, False)),  # like the small workload's steps
        bench_decode(256, 1000, ragged=(100, 1900, True)),
        bench_prefill([4096]),
        bench_prefill(small_chunk(), num_heads=16),  # one of the small workload's prefill chunks
        bench_mixed(240, 600, 2048, split=True),  # like the small workload's admission steps
        bench_mixed(240, 600, 2048, split=False),
        bench_sampler(1, 128256),  # the latency workload's draw
        bench_sampler(32, 128256),  # seed's
        bench_sampler(256, 151936),  # small's
    ]
    for row in rows:
        rate = f"{row['TFLOP/s']:.0f} TFLOP/s" if "TFLOP/s" in row else ""
        rate = f"{row['TB/s']:.2f} TB/s" if "TB/s" in row else rate
        print(
            f"{row['kernel']:52} {row['ms']:8.3f} ms  {rate:>14}  {row['ceiling_pct']:5.1f}% of ceiling",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    if args.sweep_decode:
        sweep_decode()
    if args.sweep_prefill:
        sweep_prefill()
    if args.sweep_sampler:
        sweep_sampler()


if __name__ == "__main__":
    main()
