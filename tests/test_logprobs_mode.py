"""vLLM's logprobs_mode: sample logprobs as the model's log-softmax or logits ("raw"), or as
those the sampler draws from ("processed": temperature and top-k/top-p/min-p applied), against
transformers' logits and a direct per-row formula; the mode never changes the tokens."""

from __future__ import annotations

import math
import types

import pytest
import torch

from tandem import LLM, SamplingParams, sampling
from tandem.config import LOGPROBS_MODES
from tandem.sampling import draw, processed_logits, sample
from test_sampling import PROMPTS, folder, hf_model, make_llm, tensors

__all__ = ["folder"]  # the fixture, used by name

TEMPERATURE, TOP_K = 0.7, 8


def filtered_row(row: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float):
    """One row as the sampler draws from it, element by element, in vLLM's order: scaled, then
    -inf below min_p x the most likely one's probability, outside the top-k of the rest, and
    outside the smallest set of those whose mass (among them) reaches top_p."""
    scaled = row.double() / (temperature or 1.0)
    order = sorted(range(len(row)), key=lambda i: -scaled[i].item())
    whole = torch.softmax(scaled, dim=0)
    kept = [i for i in order if whole[i] >= min_p * whole[order[0]]][: top_k or len(row)]
    probs = torch.softmax(scaled[kept], dim=0).tolist()
    out = torch.full_like(scaled, -math.inf)
    mass = 0.0
    for token, p in zip(kept, probs, strict=True):
        if top_p < 1 and mass >= top_p:
            break
        out[token] = scaled[token]
        mass += p
    return out


def test_processed_logits_match_the_sampler_filters_element_by_element():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 40, generator=g) * 3
    rows = [(0.5, 0, 1.0, 0.0), (1.0, 3, 1.0, 0.0), (0.8, 0, 0.6, 0.0), (1.3, 0, 1.0, 0.2),
            (0.0, 4, 0.9, 0.1)]  # fmt: skip
    t = tensors(5, *[list(column) for column in zip(*rows, strict=True)])
    got = processed_logits(logits, t, use_filters=True)
    for i, row in enumerate(rows):
        expected = filtered_row(logits[i], *row)
        assert torch.equal(got[i].isinf(), expected.isinf()), i
        finite = ~expected.isinf()
        torch.testing.assert_close(got[i][finite].double(), expected[finite], rtol=1e-6, atol=1e-5)
    # without filters: the scaled logits alone
    plain = processed_logits(logits[:1], tensors(1, 0.5), use_filters=False)
    torch.testing.assert_close(plain, logits[:1] / 0.5)


def reference_values(folder: str, prompt_ids: list[int], output_ids: list[int], mode: str):
    """[outputs, vocab] float64: transformers' logits at each output position, in `mode`."""
    ids = torch.tensor([prompt_ids + output_ids[:-1]])
    with torch.no_grad():
        logits = hf_model(folder)(ids).logits[0, len(prompt_ids) - 1 :].double()
    if mode.startswith("processed"):
        logits = torch.stack([filtered_row(row, TEMPERATURE, TOP_K, 1.0, 0.0) for row in logits])
    return logits.log_softmax(dim=-1) if mode.endswith("logprobs") else logits


