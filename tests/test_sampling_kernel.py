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


def check_matches_torch(rows, vocab, seed, scale, num_chunks):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g) * scale).to(DEVICE)
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


@pytest.mark.parametrize("num_chunks", [1, 3])
def test_greedy_rows_take_the_first_maximum(num_chunks):
    logits = torch.zeros(2, 4100, device=DEVICE)
    logits[:, [3000, 4099]] = 1.0  # equal maxima in different blocks (and chunks)
    logits[1, 5] = 1.0
    out = kernel.gumbel_argmax(
        logits,
        torch.zeros(2, device=DEVICE),
        torch.zeros(2, dtype=torch.int32, device=DEVICE),
        torch.zeros(2, dtype=torch.int32, device=DEVICE),
        num_chunks,
    )
    assert out.tolist() == [3000, 5]
