"""The on-device sampler: filters, distributions, counter-based noise, and seeded reproducibility end to end."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from tandem import LLM, SamplingParams
from tandem.sampling import (
    MAX_SEED,
    SamplingTensors,
    fold_seed,
    gumbel_noise,
    sample,
    uniform,
)

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

NUM_DRAWS = 20_000  # samples per distribution test; every expected count is well above 5
SIGNIFICANCE = 1e-3
LOGITS = [2.0, 1.2, 0.5, 0.0, -0.4, -1.0, -1.5]
PROMPTS = ["The quick brown fox", "Hello, café 日本!", "def add(a, b):", "Our scheduler reads"]


def tensors(
    rows: int,
    temperature: float | list[float] = 1.0,
    top_k: int | list[int] = 0,
    top_p: float | list[float] = 1.0,
    min_p: float | list[float] = 0.0,
    seeds: int | list[int] = 0,
    positions: int | list[int] | None = None,
) -> SamplingTensors:
    """SamplingTensors for `rows` rows; a scalar applies to every row, positions default to 0..rows-1."""

    def column(value, dtype: torch.dtype) -> torch.Tensor:
        values = value if isinstance(value, list) else [value] * rows
        assert len(values) == rows
        return torch.tensor(values, dtype=dtype)

    return SamplingTensors(
        temperature=column(temperature, torch.float32),
        top_k=column(top_k, torch.int32),
        top_p=column(top_p, torch.float32),
        min_p=column(min_p, torch.float32),
        seeds=column(seeds, torch.int32),
        positions=column(list(range(rows)) if positions is None else positions, torch.int32),
    )


def rows_of(t: SamplingTensors, index: list[int]) -> SamplingTensors:
    return SamplingTensors(
        *(getattr(t, name)[index] for name in SamplingTensors.__dataclass_fields__)
    )


def draw(logits: list[float], num: int, use_filters: bool = False, **params) -> np.ndarray:
    """`num` tokens from one row of logits, one per output position at a fixed seed."""
    batch = torch.tensor([logits], dtype=torch.float32).expand(num, -1)
    return sample(batch, tensors(num, seeds=1234, **params), use_filters).numpy()


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def assert_follows(samples: np.ndarray, probs: np.ndarray) -> None:
    """Chi-square goodness of fit; tokens with zero probability must never appear."""
    counts = np.bincount(samples, minlength=len(probs))
    assert counts[probs == 0].sum() == 0, counts
    support = probs > 0
    expected = probs[support] * len(samples)
    assert expected.min() >= 5, "too few draws for a chi-square test"
    result = stats.chisquare(counts[support], expected)
    assert result.pvalue > SIGNIFICANCE, (counts, expected.round())


def allowed_tokens(
    logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float
) -> np.ndarray:
    """[vocab] bool: tokens every filter may keep (float64; ties and float32 error get the benefit)."""
    scaled = (logits.astype(np.float32) / np.float32(temperature)).astype(np.float64)
    kth_largest = np.sort(scaled)[::-1][min(top_k, len(scaled)) - 1] if top_k > 0 else -np.inf
    in_top_k = scaled >= kth_largest
    probs = softmax(scaled)
    mass_above = np.array([probs[scaled > s].sum() for s in scaled])
    in_top_p = (mass_above < top_p + 1e-5) | (top_p >= 1)
    above_min_p = np.exp(scaled - scaled.max()) >= min_p - 1e-5
    return in_top_k & in_top_p & above_min_p


# ---- filters only ever emit allowed tokens ------------------------------------------------

logit_rows = st.lists(st.floats(-30, 30, width=32), min_size=2, max_size=40).map(
    lambda xs: np.array(xs, dtype=np.float32)
)


@settings(max_examples=300, deadline=None)
@given(
    logits=logit_rows,
    temperature=st.floats(0.05, 4.0),
    top_k=st.integers(0, 45),
    top_p=st.floats(0.01, 1.0),
    min_p=st.floats(0.0, 1.0),
    seed=st.integers(-(2**31), 2**31 - 1),
)
def test_top_k_top_p_and_min_p_only_ever_emit_allowed_tokens(
    logits, temperature, top_k, top_p, min_p, seed
):
    rows = 64
    t = tensors(rows, temperature, top_k, top_p, min_p, seeds=seed)
    sampled = sample(torch.from_numpy(logits).expand(rows, -1), t, use_filters=True).numpy()
    allowed = allowed_tokens(logits, temperature, top_k, top_p, min_p)
    assert allowed[sampled].all(), (sampled, np.flatnonzero(allowed))


def test_top_k_keeps_exactly_the_k_most_likely_tokens():
    # temperature 5 flattens the distribution, so every kept token shows up
    sampled = draw(LOGITS, 2000, use_filters=True, temperature=5.0, top_k=3)
    assert set(sampled.tolist()) == {0, 1, 2}


def test_top_k_keeps_the_tokens_tied_with_the_kth_as_transformers_and_vllm():
    """Logits [3, 2, 2, 1, 0.5], top_k=2: both 2s are kept (transformers' TopKLogitsWarper and
    vLLM's sampler mask only what is below the k-th value); which one survived a rank cut
    depended on the sort."""
    from transformers import TopKLogitsWarper

    logits = [3.0, 2.0, 2.0, 1.0, 0.5]
    warped = TopKLogitsWarper(top_k=2)(None, torch.tensor([logits]))
    want = set(torch.isfinite(warped[0]).nonzero().flatten().tolist())
    assert want == {0, 1, 2}
    sampled = draw(logits, 3000, use_filters=True, temperature=5.0, top_k=2)
    assert set(sampled.tolist()) == want


def test_top_p_keeps_the_smallest_prefix_whose_mass_reaches_p():
    # probs [0.47, 0.21, 0.10, 0.06, 0.04, 0.02, 0.01]: mass before token 2 is 0.68, before 3 is 0.79
    sampled = draw(LOGITS, 2000, use_filters=True, top_p=0.75)
    assert set(sampled.tolist()) == {0, 1, 2}


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability():
    # token 2 has exp(-1.5) = 0.22 of the top probability and is kept; token 3 (0.14) is not
    sampled = draw(LOGITS, 2000, use_filters=True, min_p=0.2)
    assert set(sampled.tolist()) == {0, 1, 2}


def test_top_p_applies_to_what_top_k_leaves_as_in_vllm_and_transformers():
    # probs [0.4, 0.3, 0.2, 0.1]; top_k=2 leaves [4/7, 3/7], whose top 0.5 is token 0 alone
    logits = np.log([0.4, 0.3, 0.2, 0.1]).tolist()
    sampled = draw(logits, 1000, use_filters=True, top_k=2, top_p=0.5)
    assert set(sampled.tolist()) == {0}


# ---- greedy rows and row independence -----------------------------------------------------

row_params = st.fixed_dictionaries(
    {
        "temperature": st.sampled_from([0.0, 0.0, 0.3, 1.0, 2.0]),
        "top_k": st.integers(0, 8),
        "top_p": st.floats(0.05, 1.0),
        "min_p": st.sampled_from([0.0, 0.0, 0.05, 0.5]),
        "seeds": st.integers(-(2**31), 2**31 - 1),
        "positions": st.integers(0, 2**31 - 1),
    }
)


def random_batch(
    rows: list[dict], seed: int, vocab: int = 50
) -> tuple[torch.Tensor, SamplingTensors]:
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(seed)) * 3
    return logits, tensors(len(rows), **{name: [row[name] for row in rows] for name in rows[0]})


@settings(max_examples=100, deadline=None)
@given(rows=st.lists(row_params, min_size=1, max_size=12), seed=st.integers(0, 1000))
@pytest.mark.parametrize("use_filters", [False, True])
def test_greedy_rows_take_the_argmax_whatever_the_other_rows_do(rows, seed, use_filters):
    logits, t = random_batch(rows, seed)
    sampled = sample(logits, t, use_filters)
    greedy = t.temperature == 0
    assert torch.equal(sampled[greedy], logits[greedy].argmax(dim=-1))


@settings(max_examples=100, deadline=None)
@given(
    rows=st.lists(row_params, min_size=2, max_size=12),
    seed=st.integers(0, 1000),
    order=st.randoms(use_true_random=False),
)
def test_a_rows_token_depends_only_on_its_seed_position_and_logits(rows, seed, order):
    logits, t = random_batch(rows, seed)
    together = sample(logits, t, use_filters=True).tolist()

    alone = [
        sample(logits[[i]], rows_of(t, [i]), use_filters=True).item() for i in range(len(rows))
    ]
    assert together == alone

    permutation = list(range(len(rows)))
    order.shuffle(permutation)
    permuted = sample(logits[permutation], rows_of(t, permutation), use_filters=True).tolist()
    assert permuted == [together[i] for i in permutation]

    inserted = permutation[:1] + permutation  # a duplicate row: same seed, position and logits
    assert sample(logits[inserted], rows_of(t, inserted), use_filters=True).tolist() == [
        together[i] for i in inserted
    ]


def test_an_unfiltered_row_samples_the_same_token_when_a_neighbour_needs_the_filter_pass():
    rows = 256
    logits = torch.randn(rows, 100, generator=torch.Generator().manual_seed(0)) * 3
    plain = sample(logits, tensors(rows, seeds=9), use_filters=False)
    with_filter_pass = sample(logits, tensors(rows, seeds=9), use_filters=True)
    assert torch.equal(plain, with_filter_pass)


# ---- distributions ------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_temperature_sampling_follows_softmax_of_logits_over_temperature(temperature):
    samples = draw(LOGITS, NUM_DRAWS, temperature=temperature)
    assert_follows(samples, softmax(np.array(LOGITS) / temperature))


def test_sampling_over_seeds_at_one_position_follows_the_softmax():
    batch = torch.tensor([LOGITS]).expand(NUM_DRAWS, -1)
    seeds = [fold_seed(s) for s in range(NUM_DRAWS)]
    samples = sample(batch, tensors(NUM_DRAWS, seeds=seeds, positions=0), use_filters=False)
    assert_follows(samples.numpy(), softmax(np.array(LOGITS)))


@pytest.mark.parametrize(
    ("params", "num_kept"),
    [
        ({"top_k": 3}, 3),
        ({"top_k": 5, "temperature": 1.5}, 5),
        ({"top_p": 0.75}, 3),
        ({"min_p": 0.07, "temperature": 0.8}, 4),  # ratios 0.08 kept, 0.05 dropped
    ],
)
def test_filtered_sampling_follows_the_renormalised_truncated_softmax(params, num_kept):
    truncated = softmax(np.array(LOGITS) / params.get("temperature", 1.0))
    truncated[num_kept:] = 0
    samples = draw(LOGITS, NUM_DRAWS, use_filters=True, **params)
    assert_follows(samples, truncated / truncated.sum())


# ---- the noise ----------------------------------------------------------------------------


def noise_grid(seeds: list[int], num_positions: int, vocab: int) -> torch.Tensor:
    """[seeds, positions, vocab] Gumbel noise."""
    positions = torch.arange(num_positions, dtype=torch.int32)
    return torch.stack(
        [
            gumbel_noise(torch.full_like(positions, seed), positions, torch.arange(vocab))
            for seed in seeds
        ]
    )


def test_gumbel_noise_has_the_gumbel_mean_and_variance():
    noise = noise_grid([0, 7, fold_seed(MAX_SEED)], 200, 2000).double()
    assert torch.isfinite(noise).all()
    assert abs(noise.mean().item() - np.euler_gamma) < 0.01
    assert abs(noise.var().item() - np.pi**2 / 6) < 0.02


def test_gumbel_noise_comes_from_uniforms_that_pass_a_ks_test():
    uniforms = torch.exp(-torch.exp(-noise_grid([3], 100, 2000).double())).flatten().numpy()
    assert stats.kstest(uniforms, "uniform").pvalue > SIGNIFICANCE


def test_gumbel_noise_is_uncorrelated_across_neighbouring_seeds_positions_and_tokens():
    noise = noise_grid([0, 1], 101, 1001).double()
    neighbours = {
        "seed": (noise[0], noise[1]),
        "position": (noise[0, :-1], noise[0, 1:]),
        "token": (noise[0, :, :-1], noise[0, :, 1:]),
    }
    for name, (a, b) in neighbours.items():
        r = np.corrcoef(a.flatten().numpy(), b.flatten().numpy())[0, 1]
        assert abs(r) < 0.02, (name, r)


def test_gumbel_noise_never_repeats_for_distinct_seed_position_and_token():
    # 1024 values from 2**23 possible uniforms: a repeat would point at the hash, not at chance
    noise = noise_grid([0, 1, -1, fold_seed(MAX_SEED)], 16, 16)
    assert noise.unique().numel() == noise.numel()


def test_the_uniforms_of_the_extreme_hashes_lie_strictly_inside_zero_and_one():
    u = uniform(torch.tensor([0, 1, 0xFFFFFE00, 0xFFFFFF00, 0xFFFFFFFF]))
    assert ((u > 0) & (u < 1)).all()
    assert torch.isfinite(-torch.log(-torch.log(u))).all()


# the hash of seed 5,614,732, output position 0 and token 3 is all ones in its top 24 bits (found
# by scanning seeds), whose uniform rounded to 1.0 when 24 bits made it: +inf noise
TOP_HASH_SEED, TOP_HASH_TOKEN = 5_614_732, 3


@pytest.mark.parametrize("use_filters", [False, True])
def test_a_token_with_the_top_hash_is_drawn_by_its_logit_like_any_other(use_filters):
    """Row 0 masks every token but 5 (-inf), row 1 gives token 3 a logit 40 below the others':
    neither draws token 3, whose noise is the largest any hash gives."""
    logits = torch.full((2, 8), float("-inf"))
    logits[0, 5] = 0.0
    logits[1] = torch.zeros(8).index_fill_(0, torch.tensor([TOP_HASH_TOKEN]), -40.0)
    params = SamplingTensors(
        torch.ones(2), torch.zeros(2, dtype=torch.int32), torch.ones(2), torch.zeros(2),
        torch.full((2,), TOP_HASH_SEED, dtype=torch.int32), torch.zeros(2, dtype=torch.int32),
    )  # fmt: skip
    noise = gumbel_noise(params.seeds, params.positions, torch.arange(8))
    assert torch.isfinite(noise).all() and noise[0].argmax() == TOP_HASH_TOKEN
    drawn = sample(logits, params, use_filters).tolist()
    assert drawn[0] == 5 and drawn[1] != TOP_HASH_TOKEN


def test_gumbel_noise_of_a_token_does_not_depend_on_where_it_sits_in_the_row():
    seeds = torch.tensor([5, 6], dtype=torch.int32)
    positions = torch.tensor([0, 3], dtype=torch.int32)
    permuted = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    in_order = gumbel_noise(seeds, positions, torch.arange(64))
    assert torch.equal(
        gumbel_noise(seeds, positions, permuted.expand(2, -1)), in_order[:, permuted]
    )


# ---- end to end: seeded and unseeded reproducibility --------------------------------------


@pytest.fixture(scope="module")
def folder(make_tiny) -> str:
    return str(make_tiny("llama"))


def make_llm(folder: str, **engine_args) -> LLM:
    """An engine sized for short tests (decode attention reads max_model_len slots per row)."""
    return LLM(folder, **{"max_model_len": 128, **engine_args})


def generate(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


def sampled(seed: int | None, **overrides) -> SamplingParams:
    return SamplingParams(**{"seed": seed, "max_tokens": 24, "ignore_eos": True, **overrides})


# A seeded request with neighbours that take every sampler path: filters, greedy, logprobs.
MIXED_PROMPTS = [*PROMPTS, "Once upon a time", "café au lait " * 6]
MIXED_PARAMS = [
    sampled(seed=7),
    sampled(seed=8, top_k=20, top_p=0.9),
    SamplingParams(temperature=0, max_tokens=17, ignore_eos=True),
    sampled(seed=9, min_p=0.05, logprobs=2),
    sampled(seed=10, temperature=0.6),
    sampled(seed=11, top_k=5, max_tokens=30),
]


@functools.cache
def alone(folder: str, index: int) -> list[int]:
    """Tokens of MIXED_PARAMS[index] on its own, synchronously."""
    llm = make_llm(folder, async_batching=False)
    return generate(llm, [MIXED_PROMPTS[index]], [MIXED_PARAMS[index]])[0]


@pytest.mark.parametrize("async_batching", [False, True], ids=["sync", "async"])
def test_a_seeded_request_samples_the_same_tokens_alone_and_in_a_batch(folder, async_batching):
    llm = make_llm(folder, async_batching=async_batching)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert alone(folder, 0) != generate(llm, PROMPTS[:1], [greedy])[0]  # it really samples

    batched = generate(llm, MIXED_PROMPTS, MIXED_PARAMS)
    assert batched == [alone(folder, i) for i in range(len(MIXED_PARAMS))]


def test_numpy_scalars_are_taken_as_the_numbers_they_hold(folder):
    """An RL config's numpy values (vLLM compares them, so takes them): the same params, the
    same tokens, as their Python numbers give."""
    plain = dict(n=2, temperature=0.7, top_p=0.9, top_k=5, min_p=0.01, max_tokens=8, seed=3,
                 presence_penalty=0.5, logit_bias={5: 1.0}, allowed_token_ids=list(range(300)),
                 stop_token_ids=[7], ignore_eos=True)  # fmt: skip
    as_numpy = {
        name: {np.int64(k): np.float64(v) for k, v in value.items()} if isinstance(value, dict)
        else [np.int64(v) for v in value] if isinstance(value, list)
        else value if isinstance(value, bool)
        else np.float32(value) if isinstance(value, float) and name != "min_p"
        else np.float64(value) if isinstance(value, float)
        else np.int64(value)
        for name, value in plain.items()
    }  # fmt: skip
    numpy_params = SamplingParams(**as_numpy)
    assert numpy_params == SamplingParams(**{**plain, "temperature": float(np.float32(0.7)),
                                             "top_p": float(np.float32(0.9))})  # fmt: skip
    assert all(type(v) in (int, float) for v in (numpy_params.n, numpy_params.temperature))
    llm = make_llm(folder, async_batching=False)
    want = SamplingParams(**{**plain, "temperature": float(np.float32(0.7)),
                             "top_p": float(np.float32(0.9))})  # fmt: skip
    assert generate(llm, PROMPTS[:1], [numpy_params]) == generate(llm, PROMPTS[:1], [want])


@pytest.mark.parametrize("async_batching", [False, True], ids=["sync", "async"])
def test_seeded_requests_sample_the_same_tokens_after_preemption(folder, async_batching):
    llm = LLM(
        folder,
        max_model_len=96,
        block_size=8,
        num_blocks=12,  # 96 token slots for six requests that grow to 204 tokens: forces preemption
        max_num_batched_tokens=16,
        async_batching=async_batching,
    )
    batched = generate(llm, MIXED_PROMPTS, MIXED_PARAMS)
    assert llm.engine.scheduler.num_preemptions > 0
    assert batched == [alone(folder, i) for i in range(len(MIXED_PARAMS))]


def test_unseeded_requests_are_reproducible_across_engines_with_the_same_seed(folder):
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[1]]
    params = [sampled(seed=None)] * len(prompts)
    first = generate(make_llm(folder, seed=123), prompts, params)
    second = generate(make_llm(folder, seed=123), prompts, params)
    other_seed = generate(make_llm(folder, seed=124), prompts, params)
    assert first == second
    assert first[0] != first[1]  # each request draws its own seed
    assert first != other_seed


def test_n_completions_of_a_request_with_the_largest_seed_are_accepted(folder):
    out = make_llm(folder).generate(PROMPTS[0], sampled(seed=MAX_SEED, n=2), use_tqdm=False)[0]
    assert len(out.outputs) == 2


# ---- end to end: logprobs -----------------------------------------------------------------


@functools.cache
def hf_model(folder: str):
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def reference_logprobs(folder: str, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """[len(output_ids), vocab] transformers' log-probabilities at each output position."""
    ids = torch.tensor([prompt_ids + output_ids[:-1]])
    with torch.no_grad():
        logits = hf_model(folder)(ids).logits[0, len(prompt_ids) - 1 :]
    return torch.log_softmax(logits.float(), dim=-1)


def assert_logprobs_match(entry: dict[int, float], reference: torch.Tensor) -> None:
    for token_id, logprob in entry.items():
        assert logprob == pytest.approx(reference[token_id].item(), abs=1e-4), token_id


@pytest.mark.parametrize("async_batching", [False, True], ids=["sync", "async"])
def test_greedy_logprobs_hold_the_top_3_with_transformers_values(folder, async_batching):
    llm = make_llm(folder, async_batching=async_batching)
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),  # a neighbour without
    ]
    out, neighbour = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    completion = out.outputs[0]
    reference = reference_logprobs(folder, out.prompt_token_ids, completion.token_ids)

    assert neighbour.outputs[0].logprobs is None
    assert len(completion.logprobs) == len(completion.token_ids) == 12
    for step, (token, entry) in enumerate(
        zip(completion.token_ids, completion.logprobs, strict=True)
    ):
        top3 = reference[step].topk(3).indices.tolist()
        assert token == top3[0]
        assert set(entry) == set(top3)
        assert_logprobs_match(entry, reference[step])


