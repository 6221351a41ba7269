"""deterministic=True: one request's tokens and logprobs are bit-identical whatever else is in
its batches, sync or async, in any chunk size, after preemption and from the prefix cache."""

from __future__ import annotations

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.attention import AttentionMetadata
from tandem.batch_invariant import invariant_linear, invariant_tiles, residual_partials, token_rows

TARGET = {"prompt_token_ids": [7, 19, 33, 4, 250, 61, 8, 90, 12, 5, 77, 3, 41, 16, 29, 2, 55]}
PARAMS = SamplingParams(temperature=0.8, seed=11, max_tokens=16, ignore_eos=True, logprobs=3)


def others(count: int) -> list[dict]:
    g = torch.Generator().manual_seed(count)
    return [
        {"prompt_token_ids": torch.randint(3, 300, (int(n),), generator=g).tolist()}
        for n in torch.randint(4, 30, (count,), generator=g)
    ]


def target_output(folder, batch: list[dict], **engine_args):
    llm = LLM(folder, deterministic=True, max_model_len=128, block_size=8, **engine_args)
    params = [PARAMS] + [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)] * len(
        batch
    )
    outputs = llm.generate([TARGET, *batch], params, use_tqdm=False)
    out = outputs[0].outputs[0]
    return (out.token_ids, out.logprobs), llm.engine


@pytest.fixture(scope="module")
def folder(make_tiny) -> str:
    return str(make_tiny("qwen3"))


@pytest.fixture(scope="module")
def alone(folder):
    return target_output(folder, [])[0]


@pytest.mark.parametrize(
    "engine_args",
    [
        {},
        {"async_batching": False, "max_num_batched_tokens": 7},  # chunks of every size to 7
    ],
    ids=["async", "sync-chunks-7"],
)
def test_a_request_in_a_batch_of_8_gives_the_bits_of_it_alone(folder, alone, engine_args):
    got, _ = target_output(folder, others(8), **engine_args)
    assert got == alone


def test_a_request_preempted_and_recomputed_gives_the_bits_of_it_alone(folder, alone):
    got, engine = target_output(folder, others(8), num_blocks=16)
    assert engine.scheduler.num_preemptions > 0
    assert got == alone


def test_a_request_from_the_prefix_cache_gives_the_bits_of_it_computed(folder, alone):
    llm = LLM(folder, deterministic=True, max_model_len=128, block_size=8)
    for _ in range(2):
        out = llm.generate([TARGET, *others(1)], PARAMS, use_tqdm=False)[0]
        assert (out.outputs[0].token_ids, out.outputs[0].logprobs) == alone
    assert out.num_cached_tokens > 0


@pytest.mark.parametrize(
    "engine_args",
    [{}, {"async_batching": False, "max_num_batched_tokens": 7}],
    ids=["async", "sync-chunks-7"],
)
def test_a_prompt_s_logprobs_keep_their_bits_in_a_batch_and_in_chunks(folder, engine_args):
    params = SamplingParams(max_tokens=1, prompt_logprobs=1)

    def prompt_logprobs(batch, **args):
        llm = LLM(folder, deterministic=True, max_model_len=128, block_size=8, **args)
        return llm.generate([TARGET, *batch], params, use_tqdm=False)[0].prompt_logprobs

    alone = prompt_logprobs([])
    assert len(alone) == len(TARGET["prompt_token_ids"]) and alone[0] is None
    assert prompt_logprobs(others(8), **engine_args) == alone


def test_prompt_logprobs_leave_the_fused_lm_head_kernel_to_the_default_mode(folder, monkeypatch):
    """The kernel splits the vocabulary by the step's rows: deterministic mode takes the
    batch-invariant LM head and a log-softmax per row instead."""
    from tandem import prompt_logprobs
    from tandem.model import fused

    models = [LLM(folder, max_model_len=64, **args).engine.runner.model
              for args in ({}, {"deterministic": True})]  # fmt: skip
    monkeypatch.setattr(fused, "use_kernels", lambda x: True)
    default, deterministic = (prompt_logprobs.fused_lm_head(m, 0) for m in models)
    assert default is not None and deterministic is None


def test_deterministic_and_tensor_parallel_together_are_refused(folder):
    with pytest.raises(ValueError, match="deterministic"):
        LLM(folder, deterministic=True, tensor_parallel_size=2)


def test_deterministic_mode_refuses_mixture_of_experts_blocks(make_tiny):
    with pytest.raises(ValueError, match="SparseMoeBlock"):
        LLM(make_tiny("qwen3_moe"), deterministic=True)


def test_deterministic_mode_refuses_fp8_layers(folder):
    with pytest.raises(ValueError, match="Fp8Linear"):
        LLM(folder, deterministic=True, quantization="fp8")


def test_the_invariant_linear_is_the_product(folder):
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*shape, generator=g) for shape in ((5, 64), (24, 64), (24,)))
    torch.testing.assert_close(invariant_linear(x, w, b), x @ w.T + b)
    assert torch.equal(invariant_linear(x, w)[2:3], invariant_linear(x[2:3], w))


def test_token_rows_give_each_query_token_its_own_context():
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(4, dtype=torch.int64),
        query_start_loc=torch.tensor([0, 1, 4], dtype=torch.int32),
        seq_lens=torch.tensor([9, 6], dtype=torch.int32),
        block_tables=torch.tensor([[1, 2], [3, 4]], dtype=torch.int32),
        decode_only=False,
    )
    rows = token_rows(meta, 4)
    assert rows.seq_lens.tolist() == [9, 4, 5, 6]
    assert rows.block_tables.tolist() == [[1, 2], [3, 4], [3, 4], [3, 4]]
    assert rows.decode_only and rows.query_start_loc.tolist() == [0, 1, 2, 3, 4]


