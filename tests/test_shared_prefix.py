"""Cascade decode: rows that share leading blocks read them once per group, with the same result
as each row reading its whole context (the torch reference attention)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem.attention import AttentionMetadata, SharedPrefixes, triton_backend
from tandem.attention.torch_ref import decode_attention
from tandem.io_slot import input_fields
from tandem.shared_prefix import group_shared_prefixes, shared_kv_tokens

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
def test_engine_samples_of_one_prompt_decode_over_shared_blocks(make_tiny):
    """The n samples of a prompt share its cached blocks; their decode steps go through the
    shared-prefix kernel (Triton's interpreter on CPU) and sample what a cache-less engine with
    the torch attention samples."""
    from tandem import LLM, SamplingParams

    folder = str(make_tiny("llama"))
    prompt = list(range(7, 60))
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    args = dict(block_size=4, num_blocks=128, max_model_len=96)
    cascade = LLM(folder, attention_backend="triton", **args)
    groups = []
    build = cascade.engine.builder.build

    def counting_build(*a, **kw):
        batch = build(*a, **kw)
        groups.append(batch.num_shared_groups)
        return batch

    cascade.engine.builder.build = counting_build
    ours = cascade.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    plain = LLM(folder, attention_backend="torch", enable_prefix_caching=False, **args)
    theirs = plain.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]

    assert groups[0] == 0 and all(g == 1 for g in groups[1:])  # prefill, then one group of 4
    assert [c.token_ids for c in ours.outputs] == [c.token_ids for c in theirs.outputs]
    assert len({tuple(c.token_ids) for c in ours.outputs}) > 1