def test_sampled_logprobs_hold_the_sampled_token_even_outside_the_top_3(folder):
    params = sampled(seed=3, temperature=2.0, logprobs=3)
    out = make_llm(folder).generate(PROMPTS[2], params, use_tqdm=False)[0]
    completion = out.outputs[0]
    reference = reference_logprobs(folder, out.prompt_token_ids, completion.token_ids)

    num_outside_top3 = 0
    for step, (token, entry) in enumerate(
        zip(completion.token_ids, completion.logprobs, strict=True)
    ):
        top3 = set(reference[step].topk(3).indices.tolist())
        assert set(entry) == top3 | {token}
        assert_logprobs_match(entry, reference[step])
        num_outside_top3 += token not in top3
    assert num_outside_top3 > 0  # temperature 2 sends some draws outside the top 3


def test_zero_logprobs_returns_only_the_sampled_token(folder):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    completion = make_llm(folder).generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
    assert [list(entry) for entry in completion.logprobs] == [[t] for t in completion.token_ids]


def test_cumulative_logprob_sums_the_sampled_tokens_logprobs_and_is_none_without_logprobs(folder):
    """As vLLM's CompletionOutput.cumulative_logprob: set only when logprobs were asked for."""
    params = [sampled(seed=5, logprobs=0), sampled(seed=5)]
    with_logprobs, without = make_llm(folder).generate(PROMPTS[:2], params, use_tqdm=False)
    completion = with_logprobs.outputs[0]
    reference = reference_logprobs(folder, with_logprobs.prompt_token_ids, completion.token_ids)
    expected = reference.gather(1, torch.tensor(completion.token_ids)[:, None]).sum().item()
    assert completion.cumulative_logprob == pytest.approx(expected, abs=1e-3)
    assert without.outputs[0].cumulative_logprob is None


