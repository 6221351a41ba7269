"""Triton paged attention against the torch reference (CPU: Triton's interpreter, fp32/fp16)."""

from __future__ import annotations

import dataclasses
import itertools
import random

import numpy as np
import pytest
import torch
import triton

from tandem import config
from tandem.attention import AttentionMetadata, triton_backend
from tandem.attention.torch_ref import decode_attention, prefill_attention
from tandem.attention.triton_backend import DecodeTiles, PrefillTiles

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16] if DEVICE.type == "cpu" else [torch.bfloat16, torch.float16]
TOL = {torch.float32: 2e-3, torch.float16: 2e-2, torch.bfloat16: 3e-2}


def make_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (2, num_blocks + 1, block_size, num_kv_heads, head_dim)
    return torch.randn(shape, generator=g).to(dtype).to(DEVICE)


def block_tables_for(seq_lens, block_size, max_blocks, num_blocks, seed=0):
    """Each sequence gets distinct random blocks (a shuffled cache), padded with garbage ids."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.randint(0, num_blocks, (len(seq_lens), max_blocks), generator=g)
    used = 0
    for i, n in enumerate(seq_lens):
        k = -(-n // block_size)
        tables[i, :k] = perm[used : used + k]
        used += k
    return tables.to(torch.int32).to(DEVICE)


def attention(num_kv_heads, group, head_dim, max_seqs=8, num_splits=None):
    return triton_backend.TritonAttention(
        num_kv_heads * group, num_kv_heads, head_dim, max_seqs, DEVICE, num_splits=num_splits
    )


DECODE_CASES = [
    # (num_kv_heads, group, head_dim, block_size, seq_lens, num_splits)
    (2, 1, 64, 16, [1, 17, 33], 1),
    (2, 4, 64, 16, [16, 64, 130], 3),  # ends on a block boundary; contexts longer than one split
    (1, 8, 128, 16, [200, 5], 4),
    (2, 4, 128, 32, [97, 128], 2),
    (4, 2, 64, 8, [9, 70, 1, 129], None),
    (2, 4, 128, 16, [300, 3, 64], 1),  # one split: written directly, no reduce
    (2, 4, 128, 16, [300], None),  # one sequence: its own short tiles over 32 splits
    (8, 4, 128, 64, [1000], None),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("num_kv_heads", "group", "head_dim", "block_size", "seq_lens", "splits"), DECODE_CASES
)
def test_decode_matches_reference(
    dtype, num_kv_heads, group, head_dim, block_size, seq_lens, splits, tiles=None
):
    num_blocks, max_blocks = 64, 24
    cache = make_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    tables = block_tables_for(seq_lens, block_size, max_blocks, num_blocks)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(seq_lens), num_kv_heads * group, head_dim).to(dtype).to(DEVICE)
    scale = head_dim**-0.5
    backend = attention(num_kv_heads, group, head_dim, num_splits=splits)
    if tiles:
        backend.decode_tiles = backend.large_batch_tiles = backend.single_sequence_tiles = tiles
    out = torch.empty_like(q)
    meta = AttentionMetadata(lens, lens, lens, tables, decode_only=True)
    backend.decode(q, out, cache, meta, scale)
    expected = decode_attention(q.float(), cache.float(), tables, lens, scale)
    torch.testing.assert_close(out.float(), expected, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("merge", [False, True])
@pytest.mark.parametrize("splits", [2, 5, 32])
def test_split_partials_merged_by_the_last_split_or_the_reduce_match_reference(
    merge, splits, monkeypatch
):
    """Merged by the last split of each sequence's KV head to finish (no reduce launch), which
    sets its arrival count back to zero, so that launch after launch (as graph replays) the
    counts start from zero; contexts shorter than the splits leave some splits without keys."""
    num_kv_heads, group, head_dim, block_size = 2, 4, 64, 16
    dtype = DTYPES[-1]
    monkeypatch.setattr(
        triton_backend.TritonAttention, "last_split_merges", staticmethod(lambda *_: merge)
    )
    reduces = []
    monkeypatch.setattr(
        triton_backend, "reduce_kernel", ReduceSpy(reduces, triton_backend.reduce_kernel)
    )
    backend = attention(num_kv_heads, group, head_dim, num_splits=splits)
    for seed, seq_lens in enumerate([[300, 3, 64], [1, 17], [130, 129, 16, 2]]):
        cache = make_cache(64, block_size, num_kv_heads, head_dim, dtype, seed)
        tables = block_tables_for(seq_lens, block_size, 24, 64, seed)
        lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
        q = torch.randn(len(seq_lens), num_kv_heads * group, head_dim).to(dtype).to(DEVICE)
        out = torch.empty_like(q)
        meta = AttentionMetadata(lens, lens, lens, tables, decode_only=True)
        backend.decode(q, out, cache, meta, head_dim**-0.5)
        expected = decode_attention(q.float(), cache.float(), tables, lens, head_dim**-0.5)
        torch.testing.assert_close(out.float(), expected, atol=TOL[dtype], rtol=TOL[dtype])
        assert not backend.arrivals.any()
    assert len(reduces) == (0 if merge else 3)


def test_the_last_split_merges_batches_of_several_sequences_in_up_to_four_splits(monkeypatch):
    merges = triton_backend.TritonAttention.last_split_merges
    assert merges(32, 2) and merges(16, 4) and merges(2, 3)
    assert not merges(1, 2) and not merges(1, 32) and not merges(8, 8)
    monkeypatch.setattr(triton_backend, "SPLIT_MERGE", False)  # TANDEM_SPLIT_MERGE=0
    assert not merges(32, 2)


class ReduceSpy:
    """A kernel that counts its launches."""

    def __init__(self, launches: list, kernel):
        self.launches, self.kernel = launches, kernel

    def __getitem__(self, grid):
        self.launches.append(grid)
        return self.kernel[grid]


@pytest.mark.parametrize("tiles", [DecodeTiles(16, 2, 1), DecodeTiles(64, 8, 4)])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_tile_shapes_match_reference(tiles, splits):
    """Tiles smaller and larger than a block, partial last tiles, split and direct outputs."""
    test_decode_matches_reference(torch.float32, 2, 4, 64, 16, [300, 3, 64, 129], splits, tiles)


def test_split_count_fills_the_device_once():
    backend = attention(8, 4, 128, max_seqs=256)
    backend.num_sms = 132
    splits = {batch: backend.num_splits(batch) for batch in (1, 8, 16, 17, 32, 256)}
    assert splits == {1: 32, 8: 4, 16: 2, 17: 1, 32: 1, 256: 1}
    for batch, count in splits.items():  # enough programs for every SM, never twice too many
        assert batch * 8 * count >= 132 or count == triton_backend.MAX_SPLITS
        assert count == 1 or batch * 8 * count // 2 < 132


PREFILL_CASES = [
    # (num_kv_heads, group, head_dim, block_size, cached, new): sequence i has cached[i] tokens
    # already in the cache and new[i] query tokens this step
    (2, 1, 64, 16, [0, 0], [5, 37]),
    (2, 4, 64, 16, [16, 3, 0], [16, 1, 70]),  # chunked prefill over a cached prefix, a decode row
    (1, 8, 128, 16, [20], [33]),
    (4, 2, 64, 8, [0, 9], [1, 24]),
]


def ragged_step(dtype, num_kv_heads, group, head_dim, block_size, cached, new):
    """Queries, a shuffled cache and the metadata of a step whose sequences have `cached` tokens
    in the cache before it and `new` query tokens in it."""
    seq_lens = [c + n for c, n in zip(cached, new, strict=True)]
    cache = make_cache(48, block_size, num_kv_heads, head_dim, dtype)
    tables = block_tables_for(seq_lens, block_size, 16, 48)
    starts = [0]
    for n in new:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], num_kv_heads * group, head_dim).to(dtype).to(DEVICE)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64, device=DEVICE),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=tables,
        decode_only=False,
        query_start_loc_host=starts,
        seq_lens_host=seq_lens,
    )
    return q, cache, meta


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("num_kv_heads", "group", "head_dim", "block_size", "cached", "new"), PREFILL_CASES
)
def test_prefill_with_cached_prefix_matches_reference(
    dtype, num_kv_heads, group, head_dim, block_size, cached, new, tiles=None
):
    q, cache, meta = ragged_step(dtype, num_kv_heads, group, head_dim, block_size, cached, new)
    scale = head_dim**-0.5
    out = torch.empty_like(q)
    backend = attention(num_kv_heads, group, head_dim)
    backend.prefill_tiles = tiles or backend.prefill_tiles
    backend.prefill(q, out, cache, meta, scale)
    expected = prefill_attention(q.float(), cache.float(), meta, scale)
    torch.testing.assert_close(out.float(), expected, atol=TOL[dtype], rtol=TOL[dtype])


def test_leading_single_tokens_counts_the_one_token_rows_before_the_first_longer_one():
    assert triton_backend.leading_single_tokens([0, 1, 2, 5, 6]) == 2
    assert triton_backend.leading_single_tokens([0, 4, 5]) == 0
    assert triton_backend.leading_single_tokens([0, 1, 2, 3]) == 3
    assert triton_backend.leading_single_tokens([0]) == 0


def test_host_launch_math_agrees_with_tritons_helpers():
    for n in range(1, 1100):
        assert config.next_power_of_2(n) == triton.next_power_of_2(n)
        assert config.cdiv(n, 64) == triton.cdiv(n, 64)


def test_leading_single_tokens_agrees_with_counting_row_by_row():
    rng = random.Random(0)
    for _ in range(200):
        lengths = [1] * rng.randrange(0, 300) + [
            rng.choice([1, 2, 7]) for _ in range(rng.randrange(5))
        ]
        starts = [0, *itertools.accumulate(lengths)]
        count = 0
        while count < len(lengths) and lengths[count] == 1:
            count += 1
        assert triton_backend.leading_single_tokens(starts) == count


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("ordered", [False, True])
def test_mixed_step_sends_its_leading_decodes_to_the_decode_kernel_and_matches_reference(
    dtype, splits, ordered
):
    """Decode rows, then chunks of prompts, then a one-token row after them (left to the prefill
    kernel): every row's output against the reference, and each kernel ran on its own rows.
    `ordered`: the decodes listed longest first, the order's other entries unused (zeros)."""
    num_kv_heads, group, head_dim = 2, 4, 64
    cached, new = [40, 17, 63, 0, 30, 9], [1, 1, 1, 50, 7, 1]
    q, cache, meta = ragged_step(dtype, num_kv_heads, group, head_dim, 16, cached, new)
    if ordered:
        order = torch.tensor([2, 0, 1, 0, 0, 0], dtype=torch.int32, device=DEVICE)
        meta = dataclasses.replace(meta, seq_order=order)
    backend = attention(num_kv_heads, group, head_dim, num_splits=splits)
    calls = []
    for kind in ("decode", "prefill"):
        run = getattr(backend, kind)

        def recorded(*args, run=run, kind=kind, **kwargs):
            calls.append((kind, kwargs))
            run(*args, **kwargs)

        setattr(backend, kind, recorded)
    scale = head_dim**-0.5
    out = backend(q, cache, meta, scale)
    options = {"v_scale": 1.0, "sliding_window": None, "logits_soft_cap": None}
    assert calls == [
        ("decode", {"num_seqs": 3, **options}),
        ("prefill", {"first_seq": 3, **options}),
    ]
    expected = prefill_attention(q.float(), cache.float(), meta, scale)
    torch.testing.assert_close(out.float(), expected, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize(
    "tiles", [PrefillTiles(32, 16, 4, 2), PrefillTiles(128, 32, 8, 3), PrefillTiles(16, 64, 4, 3)]
)
def test_prefill_tile_shapes_match_reference(tiles):
    """Unmasked key tiles before each query tile's diagonal, masked ones on it, for several shapes."""
    test_prefill_with_cached_prefix_matches_reference(
        torch.float32, 2, 4, 64, 16, [40, 0, 7], [90, 61, 1], tiles
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_in_longest_first_order_matches_reference(dtype):
    """A ragged batch launched in `seq_order`: every sequence's output still lands in its row."""
    seq_lens = [40, 300, 7, 129, 300, 64]
    num_kv_heads, group, head_dim, block_size = 2, 4, 64, 16
    cache = make_cache(64, block_size, num_kv_heads, head_dim, dtype)
    tables = block_tables_for(seq_lens, block_size, 24, 64)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    order = torch.argsort(-lens.long(), stable=True).to(torch.int32)
    q = torch.randn(len(seq_lens), num_kv_heads * group, head_dim).to(dtype).to(DEVICE)
    for splits in (1, 4):
        backend = attention(num_kv_heads, group, head_dim, num_splits=splits)
        out = torch.full_like(q, float("nan"))
        meta = AttentionMetadata(lens, lens, lens, tables, decode_only=True, seq_order=order)
        backend.decode(q, out, cache, meta, head_dim**-0.5)
        expected = decode_attention(q.float(), cache.float(), tables, lens, head_dim**-0.5)
        torch.testing.assert_close(out.float(), expected, atol=TOL[dtype], rtol=TOL[dtype])
    # the kernel does follow the order: one listing sequence 0 everywhere fills only its row
    backend = attention(num_kv_heads, group, head_dim, num_splits=1)
    out = torch.full_like(q, float("nan"))
    meta = AttentionMetadata(lens, lens, lens, tables, decode_only=True, seq_order=order * 0)
    backend.decode(q, out, cache, meta, head_dim**-0.5)
    assert not out[0].isnan().any() and out[1:].isnan().all()


def test_decode_steps_list_their_sequences_longest_context_first(make_tiny, monkeypatch):
    """All rows of a decode step; in a step with prefill, the one-token rows that lead it."""
    from tandem import LLM, SamplingParams

    llm = LLM(str(make_tiny("llama")), attention_backend="triton", max_model_len=128,
              num_blocks=64, max_num_batched_tokens=64)  # fmt: skip
    engine = llm.engine
    launched, mixed = [], []
    launch = engine.runner.launch

    def record(batch, timeline):
        x, n = batch.slot.np_in, batch.num_seqs_padded
        if batch.decode_only:
            launched.append((x["seq_order"][:n].copy(), x["seq_lens"][:n].copy()))
        else:
            n = triton_backend.leading_single_tokens(batch.query_start_loc)
            mixed.append((x["seq_order"][:n].copy(), x["seq_lens"][:n].copy()))
        launch(batch, timeline)

    monkeypatch.setattr(engine.runner, "launch", record)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for i, n in enumerate([5, 30, 12, 30, 1]):  # no shared prefixes: every prompt prefilled
        ids = list(range(40 * i + 1, 40 * i + n + 1))
        engine.enqueue(engine.make_request(str(i), params, prompt_token_ids=ids))
    while engine.has_unfinished():
        engine.step()
    assert len(launched) >= 4 and any(len(order) > 1 for order, _ in mixed)
    for order, lens in launched + mixed:
        assert sorted(order.tolist()) == list(range(len(lens)))
        assert (lens[order][:-1] >= lens[order][1:]).all()
    assert any((order != range(len(order))).any() for order, _ in launched)  # some were reordered


def test_a_decode_rows_slot_is_its_tables_slot_of_its_last_position(make_tiny, monkeypatch):
    """The decode kernel that stores the new key (`Unrotated`) stores it at the row's slot and
    reads it back through the block table: in every decode-only step, each real row's slot is
    its table's slot of position seq_len - 1, and each padding row's is -1. Preemption and
    copy on write included (a small cache, samples of one prompt)."""
    from tandem import LLM, SamplingParams

    llm = LLM(str(make_tiny("llama")), attention_backend="triton", max_model_len=64,
              num_blocks=16, block_size=4, max_num_batched_tokens=64)  # fmt: skip
    engine = llm.engine
    seen = []
    launch = engine.runner.launch

    def record(batch, timeline):
        if batch.decode_only:
            x, n, real = batch.slot.np_in, batch.num_seqs_padded, len(batch.seq_lens)
            seen.append(n)
            lens, slots = x["seq_lens"][:n], x["slot_mapping"][:n]
            tables, block = x["block_tables"][:n], engine.config.block_size
            last = lens[:real] - 1
            at = tables[np.arange(real), last // block] * block + last % block
            assert (slots[:real] == at).all() and (slots[real:] == -1).all()
        launch(batch, timeline)

    monkeypatch.setattr(engine.runner, "launch", record)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=10, ignore_eos=True, n=3)
    prompts = [{"prompt_token_ids": list(range(7 * i + 1, 7 * i + 14))} for i in range(2)]
    llm.generate(prompts, params, use_tqdm=False)
    assert len(seen) > 10 and engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("tiles", [DecodeTiles(), PrefillTiles()])
def test_tiles_that_do_not_fit_are_shrunk_until_they_do_and_the_fit_is_remembered(tiles):
    """A launch Triton refuses (OutOfResources, raised before anything is enqueued) is retried
    with fewer stages, then fewer keys; the first shape that launches is kept for the key."""
    from triton.runtime.errors import OutOfResources

    tried = []

    def launch(t):  # a device that fits 32 keys in one stage and nothing larger
        tried.append(t)
        if t.num_stages > 1 or t.block_n > 32:
            raise OutOfResources(300_000, 232_448, "shared memory")

    fitted = {}
    triton_backend.launch_fitting(fitted, "k", tiles, launch)
    assert tried[-1] == tiles._replace(num_stages=1, block_n=32)
    assert len(tried) == tiles.num_stages + 2  # 3, 2, 1 stages; then 64, 32 keys
    tried.clear()
    triton_backend.launch_fitting(fitted, "k", tiles, launch)
    assert tried == [tiles._replace(num_stages=1, block_n=32)]  # straight to the fit
    tried.clear()
    triton_backend.launch_fitting(fitted, "other", tiles, lambda t: tried.append(t))
    assert tried == [tiles]  # a shape that fits is launched as it is


def test_a_kernel_too_large_at_the_smallest_tiles_raises():
    from triton.runtime.errors import OutOfResources

    def launch(t):
        raise OutOfResources(300_000, 232_448, "shared memory")

    with pytest.raises(OutOfResources):
        triton_backend.launch_fitting({}, "k", DecodeTiles(), launch)


def test_float32_at_head_dim_128_runs_with_the_default_tiles():
    """The engine's dtype="float32" on a Llama-shaped head: the tiles must fit the device."""
    test_decode_matches_reference(torch.float32, 2, 4, 128, 16, [300, 3, 64], 1)
    test_decode_matches_reference(torch.float32, 2, 4, 128, 16, [300, 3, 64], 4)
    test_prefill_with_cached_prefix_matches_reference(
        torch.float32, 2, 4, 128, 16, [40, 0, 7], [90, 61, 1]
    )


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_with_triton_backend_gives_the_torch_backend_tokens(make_tiny, arch):
    from tandem import LLM, SamplingParams

    prompts = [{"prompt_token_ids": list(range(3 + 5 * i, 20 + 9 * i))} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(make_tiny(arch)), attention_backend=backend, max_model_len=128, num_blocks=32,
                  max_num_batched_tokens=24)  # fmt: skip
        tokens[backend] = [
            o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)
        ]
    assert tokens["triton"] == tokens["torch"]


def test_decode_tiles_setting_parses_three_ints_and_rejects_anything_else(monkeypatch):
    from tandem import envs

    assert triton_backend.decode_tiles_setting() is None
    assert envs.parse_decode_tiles("64,8,2") == (64, 8, 2)
    for bad in ("64,8", "64,8,x", "48,4,2", "64,3,2", "64,4,0"):
        with pytest.raises(ValueError, match="TANDEM_DECODE_TILES"):
            envs.parse_decode_tiles(bad)
    monkeypatch.setenv("TANDEM_DECODE_TILES", "32,2,1")
    backend = triton_backend.TritonAttention(4, 2, 16, 2, torch.device("cpu"))
    assert backend.tiles_for(2) == backend.tiles_for(256) == DecodeTiles(32, 2, 1)


def test_shared_prefix_tiles_setting_sets_the_cascade_kernels_tiles_alone(monkeypatch):
    assert attention(8, 4, 128).shared_prefix_tiles == triton_backend.SHARED_PREFIX_TILES
    monkeypatch.setenv("TANDEM_SHARED_PREFIX_TILES", "32,4,4")
    backend = attention(8, 4, 128)
    assert backend.shared_prefix_tiles == DecodeTiles(32, 4, 4)
    assert backend.tiles_for(32) == DecodeTiles()  # the decode kernel's own are untouched
    monkeypatch.setenv("TANDEM_SHARED_PREFIX_TILES", "32,4")
    with pytest.raises(ValueError, match="TANDEM_SHARED_PREFIX_TILES"):
        attention(8, 4, 128)


def test_decode_register_cap_reaches_cuda_launches_only(monkeypatch):
    assert triton_backend.decode_launch_options(torch.device("cuda")) == {}
    monkeypatch.setenv("TANDEM_DECODE_MAXNREG", "192")
    assert triton_backend.decode_launch_options(torch.device("cuda")) == {"maxnreg": 192}
    assert triton_backend.decode_launch_options(torch.device("cpu")) == {}  # the interpreter
    # the backend on this run's device (the test runs on the GPU too): the cap on CUDA only
    cap = {"maxnreg": 192} if DEVICE.type == "cuda" else {}
    assert attention(8, 4, 128).decode_options == cap


def test_large_decode_batches_take_the_large_batch_tiles():
    backend = attention(8, 4, 128, max_seqs=256)
    assert backend.tiles_for(1) == backend.single_sequence_tiles
    assert backend.tiles_for(32) == backend.tiles_for(127) == DecodeTiles()
    assert backend.tiles_for(128) == backend.tiles_for(256) == triton_backend.LARGE_BATCH_TILES


def test_decode_steps_rotate_in_the_decode_kernel_under_the_large_batch_over_16_bit_caches():
    """`Unrotated` q goes to the decode kernel at decode-only steps without shared prefixes of
    fewer than LARGE_BATCH rows over a cache that is not FP8 (where it measured slower), while
    `rotates` is on; inside `rotated_before` (graph capture's warm-up of the kernel that steps
    with prefill take) never, and after it as before."""
    from tandem.attention import SharedPrefixes, rotated_before, rotates_in_decode
    from tandem.attention.torch_ref import torch_attention

    backend = attention(2, 4, 64, max_seqs=256)
    cache = make_cache(4, 16, 2, 64, torch.bfloat16)

    def meta(rows, decode_only=True, shared=None):
        lens = torch.ones(rows, dtype=torch.int32, device=DEVICE)
        tables = torch.zeros(rows, 1, dtype=torch.int32, device=DEVICE)
        return AttentionMetadata(lens, lens, lens, tables, decode_only, shared=shared)

    small = triton_backend.LARGE_BATCH - 1
    assert rotates_in_decode(backend, meta(1), cache)
    assert rotates_in_decode(backend, meta(small), cache)
    assert not rotates_in_decode(backend, meta(triton_backend.LARGE_BATCH), cache)
    assert not rotates_in_decode(backend, meta(small, decode_only=False), cache)
    zeros = torch.zeros(small, dtype=torch.int32, device=DEVICE)
    shared = SharedPrefixes(zeros, zeros, zeros, zeros, zeros[:1], 1)
    assert not rotates_in_decode(backend, meta(small, shared=shared), cache)
    assert not rotates_in_decode(backend, meta(1), cache.to(torch.float8_e4m3fn))
    assert rotates_in_decode(backend, meta(1), cache.float())  # float32: the CPU tests' models
    with rotated_before(backend):
        assert not rotates_in_decode(backend, meta(1), cache)
    assert rotates_in_decode(backend, meta(1), cache)
    with rotated_before(torch_attention):  # a backend without the rotary: nothing to switch
        assert not rotates_in_decode(torch_attention, meta(1), cache)
    backend.rotates = False  # TANDEM_FUSED_ROPE=0
    assert not rotates_in_decode(backend, meta(1), cache)


def windowed_decode_case(dtype, head_dim, window, soft_cap, splits, seq_lens):
    num_kv_heads, group, block_size = 2, 2, 16
    cache = make_cache(64, block_size, num_kv_heads, head_dim, dtype)
    tables = block_tables_for(seq_lens, block_size, 24, 64)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(seq_lens), num_kv_heads * group, head_dim).to(dtype).to(DEVICE)
    meta = AttentionMetadata(lens, lens, lens, tables, decode_only=True)
    options = {"sliding_window": window, "logits_soft_cap": soft_cap}
    backend = attention(num_kv_heads, group, head_dim, num_splits=splits)
    out = torch.full_like(q, float("nan"))
    backend.decode(q, out, cache, meta, head_dim**-0.5, **options)
    expected = decode_attention(q.float(), cache.float(), tables, lens, head_dim**-0.5, **options)
    torch.testing.assert_close(out.float(), expected, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("head_dim", [48, 80, 96, 256])
@pytest.mark.parametrize(("window", "soft_cap"), [(None, None), (37, None), (20, 50.0)])
def test_decode_at_any_head_size_with_and_without_a_window_matches_reference(
    head_dim, window, soft_cap
):
    """Padded tiles (48 -> 64 wide, 80 and 96 -> 128), windows that start inside a tile, on a
    tile boundary (a 32-key window of a 64-token context) and cover a whole short context."""
    dtype = DTYPES[-1] if head_dim == 256 else DTYPES[0]  # fp16 / fp32 on CPU, bf16 on CUDA
    for splits in (1, 3):
        windowed_decode_case(dtype, head_dim, window, soft_cap, splits, [1, 64, 150, 300])


@pytest.mark.parametrize("head_dim", [48, 80, 96, 256])
@pytest.mark.parametrize(("window", "soft_cap"), [(None, None), (23, None), (40, 30.0)])
def test_prefill_at_any_head_size_with_and_without_a_window_matches_reference(
    head_dim, window, soft_cap
):
    """Chunks over a cached prefix longer than the window, a fresh prompt, a decode row."""
    dtype = DTYPES[-1] if head_dim == 256 else DTYPES[0]  # fp16 / fp32 on CPU, bf16 on CUDA
    q, cache, meta = ragged_step(dtype, 2, 2, head_dim, 16, [50, 0, 30], [40, 70, 1])
    options = {"sliding_window": window, "logits_soft_cap": soft_cap}
    backend = attention(2, 2, head_dim)
    backend.prefill_tiles = PrefillTiles(rows=32, block_n=16, num_warps=4, num_stages=1)
    out = torch.full_like(q, float("nan"))
    backend.prefill(q, out, cache, meta, head_dim**-0.5, **options)
    expected = prefill_attention(q.float(), cache.float(), meta, head_dim**-0.5, **options)
    torch.testing.assert_close(out.float(), expected, atol=TOL[dtype], rtol=TOL[dtype])


def test_windowed_decode_reads_no_key_before_the_window():
    """Keys outside the window are skipped, not masked: NaN in every block before the tile the
    window starts in (16-key tiles, one per block) changes nothing."""
    seq_lens, window, head_dim = [300, 90], 40, 64
    dtype = DTYPES[0]
    cache = make_cache(64, 16, 2, head_dim, dtype)
    tables = block_tables_for(seq_lens, 16, 24, 64)
    for i, n in enumerate(seq_lens):  # every block wholly before the window of NaN
        before = tables[i, : (n - window) // 16].long()
        cache[:, before] = float("nan")
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(2, 4, head_dim, device=DEVICE).to(dtype)
    meta = AttentionMetadata(lens, lens, lens, tables, decode_only=True)
    for splits in (1, 4):
        backend = attention(2, 2, head_dim, num_splits=splits)
        backend.decode_tiles = DecodeTiles(block_n=16, num_warps=4, num_stages=1)
        out = backend(q, cache, meta, 0.125, sliding_window=window)
        assert not out.isnan().any()
        expected = decode_attention(
            q.float(), cache.float().nan_to_num(), tables, lens, 0.125, sliding_window=window
        )
        torch.testing.assert_close(out.float(), expected, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("head_dim", [8, 257, 512])
def test_head_sizes_the_kernels_cannot_take_raise_value_error(head_dim):
    with pytest.raises(ValueError, match="head_dim"):
        attention(2, 2, head_dim)


ROPE_CASES = [
    # (num_kv_heads, group, head_dim, seq_lens, splits, window, norms, cache dtype)
    (2, 4, 128, [1, 17, 64, 130], 1, None, True, None),  # one split; a key opening a tile
    (2, 4, 128, [1, 17, 64, 130], 2, None, False, None),  # split merge
    (1, 8, 96, [33, 5, 70], 3, None, True, None),  # padded head size; the reduce launch
    (2, 2, 64, [50, 9, 1], 2, 20, True, None),  # a window
    # an e4m3 cache, its scales: on the GPU only (the interpreter rounds float32 values just
    # below a power of two to half of it when it converts them to e4m3)
    pytest.param(
        2,
        2,
        64,
        [50, 9, 17],
        1,
        None,
        True,
        torch.float8_e4m3fn,
        marks=pytest.mark.skipif(DEVICE.type == "cpu", reason="the interpreter's e4m3 rounding"),
    ),
]


def rope_case(num_kv_heads, group, head_dim, seq_lens, dtype, cache_dtype, norms):
    """(cache, tables, lens, positions, the new keys' slots, q, k, v, cos_sin, norm args,
    k_scale, v_scale) for decode rows of `seq_lens` (16-slot blocks)."""
    from tandem.model.rope import RotaryEmbedding

    block_size, num_blocks, max_blocks = 16, 64, 24
    num_seqs, num_heads = len(seq_lens), num_kv_heads * group
    cache = make_cache(num_blocks, block_size, num_kv_heads, head_dim, torch.float32)
    k_scale, v_scale = (0.05, 0.03) if cache_dtype else (1.0, 1.0)
    cache = (cache / 0.04).clamp(-448, 448).to(cache_dtype) if cache_dtype else cache.to(dtype)
    tables = block_tables_for(seq_lens, block_size, max_blocks, num_blocks)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    positions = (lens - 1).long()
    slots = tables[torch.arange(num_seqs), positions // block_size].long() * block_size
    slots = slots + positions % block_size
    g = torch.Generator().manual_seed(num_seqs + head_dim)
    qkv = torch.randn(num_seqs, (num_heads + 2 * num_kv_heads) * head_dim, generator=g)
    qkv = qkv.to(dtype).to(DEVICE)
    q, k, v = qkv.split([num_heads * head_dim, *(2 * [num_kv_heads * head_dim])], dim=1)
    q = q.view(num_seqs, num_heads, head_dim)
    k, v = (x.view(num_seqs, num_kv_heads, head_dim) for x in (k, v))
    cos_sin = RotaryEmbedding(head_dim, 512, 10000.0, None).cos_sin.to(DEVICE)
    weights = [(1 + torch.randn(head_dim, generator=g) / 4).to(dtype).to(DEVICE) for _ in "qk"]
    norm_args = (*weights, 1e-6) if norms else ()
    return cache, tables, lens, positions, slots, q, k, v, cos_sin, norm_args, k_scale, v_scale


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("num_kv_heads", "group", "head_dim", "seq_lens", "splits", "window", "norms", "cache_dtype"),
    ROPE_CASES,
)
def test_decode_of_unrotated_q_equals_rope_qk_then_decode(
    dtype, num_kv_heads, group, head_dim, seq_lens, splits, window, norms, cache_dtype
):
    """The decode kernel norming and rotating q and k and storing k and v itself (`Unrotated`)
    against `fused.rope_qk` (torch on the CPU, its own kernel on the GPU) storing them, then
    the decode of its q: the same output
    and the same cache, every other slot untouched. The last row is graph padding: seq_len 1,
    slot -1, so its garbage k and v are stored nowhere."""
    from tandem.attention import Unrotated
    from tandem.model import fused

    seq_lens = [*seq_lens, 1]
    num_seqs = len(seq_lens)
    case = rope_case(num_kv_heads, group, head_dim, seq_lens, dtype, cache_dtype, norms)
    cache, tables, lens, positions, slots, q, k, v, cos_sin, norm_args, k_scale, v_scale = case
    slots[-1] = -1
    meta = AttentionMetadata(slots, lens, lens, tables, decode_only=True)
    backend = attention(num_kv_heads, group, head_dim, max_seqs=8, num_splits=splits)
    options = dict(k_scale=k_scale, v_scale=v_scale, sliding_window=window)
    scale = head_dim**-0.5

    expected_cache = cache.clone()
    rotated = fused.rope_qk(q, k, v, positions, cos_sin, expected_cache, slots, *norm_args,
                            k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    expected = backend(rotated, expected_cache, meta, scale, **options)
    unrotated = Unrotated(q, k, v, cos_sin, slots, *norm_args)
    got_cache = cache.clone()
    got = backend(unrotated, got_cache, meta, scale, **options)

    tol = TOL[dtype]
    real = slice(0, num_seqs - 1)  # the padding row's output is never read
    torch.testing.assert_close(got[real].float(), expected[real].float(), atol=tol, rtol=tol)
    changed = (got_cache != cache).flatten(1, 2).any(-1).any(-1).any(0)  # [slots]
    assert sorted(changed.nonzero().flatten().tolist()) == sorted(slots[real].tolist())
    new = got_cache.flatten(1, 2)[:, slots[real]].float()
    want = expected_cache.flatten(1, 2)[:, slots[real]].float()
    torch.testing.assert_close(new, want, atol=tol * 8 if cache_dtype else tol, rtol=tol)


def test_decode_splits_switch_fixes_the_split_count_above_one_sequence(monkeypatch):
    """TANDEM_DECODE_SPLITS (comparisons) sets the splits of every batch of more than one
    sequence; a single sequence keeps the heuristic's, and a constructor's count wins."""
    default = attention(1, 4, 64).num_splits(1)
    monkeypatch.setattr(triton_backend, "SPLITS_SETTING", 1)
    backend = attention(1, 4, 64)
    assert backend.num_splits(2) == backend.num_splits(32) == 1
    assert backend.num_splits(1) == default > 1
    assert attention(1, 4, 64, num_splits=4).num_splits(32) == 4