def test_token_rows_keep_padding_tokens_and_zeroed_inputs_inside_the_tables():
    """A graph pads 4 tokens to 6 (and captures on all-zero inputs): every index stays in range."""
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(6, dtype=torch.int64),
        query_start_loc=torch.tensor([0, 1, 4], dtype=torch.int32),
        seq_lens=torch.tensor([9, 6], dtype=torch.int32),
        block_tables=torch.tensor([[1, 2], [3, 4]], dtype=torch.int32),
        decode_only=False,
    )
    rows = token_rows(meta, 6)
    assert rows.seq_lens.tolist() == [9, 4, 5, 6, 6, 6]
    assert rows.block_tables.tolist()[4:] == [[3, 4], [3, 4]]
    zeroed = AttentionMetadata(
        slot_mapping=torch.zeros(3, dtype=torch.int64),
        query_start_loc=torch.zeros(4, dtype=torch.int32),
        seq_lens=torch.zeros(3, dtype=torch.int32),
        block_tables=torch.zeros(3, 2, dtype=torch.int32),
        decode_only=True,
    )
    rows = token_rows(zeroed, 3)
    assert rows.seq_lens.tolist() == [0, 0, 0] and rows.block_tables.shape == (3, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_triton_gemm_gives_a_row_the_same_bits_in_any_batch(monkeypatch, dtype):
    """Interpreted on CPU: row 2 alone, among 5 rows and among 70 (two row tiles)."""
    from tandem.model import fused

    monkeypatch.setattr(fused, "use_kernels", lambda x: True)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(70, 64, generator=g).to(dtype)
    w = (torch.randn(48, 64, generator=g) / 8).to(dtype)
    alone = invariant_linear(x[2:3], w)
    assert torch.equal(invariant_linear(x[:5], w)[2:3], alone)
    assert torch.equal(invariant_linear(x[68:], w), invariant_linear(x, w)[68:])
    tol = 1e-4 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(alone.double(), x[2:3].double() @ w.double().T, atol=tol, rtol=tol)


def test_the_residual_slices_follow_the_weight_not_the_batch(monkeypatch):
    """Interpreted on CPU (8 SMs): a 48 x 256 o-like matrix gets 32-wide tiles and 2 K slices,
    whatever the rows; a row's slices are the bits of it alone, and they add up to the product."""
    from tandem.model import fused

    monkeypatch.setattr(fused, "use_kernels", lambda x: True)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(70, 256, generator=g)
    layer = torch.nn.Linear(256, 48, bias=False)
    tiles = invariant_tiles(48, 256, x.device, residual=True)
    assert (tiles.block_n, tiles.block_k, tiles.splits) == (32, 128, 2)
    assert invariant_tiles(48, 256, x.device, residual=False).splits == 1
    alone = residual_partials(layer, x[2:3])
    batched = residual_partials(layer, x)
    assert alone.shape == (2, 1, 48) and torch.equal(batched[:, 2:3], alone)
    expected = x.double() @ layer.weight.detach().double().T
    torch.testing.assert_close(batched.sum(0).double(), expected, atol=1e-4, rtol=1e-4)


def test_a_forward_pass_makes_its_token_rows_once_for_all_layers(monkeypatch):
    from tandem import batch_invariant

    made = []
    monkeypatch.setattr(batch_invariant, "token_rows", lambda meta, n: made.append(meta) or meta)
    attend = batch_invariant.InvariantAttention(lambda q, cache, rows, scale, out: rows)
    first, second = (AttentionMetadata(*[torch.zeros(1)] * 4, decode_only=False) for _ in "ab")
    q = torch.zeros(1, 1, 1)
    assert [attend(q, None, meta, 1.0) for meta in (first, first, first)] == [first] * 3
    assert attend(q, None, second, 1.0) is second and made == [first, second]


def test_the_triton_attention_gives_a_prefill_token_the_bits_of_its_decode(monkeypatch):
    """Interpreted on CPU: a mixed step (one decode row, one 5-token prefill) matches the torch
    reference, and its prefill's last token equals the same token as a decode-only step."""
    from tandem.attention.torch_ref import torch_attention
    from tandem.attention.triton_backend import TritonAttention
    from tandem.batch_invariant import invariant_attention

    g = torch.Generator().manual_seed(2)
    kv_cache = torch.randn(2, 9, 8, 2, 32, generator=g)
    attend = invariant_attention("triton", TritonAttention(4, 2, 32, 8, torch.device("cpu")))
    q = torch.randn(6, 4, 32, generator=g)
    tables = torch.tensor([[1, 2, 0, 0], [3, 4, 5, 0]], dtype=torch.int32)
    mixed = AttentionMetadata(
        slot_mapping=torch.zeros(6, dtype=torch.int64),
        query_start_loc=torch.tensor([0, 1, 6], dtype=torch.int32),
        seq_lens=torch.tensor([11, 20], dtype=torch.int32),
        block_tables=tables,
        decode_only=False,
        query_start_loc_host=[0, 1, 6],
        seq_lens_host=[11, 20],
    )
    out = attend(q, kv_cache, mixed, 0.2)
    torch.testing.assert_close(out, torch_attention(q, kv_cache, mixed, 0.2), atol=1e-4, rtol=1e-4)
    decode = AttentionMetadata(
        slot_mapping=torch.zeros(1, dtype=torch.int64),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=torch.tensor([20], dtype=torch.int32),
        block_tables=tables[1:],
        decode_only=True,
    )
    assert torch.equal(attend(q[5:], kv_cache, decode, 0.2), out[5:])