def test_logprobs_read_as_vllms_logprob_with_rank_and_decoded_token(folder):
    """Each entry is a Logprob: .logprob, .rank (1 + the vocabulary's more likely tokens, also for
    a sampled token outside the top 3) and .decoded_token (the token's text alone)."""
    params = sampled(seed=3, temperature=2.0, logprobs=3)
    llm = make_llm(folder)
    completion = llm.generate(PROMPTS[2], params, use_tqdm=False)[0].outputs[0]
    reference = reference_logprobs(
        folder, llm.get_tokenizer().encode(PROMPTS[2]), completion.token_ids
    )
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    ranks_outside_top3 = []
    for step, (token, entry) in enumerate(
        zip(completion.token_ids, completion.logprobs, strict=True)
    ):
        for token_id, logprob in entry.items():
            value = reference[step, token_id].item()
            assert logprob.logprob == pytest.approx(value, abs=1e-4)
            more_likely = int((reference[step] > value + 1e-4).sum())
            as_likely = int((reference[step] >= value - 1e-4).sum())
            assert more_likely + 1 <= logprob.rank <= as_likely, (step, token_id)
            assert logprob.decoded_token == hf_tokenizer.decode([token_id])
        if entry[token].rank > 3:
            ranks_outside_top3.append(entry[token].rank)
    assert ranks_outside_top3  # temperature 2 sends some draws outside the top 3
