"""Cascade decode: rows that share leading blocks read them once per group, with the same result
as each row reading its whole context (the torch reference attention)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from tandem.attention import AttentionMetadata, SharedPrefixes, triton_backend
from tandem.attention.torch_ref import decode_attention
from tandem.io_slot import input_fields
from tandem.shared_prefix import CopiedBlocks, group_shared_prefixes, shared_kv_tokens

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16] if DEVICE.type == "cpu" else [torch.bfloat16]
TOL = {torch.float32: 2e-3, torch.float16: 2e-2, torch.bfloat16: 3e-2}


def host_inputs(max_seqs: int) -> dict[str, np.ndarray]:
    fields = input_fields(8, max_seqs, 4)
    names = ("prefix_lens", "group_rows", "group_starts", "group_prefix", "num_groups")
    return {n: np.zeros(fields[n][0], dtype=np.int32) for n in names}


def test_rows_on_the_same_leading_blocks_form_one_group():
    tables = np.array([[7, 8, 9, 1], [7, 8, 5, 2], [3, 4, 0, 0], [7, 8, 9, 6]], dtype=np.int32)
    seq_lens = np.array([49, 40, 60, 33])  # 16-token blocks: rows 0-3 write blocks 3, 2, 3, 2
    x = host_inputs(4)
    assert group_shared_prefixes(tables, seq_lens, 16, 8, x) == 1
    assert x["group_rows"][:3].tolist() == [0, 1, 3]
    assert x["group_starts"][:2].tolist() == [0, 3]
    assert x["group_prefix"][0] == 32  # blocks 7, 8: row 1 parts after them
    assert x["prefix_lens"].tolist() == [32, 32, 0, 32]
    assert shared_kv_tokens(x, 1) == 2 * 32


def test_a_group_never_covers_the_block_a_row_writes_and_is_cut_at_max_rows():
    tables = np.tile(np.arange(10, dtype=np.int32), (5, 1))
    seq_lens = np.array([33, 100, 100, 100, 100])  # row 0 writes its third block
    x = host_inputs(5)
    assert group_shared_prefixes(tables, seq_lens, 16, 3, x) == 2
    assert x["group_prefix"][:2].tolist() == [32, 32]
    assert x["group_starts"][:3].tolist() == [0, 3, 5]
    # one shared block is not worth a group
    assert group_shared_prefixes(tables, np.array([20, 100, 100, 100, 100]), 16, 8, x) == 0
    assert not x["prefix_lens"].any() and x["num_groups"][0] == 0


def test_copies_of_one_cached_block_share_its_first_slots():
    """Rows 1 and 2 copied block 9 (publication 5) on write, row 0 holds block 9 itself: past
    the blocks they share, the group goes on over block 9's first 15 of 16 slots."""
    tables = np.array(
        [[7, 8, 9, 1], [7, 8, 4, 2], [7, 8, 5, 6], [7, 8, 3, 0]], dtype=np.int32
    )  # fmt: skip
    seq_lens = np.array([50, 49, 60, 55])  # all write their fourth block
    published = np.full(16, -1, dtype=np.int64)
    published[[9, 3]] = [5, 6]
    index = np.array([-1, 2, 2, -1], dtype=np.int32)

    def group(rows, publication):
        x = host_inputs(4)
        copies = CopiedBlocks(index[rows], np.array(publication, dtype=np.int64), published)
        assert group_shared_prefixes(tables[rows], seq_lens[rows], 16, 8, x, copies) == 1
        return x["group_prefix"][0]

    assert group([0, 1, 2], [-1, 5, 5]) == 32 + 15
    assert group([1, 2], [5, 5]) == 32 + 15  # the copies without the block they copied
    assert group([0, 1, 2], [-1, 5, 4]) == 32  # row 2 copied another publication
    assert group([0, 1, 3], [-1, 5, -1]) == 32  # row 3's block 3 is not block 9
    # a row that writes the copied block (its last token) shares none of it yet
    x = host_inputs(3)
    lens = np.array([50, 48, 60])
    copies = CopiedBlocks(index[:3], np.array([-1, 5, 5]), published)
    assert group_shared_prefixes(tables[:3], lens, 16, 8, x, copies) == 1
    assert x["group_prefix"][0] == 32 and x["prefix_lens"][:3].tolist() == [32, 32, 32]


