"""The Gluon decode kernel (attention/gluon_decode.py) over bf16 and e4m3 caches, with and
without shared prefixes, against the torch reference attention over the (dequantized) cache, and
against the Triton decode kernel."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem.attention import (
    AttentionMetadata,
    SharedPrefixes,
    gluon_decode,
    rows_per_shared_group,
)
from tandem.attention.torch_ref import decode_attention
from tandem.attention.triton_backend import TritonAttention
from tandem.shared_prefix import group_shared_prefixes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
        reason="needs a CUDA device of compute capability 9.0 or newer",
    ),
]

E4M3 = torch.float8_e4m3fn
SCALES = {E4M3: (0.02, 0.05), torch.bfloat16: (1.0, 1.0)}  # (k_scale, v_scale)


@pytest.fixture(autouse=True)
def gluon_over_16_bits(monkeypatch):
    """The kernel over 16-bit caches too (TANDEM_GLUON_DECODE=all), as the tests call it."""
    monkeypatch.setattr(gluon_decode, "SIXTEEN_BIT", True)
    monkeypatch.setenv("TANDEM_GLUON_DECODE", "all")


def random_cache(blocks: int, block_size: int, kv_heads: int, dtype, g) -> tuple:
    """(cache, its values as float32) with `blocks` blocks and the padding block."""
    codes = torch.randn(2, blocks + 1, block_size, kv_heads, 128, device="cuda", generator=g)
    cache = (codes * 50).clamp(-448, 448).to(E4M3) if dtype == E4M3 else codes.to(dtype)
    k_scale, v_scale = SCALES[dtype]
    scales = torch.tensor([k_scale, v_scale], device="cuda").view(2, 1, 1, 1, 1)
    return cache, cache.float() * scales


def decode_call(lens, heads, kv_heads, block_size, ordered, dtype=E4M3):
    """(backend, q, cache, meta, the cache's values) of one decode call, blocks scattered over
    the cache."""
    g = torch.Generator(device="cuda").manual_seed(len(lens) * 7 + heads)
    per_seq = [-(-n // block_size) for n in lens]
    cache, values = random_cache(sum(per_seq), block_size, kv_heads, dtype, g)
    perm = torch.randperm(sum(per_seq), device="cuda", generator=g).to(torch.int32)
    tables = torch.zeros(len(lens), max(max(per_seq), 1), dtype=torch.int32, device="cuda")
    used = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = perm[used : used + n]
        used += n
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    order = torch.argsort(-seq_lens.long(), stable=True).int() if ordered else None
    q = torch.randn(len(lens), heads, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    meta = AttentionMetadata(
        seq_lens, seq_lens, seq_lens, tables, decode_only=True, seq_order=order
    )
    backend = TritonAttention(heads, kv_heads, 128, len(lens), torch.device("cuda"))
    return backend, q, cache, meta, values


def call(backend, q, cache, meta, **kwargs):
    k_scale, v_scale = SCALES[cache.dtype]
    return backend(q, cache, meta, 128**-0.5, k_scale=k_scale, v_scale=v_scale, **kwargs)


def reference(q, values, meta):
    return decode_attention(q.float(), values, meta.block_tables, meta.seq_lens, 128**-0.5)


@pytest.mark.parametrize("dtype", [E4M3, torch.bfloat16], ids=["e4m3", "bf16"])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "block_size", "ordered"),
    [
        (16, 8, 16, True),
        (32, 8, 16, False),
        (16, 8, 32, True),
        (40, 8, 16, True),
        (8, 8, 16, False),
    ],
)
def test_gluon_decode_matches_the_reference(heads, kv_heads, block_size, ordered, dtype):
    """Ragged contexts around the tiles' 16 or 32 keys and the stages' 48 to 96 (1, 31-33,
    95-97, ...), Qwen3-0.6B's and Llama-3-8B's head groups, GQA 5 and none, blocks of 16 and 32
    keys."""
    g = torch.Generator().manual_seed(heads)
    lens = [1, 2, 15, 16, 17, 31, 32, 33, 47, 48, 49, 95, 96, 97, 128, 129, 500, 1100]
    lens += torch.randint(1, 1200, (256 - len(lens),), generator=g).tolist()
    backend, q, cache, meta, values = decode_call(lens, heads, kv_heads, block_size, ordered, dtype)
    splits = backend.num_splits(len(lens))
    assert gluon_decode.takes(q, cache, 128, heads // kv_heads, splits, True)
    out = call(backend, q, cache, meta)
    torch.testing.assert_close(out.float(), reference(q, values, meta), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [E4M3, torch.bfloat16], ids=["e4m3", "bf16"])
def test_gluon_decode_matches_the_triton_kernel(monkeypatch, dtype):
    """The same call through the Triton decode kernel (TANDEM_GLUON_DECODE=none's path): both
    compute in 16 bits from the same cache bytes, so they differ by rounding only."""
    g = torch.Generator().manual_seed(3)
    lens = torch.randint(100, 1101, (256,), generator=g).tolist()
    backend, q, cache, meta, _ = decode_call(lens, 16, 8, 16, True, dtype)
    gluon = call(backend, q, cache, meta)
    monkeypatch.setattr(gluon_decode, "ENABLED", False)
    monkeypatch.setattr(gluon_decode, "SIXTEEN_BIT", False)
    triton_out = call(backend, q, cache, meta)
    torch.testing.assert_close(gluon, triton_out, atol=4e-3, rtol=1e-2)


@pytest.mark.parametrize("dtype", [E4M3, torch.bfloat16], ids=["e4m3", "bf16"])
def test_gluon_decode_replays_in_a_cuda_graph(dtype):
    """Captured once, replayed after the contexts grow by one key each (the engine's decode
    graphs): the replay reads the new lengths."""
    g = torch.Generator().manual_seed(5)
    lens = torch.randint(100, 1101, (256,), generator=g).tolist()
    backend, q, cache, meta, values = decode_call([n + 1 for n in lens], 16, 8, 16, True, dtype)
    meta.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
    out = torch.empty_like(q)
    call(backend, q, cache, meta, out=out)  # compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(backend, q, cache, meta, out=out)
    meta.seq_lens.add_(1)
    graph.replay()
    torch.testing.assert_close(out.float(), reference(q, values, meta), atol=2e-2, rtol=2e-2)


def shared_call(dtype, heads=32, kv_heads=8, block_size=16, cut=False):
    """(backend, q, cache, meta, values) of a decode call of 160 rows where groups of 2 to 12
    rows share 2 to 70 leading blocks (the engine's grouping, groups cut at the cascade
    kernel's rows), each with 1 to 300 keys of its own after them; 20 rows share nothing.
    `cut`: each group's prefix ends 0 to block_size - 1 keys before its blocks do, as where
    rows share a copied block's first slots (shared_prefix.py)."""
    g = torch.Generator().manual_seed(11)
    sizes = [2, 3, 4, 5, 8, 8, 8, 8, 8, 12, 12, 12, 12, 12, 12, 12, 2, 4]
    rows = sum(sizes) + 20
    prefixes = torch.randint(2, 71, (len(sizes),), generator=g).tolist()
    own = torch.randint(1, 301, (rows,), generator=g).tolist()
    tables, lens, next_block, r = [], [], 0, 0
    for size, prefix in zip(sizes + [0] * 20, prefixes + [0] * 20, strict=True):
        shared = list(range(next_block, next_block + prefix))
        next_block += prefix
        for _ in range(max(size, 1)):
            mine = -(-own[r] // block_size)
            tables.append(shared + list(range(next_block, next_block + mine)))
            next_block += mine
            lens.append(prefix * block_size + own[r])
            r += 1
    width = max(map(len, tables))
    perm = torch.randperm(next_block, generator=g)
    host = np.zeros((rows, width), dtype=np.int32)
    for i, t in enumerate(tables):
        host[i, : len(t)] = perm[t].numpy()
    seq_lens = np.array(lens, dtype=np.int32)
    x = {"prefix_lens": np.zeros(rows, np.int32), "group_rows": np.zeros(rows, np.int32),
         "group_starts": np.full(rows // 2 + 1, rows, np.int32),
         "group_prefix": np.zeros(rows // 2, np.int32), "num_groups": np.zeros(1, np.int32)}  # fmt: skip
    max_rows = rows_per_shared_group(heads, kv_heads)
    num_groups = group_shared_prefixes(host, seq_lens, block_size, max_rows, x)
    assert num_groups >= len(sizes)
    if cut:
        for group, keys in enumerate(torch.randint(0, block_size, (num_groups,), generator=g)):
            rows_of = x["group_rows"][x["group_starts"][group] : x["group_starts"][group + 1]]
            x["group_prefix"][group] -= int(keys)
            x["prefix_lens"][rows_of] -= int(keys)
    device = {name: torch.from_numpy(a).cuda() for name, a in x.items()}
    shared = SharedPrefixes(**device, max_groups=rows // 2)
    seq_lens_t = torch.from_numpy(seq_lens).cuda()
    order = torch.argsort(-seq_lens_t.long(), stable=True).int()
    meta = AttentionMetadata(seq_lens_t, seq_lens_t, seq_lens_t, torch.from_numpy(host).cuda(),
                             decode_only=True, seq_order=order, shared=shared)  # fmt: skip
    gen = torch.Generator(device="cuda").manual_seed(12)
    cache, values = random_cache(next_block, block_size, kv_heads, dtype, gen)
    q = torch.randn(rows, heads, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    backend = TritonAttention(heads, kv_heads, 128, rows, torch.device("cuda"))
    return backend, q, cache, meta, values


@pytest.mark.parametrize("cut", [False, True], ids=["whole-blocks", "cut-prefixes"])
@pytest.mark.parametrize("dtype", [E4M3, torch.bfloat16], ids=["e4m3", "bf16"])
def test_gluon_decode_merges_the_shared_prefixes_partials(monkeypatch, dtype, cut):
    """Rows in groups that share leading blocks: the shared-prefix kernel's partials merged by
    the Gluon kernel after each row's own keys (beside that kernel: EARLY_START),
    against the reference over each row's whole context and against the Triton decode kernel,
    eagerly and replayed in a CUDA graph; with `cut`, prefixes that end inside a block."""
    backend, q, cache, meta, values = shared_call(dtype, cut=cut)
    launches = []
    launch = gluon_decode.decode
    monkeypatch.setattr(
        gluon_decode, "decode", lambda *a, **k: (launches.append(k), launch(*a, **k))
    )
    out = call(backend, q, cache, meta)
    assert launches and launches[0]["cascade"] is not None
    assert launches[0]["early_start"]
    expected = reference(q, values, meta)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    replayed = torch.zeros_like(q)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(backend, q, cache, meta, out=replayed)
    graph.replay()
    torch.testing.assert_close(replayed, out, atol=0, rtol=0)
    monkeypatch.setattr(gluon_decode, "ENABLED", False)
    monkeypatch.setattr(gluon_decode, "SIXTEEN_BIT", False)
    triton_out = call(backend, q, cache, meta)
    torch.testing.assert_close(out, triton_out, atol=4e-3, rtol=1e-2)


# Qwen3-0.6B's shape (dummy weights, head size 128) at 160 rows: the engine's decode steps take
# the Gluon kernel, eagerly and in CUDA graphs; 20 prompts of 8 samples each, whose shared blocks
# go to the shared-prefix kernel and whose partials the Gluon kernel merges. (Async against sync
# is not compared here: on these random weights 1 of 160 greedy sequences of unique prompts
# differed between the two with either decode kernel, H200, session 36.)
ENGINE_RUN = """
import torch
from tandem import LLM, SamplingParams
from tandem.attention import gluon_decode
calls = []
launch = gluon_decode.decode
gluon_decode.decode = lambda *a, **k: (calls.append(k["cascade"] is not None), launch(*a, **k))
llm = LLM("qwen3-0.6b", load_format="dummy", dtype="bfloat16", kv_cache_dtype="@KV@",
          max_model_len=256, max_num_seqs=160)
g = torch.Generator().manual_seed(0)
prompts = [{"prompt_token_ids": torch.randint(0, 1000, (int(n),), generator=g).tolist()}
           for n in torch.randint(40, 90, (20,), generator=g)]
params = SamplingParams(n=8, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
outs = llm.generate(prompts, params, use_tqdm=False)
assert any(calls), "the Gluon kernel never merged shared-prefix partials"
assert [len(c.token_ids) for o in outs for c in o.outputs] == [12] * 160
print("ok", len(calls), sum(calls))
"""


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "auto"])
def test_engine_decodes_through_the_gluon_kernel_under_the_stream_sanitizer(
    run_sanitized, kv_cache_dtype
):
    """The async loop with the Gluon kernel: no unsynchronized access, every token produced."""
    assert "ok" in run_sanitized(ENGINE_RUN.replace("@KV@", kv_cache_dtype))


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "auto"])
def test_step_loop_with_the_gluon_kernel_blocks_only_on_the_d2h_event(
    counted_waits, monkeypatch, kv_cache_dtype
):
    """Under sync debug mode "error" (the one allowed wait, on d2h_done, lifted and counted), 160
    rows decode through the Gluon kernel: no other host sync in the loop."""
    from tandem import LLM, SamplingParams

    calls = []
    launch = gluon_decode.decode
    monkeypatch.setattr(gluon_decode, "decode", lambda *a, **k: (calls.append(1), launch(*a, **k)))
    llm = LLM("qwen3-0.6b", load_format="dummy", dtype="bfloat16", kv_cache_dtype=kv_cache_dtype,
              max_model_len=256, max_num_seqs=160)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(0, 1000, (40,), generator=g).tolist()}
               for _ in range(160)]  # fmt: skip
    llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # compiles, eagerly
    counted_waits.clear()
    start = llm.engine.num_steps
    torch.cuda.set_sync_debug_mode("error")
    try:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                     use_tqdm=False)  # fmt: skip
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert calls
    assert sorted(counted_waits) == list(range(start, llm.engine.num_steps))