@pytest.mark.parametrize("mode", LOGPROBS_MODES)
def test_sample_logprobs_hold_what_the_mode_names(folder, mode):
    params = SamplingParams(seed=5, temperature=TEMPERATURE, top_k=TOP_K, max_tokens=8,
                            ignore_eos=True, logprobs=2)  # fmt: skip
    default = make_llm(folder).generate(PROMPTS[:2], params, use_tqdm=False)
    outs = make_llm(folder, logprobs_mode=mode).generate(PROMPTS[:2], params, use_tqdm=False)
    for out, plain in zip(outs, default, strict=True):
        completion = out.outputs[0]
        assert completion.token_ids == plain.outputs[0].token_ids  # the mode samples nothing
        reference = reference_values(folder, out.prompt_token_ids, completion.token_ids, mode)
        for step, (token, entry) in enumerate(
            zip(completion.token_ids, completion.logprobs, strict=True)
        ):
            expected = reference[step]
            top = expected.topk(2).indices.tolist()
            assert next(iter(entry)) == token  # vLLM's order: the sampled token, then the top
            by_rank = sorted(entry, key=lambda t: entry[t].rank)
            assert by_rank[:2] == top or set(by_rank[:2]) == set(top)
            for t, value in entry.items():
                assert value.logprob == pytest.approx(expected[t].item(), abs=1e-4), (step, t)
            assert entry[token].rank == int((expected >= expected[token]).sum())
        total = sum(reference[i][t].item() for i, t in enumerate(completion.token_ids))
        assert completion.cumulative_logprob == pytest.approx(total, abs=1e-3)


def test_an_unknown_logprobs_mode_is_a_value_error_naming_the_modes(folder):
    with pytest.raises(ValueError, match=r"logprobs_mode must be one of .*processed_logprobs"):
        LLM(folder, logprobs_mode="processed")


def test_processed_logprobs_follow_the_penalties_too(folder):
    """A repetition penalty changes what the sampler draws from: processed logits divide (or
    multiply) every seen token's logit by it before the temperature and top-k."""
    penalty = 1.6
    params = SamplingParams(seed=2, temperature=TEMPERATURE, top_k=TOP_K, max_tokens=8,
                            ignore_eos=True, logprobs=1, repetition_penalty=penalty)  # fmt: skip
    llm = make_llm(folder, logprobs_mode="processed_logits")
    [out] = llm.generate(PROMPTS[2], params, use_tqdm=False)
    completion, prompt = out.outputs[0], out.prompt_token_ids
    ids = torch.tensor([prompt + completion.token_ids[:-1]])
    with torch.no_grad():
        logits = hf_model(folder)(ids).logits[0, len(prompt) - 1 :].double()
    for step, (token, entry) in enumerate(
        zip(completion.token_ids, completion.logprobs, strict=True)
    ):
        row = logits[step].clone()
        seen = sorted({*prompt, *completion.token_ids[:step]})
        row[seen] = torch.where(row[seen] > 0, row[seen] / penalty, row[seen] * penalty)
        expected = filtered_row(row, TEMPERATURE, TOP_K, 1.0, 0.0)
        for t, value in entry.items():
            assert value.logprob == pytest.approx(expected[t].item(), abs=1e-4), (step, t)
        assert entry[token].rank == int((expected >= expected[token]).sum())


@pytest.mark.parametrize("mode", ["raw_logits", "raw_logprobs"])
def test_raw_values_keep_the_ids_min_tokens_bans(folder, mode):
    """min_tokens bans EOS in the sampler's logits; the raw values are the model's own, so the
    banned id keeps its finite value."""
    llm = make_llm(folder, logprobs_mode=mode)
    eos = min(llm.engine.eos_token_ids)
    params = SamplingParams(seed=1, top_k=TOP_K, max_tokens=6, min_tokens=6,
                            logprob_token_ids=[eos])  # fmt: skip
    [out] = llm.generate(PROMPTS[3], params, use_tqdm=False)
    completion = out.outputs[0]
    reference = reference_values(folder, out.prompt_token_ids, completion.token_ids, mode)
    for step, entry in enumerate(completion.logprobs):
        assert entry[eos].logprob == pytest.approx(reference[step][eos].item(), abs=1e-4)


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_the_fused_logprob_kernels_report_what_the_torch_path_does(folder, mode, monkeypatch):
    """Sample logprobs through the Triton kernels (interpreted here; CUDA's path) against the
    torch ops, in one batch: top ids, named ids, a min_tokens ban, a penalized row."""
    params = [
        SamplingParams(seed=3, temperature=TEMPERATURE, top_k=TOP_K, max_tokens=6,
                       ignore_eos=True, logprobs=3),
        SamplingParams(seed=4, max_tokens=6, min_tokens=6, logprob_token_ids=[0, 7, 300]),
        SamplingParams(seed=5, max_tokens=6, ignore_eos=True, logprobs=0,
                       repetition_penalty=1.4),
    ]  # fmt: skip
    torch_path = make_llm(folder, logprobs_mode=mode).generate(PROMPTS[:3], params, use_tqdm=False)
    monkeypatch.setattr(sampling, "fused", types.SimpleNamespace(use_kernels=lambda x: True))
    kernels = make_llm(folder, logprobs_mode=mode).generate(PROMPTS[:3], params, use_tqdm=False)
    for a, b in zip(torch_path, kernels, strict=True):
        first, second = a.outputs[0], b.outputs[0]
        assert first.token_ids == second.token_ids
        for entry_a, entry_b in zip(first.logprobs, second.logprobs, strict=True):
            assert list(entry_a) == list(entry_b)
            for t, value in entry_a.items():
                assert entry_b[t].logprob == pytest.approx(value.logprob, abs=1e-5)
                assert entry_b[t].rank == value.rank