@settings(max_examples=200, deadline=None)
@given(
    events=st.lists(
        st.tuples(st.sampled_from(["publish", "copy", "copy", "hold", "reuse"]), st.integers(0, 1)),
        max_size=24,
    ),
    seed=st.integers(0, 2**16),
)
def test_a_prefix_past_whole_blocks_covers_only_slots_its_rows_hold_alike(events, seed):
    """Rows on blocks 0 and 1, then each on its own block at index 2: one of two cached
    blocks (held), a copy of one made while it held some publication, whatever reuse did to the
    blocks after. Every group's prefix must cover only slots that all its rows hold alike,
    read through any of their tables."""
    size, sources = 4, 2
    rng = np.random.default_rng(seed)
    content = {b: rng.integers(0, 3, size) for b in range(2 + sources)}  # block -> slot values
    published = np.full(64, -1, dtype=np.int64)
    rows, number = [], 0  # rows: (block at index 2, copy index, copied publication)
    for kind, source in events:
        block = 2 + source
        if kind == "publish" and published[block] < 0:
            published[block], number = number, number + 1
        elif kind == "reuse":  # evicted, then written by its next owner
            published[block] = -1
            content[block] = rng.integers(0, 3, size)
        elif kind == "copy" and published[block] >= 0:  # the last slot: the copy's own token
            copy = len(content)
            content[copy] = np.append(content[block][:-1], rng.integers(0, 3))
            rows.append((copy, 2, published[block]))
        elif kind == "hold":
            rows.append((block, -1, -1))
    if len(rows) < 2:
        return
    tables = np.array([[0, 1, b, 40 + i] for i, (b, _, _) in enumerate(rows)], dtype=np.int32)
    copies = CopiedBlocks(
        np.array([r[1] for r in rows], np.int32), np.array([r[2] for r in rows]), published
    )
    x = host_inputs(len(rows))
    seq_lens = np.full(len(rows), 3 * size + 1)
    num_groups = group_shared_prefixes(tables, seq_lens, size, len(rows), x, copies)
    for g in range(num_groups):
        members = x["group_rows"][x["group_starts"][g] : x["group_starts"][g + 1]]
        past = x["group_prefix"][g] - 2 * size  # slots of index 2 in the prefix
        assert past in (0, size - 1, size)  # size: rows holding one block
        held = [content[rows[m][0]][:past].tolist() for m in members]
        assert all(h == held[0] for h in held), (rows, members, held)
        event({0: "two blocks", size - 1: "into the copied block", size: "three blocks"}[past])


