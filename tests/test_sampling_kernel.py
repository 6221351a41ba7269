"""The fused Triton Gumbel-max kernel draws exactly the tokens of the torch sampler."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem import sampling_kernel as kernel
from tandem.sampling import SamplingTensors, sample

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 6),
    vocab=st.sampled_from([7, 2048, 2049, 5000]),
    seed=st.integers(0, 2**31),
    scale=st.floats(0.1, 8.0),
)
def test_fused_kernel_matches_the_torch_sampler(rows, vocab, seed, scale):
    check_matches_torch(rows, vocab, seed, scale, num_chunks=None)


def check_matches_torch(rows, vocab, seed, scale, num_chunks, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g) * scale).to(dtype).to(DEVICE)
    temperature = torch.tensor([0.0, 1.0, 0.3, 1.7, 1.0, 0.0][:rows], device=DEVICE)
    seeds = torch.randint(-(2**31), 2**31 - 1, (rows,), generator=g, dtype=torch.int32).to(DEVICE)
    positions = torch.randint(0, 10_000, (rows,), generator=g, dtype=torch.int32).to(DEVICE)
    zeros = torch.zeros(rows, dtype=torch.int32, device=DEVICE)
    params = SamplingTensors(
        temperature, zeros, torch.ones(rows, device=DEVICE), zeros.float(), seeds, positions
    )
    reference = sample(
        logits.cpu(), SamplingTensors(*(x.cpu() for x in vars(params).values())), use_filters=False
    )
    fused = kernel.gumbel_argmax(logits, temperature, seeds, positions, num_chunks)
    assert fused.cpu().tolist() == reference.tolist()


@pytest.mark.parametrize("num_chunks", [1, 2, 3, 5, 64])
def test_any_vocabulary_split_draws_the_same_tokens(num_chunks):
    """One chunk per row, uneven chunks, more chunks asked for than blocks: the same draws."""
    check_matches_torch(rows=4, vocab=9000, seed=num_chunks, scale=2.0, num_chunks=num_chunks)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_logits_are_read_as_they_are(dtype):
    """The model's own dtype, no float32 copy: the draws of the torch sampler on the same values."""
    if DEVICE.type == "cpu" and dtype == torch.bfloat16:
        pytest.skip("bf16 loads are not reliable in Triton's interpreter")
    check_matches_torch(rows=5, vocab=9000, seed=7, scale=3.0, num_chunks=3, dtype=dtype)


def test_a_token_with_the_top_hash_is_drawn_by_its_logit_like_any_other():
    """As test_sampling's: the kernel's noise stays finite where the hash is the largest."""
    from test_sampling import TOP_HASH_SEED, TOP_HASH_TOKEN

    logits = torch.zeros(2, 8, device=DEVICE)
    logits[0] = float("-inf")
    logits[0, 5] = 0.0
    logits[1, TOP_HASH_TOKEN] = -40.0
    seeds = torch.full((2,), TOP_HASH_SEED, dtype=torch.int32, device=DEVICE)
    positions = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    drawn = kernel.gumbel_argmax(logits, torch.ones(2, device=DEVICE), seeds, positions)
    assert drawn.tolist()[0] == 5 and drawn.tolist()[1] != TOP_HASH_TOKEN


@pytest.mark.parametrize("num_chunks", [1, 3])
def test_greedy_rows_take_the_first_maximum(num_chunks):
    logits = torch.zeros(4, 4100, device=DEVICE)
    logits[:2, [3000, 4099]] = 1.0  # equal maxima in different blocks (and chunks)
    logits[1, 5] = 1.0
    logits[2, [2148, 100]] = 1.0  # the same lane of two blocks
    logits[3, [20, 10]] = 1.0  # two lanes of one block
    out = kernel.gumbel_argmax(
        logits,
        torch.zeros(4, device=DEVICE),
        torch.zeros(4, dtype=torch.int32, device=DEVICE),
        torch.zeros(4, dtype=torch.int32, device=DEVICE),
        num_chunks,
    )
    assert out.tolist() == [3000, 5, 100, 10]


def test_a_chunk_of_banned_tokens_keeps_the_row_s_best():
    """-inf everywhere in the first chunk (banned or masked) must not win over real scores."""
    logits = torch.full((1, 6000), float("-inf"), device=DEVICE)
    logits[0, 5000] = -3.0
    out = kernel.gumbel_argmax(
        logits,
        torch.ones(1, device=DEVICE),
        torch.zeros(1, dtype=torch.int32, device=DEVICE),
        torch.zeros(1, dtype=torch.int32, device=DEVICE),
        3,
    )
    assert out.tolist() == [5000]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_chunks", [None, 1, 3])
@pytest.mark.parametrize("logprobs", [True, False])
def test_sampled_logprobs_equal_the_log_softmax_s_and_the_rank_count(dtype, num_chunks, logprobs):
    """The sampled ids' log-softmax (or logit) and rank, from one read of the logits: against
    torch's float32 log_softmax and a direct count, with ties at the sampled value, -inf ids
    (banned or filtered) and a row whose first chunk is all -inf."""
    g = torch.Generator().manual_seed(3)
    rows, vocab = 5, 5000
    logits = (torch.randn(rows, vocab, generator=g) * 4).to(dtype)
    logits[1, :2500] = float("-inf")
    logits[2, ::7] = float("-inf")
    sampled = torch.tensor([17, 4321, 8, 2049, 4999])
    logits[3, [5, 600, 4000]] = logits[3, 2049].item()  # three other ids tie with the sampled one
    value = torch.empty(rows, device=DEVICE)
    rank = torch.empty(rows, dtype=torch.int32, device=DEVICE)
    shift = kernel.sampled_logprobs(
        logits.to(DEVICE), sampled.to(DEVICE), logprobs, value, rank, num_chunks
    )
    x = logits.float()
    target = x.gather(1, sampled[:, None])[:, 0]
    expected = x.log_softmax(dim=-1).gather(1, sampled[:, None])[:, 0] if logprobs else target
    torch.testing.assert_close(value.cpu(), expected, rtol=0, atol=2e-5)
    assert rank.cpu().tolist() == (x >= target[:, None]).sum(dim=-1).tolist()
    assert rank[3].item() == 4 + int((x[3] > target[3]).sum())
    if logprobs:  # any id's logprob is its logit less the shift
        torch.testing.assert_close(
            x - shift.cpu()[:, None], x.log_softmax(dim=-1), atol=2e-5, rtol=0
        )
    else:
        assert shift.cpu().tolist() == [0.0] * rows


def test_sampled_logprobs_keep_their_bits_whatever_rows_share_the_step():
    """Deterministic mode's promise for the logsumexp: rows two at a time and all 64 at once
    (the argmax kernel's chunking would cut a row 20 ways in the first, once in the second)
    give the same bits."""
    g = torch.Generator().manual_seed(5)
    rows, vocab = 64, 40_000
    logits = (torch.randn(rows, vocab, generator=g) * 4).to(DEVICE)
    sampled = torch.randint(0, vocab, (rows,), generator=g).to(DEVICE)

    def run(first: int, count: int) -> list[tuple[float, float, int]]:
        value = torch.empty(count, device=DEVICE)
        rank = torch.empty(count, dtype=torch.int32, device=DEVICE)
        at = slice(first, first + count)
        shift = kernel.sampled_logprobs(logits[at], sampled[at], True, value, rank)
        return list(zip(value.tolist(), shift.tolist(), rank.tolist(), strict=True))

    assert [r for first in range(0, rows, 2) for r in run(first, 2)] == run(0, rows)