def test_drawing_from_processed_values_picks_the_sampler_s_tokens():
    """A processed-mode logprob step draws from the values it reports, sorted once: the same
    token as `sample`'s draw in sorted order, for every filter and for greedy rows."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(6, 300, generator=g) * 3
    rows = [(0.7, 8, 1.0, 0.0), (1.0, 0, 0.8, 0.0), (1.3, 0, 1.0, 0.1), (0.0, 5, 0.9, 0.0),
            (0.5, 40, 0.95, 0.05), (1.0, 1, 1.0, 0.0)]  # fmt: skip
    for seed in range(5):
        t = tensors(6, *[list(column) for column in zip(*rows, strict=True)], seeds=seed,
                    positions=list(range(6)))  # fmt: skip
        expected = sample(logits, t, use_filters=True)
        assert draw(logits, processed_logits(logits, t, use_filters=True), t).tolist() == (
            expected.tolist()
        )


def test_a_greedy_requests_processed_logprobs_ignore_its_filters_whatever_the_batch(folder):
    """As vLLM, which drops top-k/top-p/min-p from a greedy request: its processed logprobs are
    the model's log-softmax, alone or beside a request the step filters (top-k sampled, or a
    min_tokens ban)."""
    llm = make_llm(folder, logprobs_mode="processed_logprobs")
    greedy = SamplingParams(temperature=0.0, top_k=3, min_p=0.2, max_tokens=4, ignore_eos=True,
                            logprobs=5)  # fmt: skip
    sampled = SamplingParams(seed=3, temperature=TEMPERATURE, top_k=TOP_K, max_tokens=4)
    banning = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=2, logprobs=5)
    for batch in ([greedy], [greedy, sampled], [greedy, banning]):
        out = llm.generate(PROMPTS[: len(batch)], batch, use_tqdm=False)[0]
        completion = out.outputs[0]
        reference = reference_values(
            folder, out.prompt_token_ids, completion.token_ids, "raw_logprobs"
        )
        for step, entry in enumerate(completion.logprobs):
            for token, value in entry.items():
                assert value.logprob == pytest.approx(reference[step][token].item(), abs=1e-4)


def test_min_p_applies_before_top_p_as_vllm():
    """Probabilities [0.5, 0.3, 0.15, 0.05]: min-p 0.2 drops the last (below 0.1), and top-p
    0.81 of the rest, renormalized ([0.53, 0.32, 0.16]), keeps two. After top-p on the whole
    distribution it would keep three."""
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    t = tensors(1, 1.0, 0, 0.81, 0.2)
    kept = processed_logits(logits, t, use_filters=True)[0].isfinite()
    assert kept.tolist() == [True, True, False, False]