def shared_tables(seq_lens, shared, block_size, max_blocks, num_blocks):
    """Distinct blocks per row, except that rows of one entry of `shared` (rows, blocks) start on
    the same `blocks` blocks."""
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    for i, n in enumerate(seq_lens):
        tables[i, : -(-n // block_size)] = torch.tensor(
            [perm.pop() for _ in range(-(-n // block_size))]
        )
    for rows, blocks in shared:
        tables[rows, :blocks] = tables[rows[0], :blocks]
    return tables


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("num_kv_heads", "group", "splits", "spare_groups"),
    [(2, 4, None, 0), (2, 4, 2, 3), (4, 1, 1, 0), (1, 8, 3, 1)],
)
def test_decode_over_shared_blocks_matches_reference(
    dtype, num_kv_heads, group, splits, spare_groups
):
    block_size, head_dim, num_blocks, max_blocks = 16, 64, 96, 16
    seq_lens = [150, 97, 200, 81, 90, 64, 33]
    shared = [([0, 1, 2], 5), ([3, 4], 4), ([5, 6], 2)]
    tables = shared_tables(seq_lens, shared, block_size, max_blocks, num_blocks)
    x = host_inputs(len(seq_lens))
    backend = triton_backend.TritonAttention(
        num_kv_heads * group, num_kv_heads, head_dim, 8, DEVICE, num_splits=splits
    )
    max_rows = 2  # cuts the first group in two: rows [0, 1] and row 2 alone, in no group
    num_groups = group_shared_prefixes(tables.numpy(), np.array(seq_lens), block_size, max_rows, x)
    assert num_groups == 3 and x["prefix_lens"][2] == 0
    dev = {k: torch.from_numpy(v).to(DEVICE) for k, v in x.items()}
    max_groups = num_groups + spare_groups  # a graph's grid: programs past the groups return
    groups = SharedPrefixes(
        dev["prefix_lens"], dev["group_rows"], dev["group_starts"][: max_groups + 1],
        dev["group_prefix"][:max_groups], dev["num_groups"], max_groups,
    )  # fmt: skip
    g = torch.Generator().manual_seed(1)
    cache = torch.randn(2, num_blocks + 1, block_size, num_kv_heads, head_dim, generator=g)
    cache = cache.to(dtype).to(DEVICE)
    q = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, generator=g).to(dtype).to(DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    tables = tables.to(DEVICE)
    meta = AttentionMetadata(lens, lens, lens, tables, decode_only=True, shared=groups)
    out = torch.empty_like(q)
    backend.decode(q, out, cache, meta, head_dim**-0.5)
    expected = decode_attention(q.float(), cache.float(), tables, lens, head_dim**-0.5)
    torch.testing.assert_close(out.float(), expected, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [None, 2])
def test_decode_over_a_copied_block_matches_reference(dtype, splits):
    """Rows 1 and 2 hold copies of row 0's fifth block whose last slot differs (the token each
    computed): the group shares 4 blocks and 15 slots of the fifth, read through row 0's table,
    and each row's own keys start at its sixteenth slot."""
    block_size, head_dim, num_blocks, max_blocks, num_kv_heads = 16, 64, 64, 12, 2
    seq_lens = [150, 97, 181, 40]
    tables = shared_tables(seq_lens, [([0, 1, 2], 4)], block_size, max_blocks, num_blocks)
    g = torch.Generator().manual_seed(3)
    cache = torch.randn(2, num_blocks + 1, block_size, num_kv_heads, head_dim, generator=g)
    source = int(tables[0, 4])
    for row in (1, 2):
        cache[:, int(tables[row, 4]), : block_size - 1] = cache[:, source, : block_size - 1]
    published = np.full(num_blocks, -1, dtype=np.int64)
    published[source] = 0
    copies = CopiedBlocks(np.array([-1, 4, 4, -1], np.int32), np.array([-1, 0, 0, -1]), published)
    x = host_inputs(len(seq_lens))
    assert group_shared_prefixes(tables.numpy(), np.array(seq_lens), block_size, 8, x, copies) == 1
    assert x["prefix_lens"].tolist()[:4] == [79, 79, 79, 0]
    dev = {k: torch.from_numpy(v).to(DEVICE) for k, v in x.items()}
    groups = SharedPrefixes(
        dev["prefix_lens"], dev["group_rows"], dev["group_starts"][:3], dev["group_prefix"][:2],
        dev["num_groups"], 2,
    )  # fmt: skip
    cache = cache.to(dtype).to(DEVICE)
    q = torch.randn(len(seq_lens), 4 * num_kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    meta = AttentionMetadata(lens, lens, lens, tables.to(DEVICE), decode_only=True, shared=groups)
    backend = triton_backend.TritonAttention(4 * num_kv_heads, num_kv_heads, head_dim, 8, DEVICE,
                                             num_splits=splits)  # fmt: skip
    out = torch.empty_like(q)
    backend.decode(q, out, cache, meta, head_dim**-0.5)
    expected = decode_attention(q.float(), cache.float(), meta.block_tables, lens, head_dim**-0.5)
    torch.testing.assert_close(out.float(), expected, atol=TOL[dtype], rtol=TOL[dtype])


class LaunchCount:
    """Stands in for a Triton kernel: counts its launches and runs the real one."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@pytest.mark.parametrize("splits", [1, 2])
def test_one_split_merges_the_prefix_partials_in_the_decode_kernel(monkeypatch, splits):
    """With one split of its own a grouped row's output comes from the decode kernel, which merges
    the shared-prefix kernel's partials itself: no reduce launch. Two splits take the reduce."""
    block_size, head_dim, num_blocks, max_blocks = 16, 32, 64, 12
    seq_lens = [150, 97, 181, 40]
    tables = shared_tables(seq_lens, [([0, 1, 2], 5)], block_size, max_blocks, num_blocks)
    x = host_inputs(len(seq_lens))
    assert group_shared_prefixes(tables.numpy(), np.array(seq_lens), block_size, 4, x) == 1
    dev = {k: torch.from_numpy(v).to(DEVICE) for k, v in x.items()}
    groups = SharedPrefixes(
        dev["prefix_lens"], dev["group_rows"], dev["group_starts"][:3], dev["group_prefix"][:2],
        dev["num_groups"], 2,
    )  # fmt: skip
    g = torch.Generator().manual_seed(2)
    cache = torch.randn(2, num_blocks + 1, block_size, 2, head_dim, generator=g).to(DEVICE)
    q = torch.randn(len(seq_lens), 4, head_dim, generator=g).to(DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    meta = AttentionMetadata(lens, lens, lens, tables.to(DEVICE), decode_only=True, shared=groups)
    reduce = LaunchCount(triton_backend.reduce_kernel)
    monkeypatch.setattr(triton_backend, "reduce_kernel", reduce)
    backend = triton_backend.TritonAttention(4, 2, head_dim, 8, DEVICE, num_splits=splits)
    out = torch.empty_like(q)
    backend.decode(q, out, cache, meta, head_dim**-0.5)
    assert reduce.launches == (0 if splits == 1 else 1)
    expected = decode_attention(q, cache, meta.block_tables, lens, head_dim**-0.5)
    torch.testing.assert_close(out, expected, atol=2e-3, rtol=2e-3)


@pytest.mark.skipif(DEVICE.type == "cuda", reason="Triton's interpreter: CPU only")
@pytest.mark.parametrize(("prompt_len", "prefix", "first_groups"), [(53, 52, 1), (52, 51, 0)])
def test_engine_samples_of_one_prompt_decode_over_shared_blocks(
    make_tiny, prompt_len, prefix, first_groups
):
    """The n samples of a prompt share its cached blocks; their decode steps go through the
    shared-prefix kernel (Triton's interpreter on CPU) and sample what a cache-less engine with
    the torch attention samples. A block-aligned prompt's samples copy its last block on write:
    they share its first 3 of 4 slots too (prefix 51 of 52 tokens), from the step after the
    prompt's. The other prompt's samples compute its last token in the prompt's own step, as
    one-token rows that lead it: one group over the 13 blocks the step writes."""
    from tandem import LLM, SamplingParams

    folder = str(make_tiny("llama"))
    prompt = list(range(7, 7 + prompt_len))
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    args = dict(block_size=4, num_blocks=128, max_model_len=96)
    cascade = LLM(folder, attention_backend="triton", **args)
    groups, prefixes = [], set()
    build = cascade.engine.builder.build

    def counting_build(*a, **kw):
        batch = build(*a, **kw)
        groups.append(batch.num_shared_groups)
        if batch.num_shared_groups:
            prefixes.add(int(batch.slot.np_in["group_prefix"][0]))
        return batch

    cascade.engine.builder.build = counting_build
    ours = cascade.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    plain = LLM(folder, attention_backend="torch", enable_prefix_caching=False, **args)
    theirs = plain.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]

    # the prompt's step (one group of its 3 other samples, or none), then one group of 4
    assert groups[0] == first_groups and all(g == 1 for g in groups[1:])
    assert max(prefixes) == prefix
    assert [c.token_ids for c in ours.outputs] == [c.token_ids for c in theirs.outputs]
    assert len({tuple(c.token_ids) for c in ours.outputs}) > 1


def test_disable_cascade_attn_reads_every_row_s_context_and_samples_the_same(make_tiny):
    """vLLM's disable_cascade_attn: no step groups rows by shared blocks, and the n samples are
    those of the engine that reads each shared block once per group."""
    from tandem import LLM, SamplingParams

    folder = str(make_tiny("llama"))
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(7, 60))}
    args = dict(attention_backend="triton", block_size=4, num_blocks=128, max_model_len=96)
    grouped = LLM(folder, **args).generate(prompt, params, use_tqdm=False)[0]
    llm = LLM(folder, disable_cascade_attn=True, **args)
    assert llm.engine.builder.shared_group_rows == 0 and not llm.engine.runner.cascade
    each = llm.generate(prompt, params, use_tqdm=False)[0]
    assert [c.token_ids for c in each.outputs] == [c.token_ids for c in grouped.outputs]
