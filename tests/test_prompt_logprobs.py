"""Prompt logprobs and scoring equal transformers' log_softmax of the same prompt (fp32, CPU)."""

from __future__ import annotations

import functools
import types
from dataclasses import replace

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem import prompt_logprobs as prompt_logprobs_module
from tandem.attention.torch_ref import soft_cap
from tandem.engine import Engine
from tandem.prompt_logprobs_kernel import lm_head_logprobs

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

TOLERANCE = 1e-4
PROMPT_LENGTHS = [37, 5, 2, 23, 41, 1]
# (prompt_logprobs, max_tokens) per prompt: top-k of 0, 1, 5 and 20, scoring and generating
REQUESTS = [(0, 0), (5, 4), (1, 0), (None, 6), (20, 3), (0, 2)]


def prompts(vocab: int, lengths: list[int] = PROMPT_LENGTHS) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@functools.cache
def hf_model(folder: str):
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    )


def reference_logprobs(folder: str, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, vocab]: row p is transformers' log_softmax predicting token p + 1."""
    with torch.no_grad():
        logits = hf_model(folder)(torch.tensor([ids])).logits[0].float()
    return logits.log_softmax(-1)[:-1]


def assert_matches_reference(entries, ids: list[int], k: int, reference: torch.Tensor) -> None:
    assert len(entries) == len(ids)
    assert entries[0] is None
    for p in range(1, len(ids)):
        entry, row, target = entries[p], reference[p - 1], ids[p]
        assert entry is not None, f"position {p} has no logprobs"
        assert abs(entry[target] - row[target].item()) < TOLERANCE, f"position {p}"
        assert_ranks_within(
            torch.tensor([entry[target].rank]), row[None], row[target, None], TOLERANCE
        )
        top = row.topk(k) if k else None
        assert next(iter(entry)) == target  # vLLM's order: the prompt's token, then the top k
        ranked = sorted((t for t in entry if entry[t].rank <= k), key=lambda t: entry[t].rank)
        assert len(entry) in (k, k + 1) and (target in ranked or len(entry) == k + 1)
        if top is not None:
            for token, value in zip(ranked, top.values.tolist(), strict=True):
                assert abs(entry[token] - row[token].item()) < TOLERANCE
                assert abs(entry[token] - value) < TOLERANCE  # the top k, in rank order


def assert_ranks_within(
    ranks: torch.Tensor, reference: torch.Tensor, wanted: torch.Tensor, tolerance: float
) -> None:
    """Each rank [rows] counts the ids at least as likely as the row's target (vLLM's rank),
    up to ids within `tolerance` of the target's logprob `wanted` [rows] in `reference`."""
    more_likely = (reference > wanted[:, None] + tolerance).sum(-1)
    at_least = (reference >= wanted[:, None] - tolerance).sum(-1)
    ranks = ranks.long().cpu()
    assert bool(((more_likely.cpu() + 1 <= ranks) & (ranks <= at_least.cpu())).all()), ranks


def run_pieces_eagerly(monkeypatch) -> None:
    monkeypatch.setattr(Engine, "_use_piecewise", lambda self: True)


def use_fused_kernel(monkeypatch) -> None:
    """The CUDA path's fused LM head + log-softmax, run in Triton's interpreter."""
    monkeypatch.setattr(
        prompt_logprobs_module, "fused", types.SimpleNamespace(use_kernels=lambda x: True)
    )


@pytest.mark.parametrize(
    ("async_batching", "path"),
    [(False, "eager"), (True, "eager"), (True, "pieces"), (False, "fused")],
    ids=["sync", "async", "async-pieces", "sync-fused"],
)
def test_prompt_logprobs_match_transformers_with_chunks_and_preemption(
    make_tiny, monkeypatch, async_batching, path
):
    if path == "pieces":
        run_pieces_eagerly(monkeypatch)
    if path == "fused":
        use_fused_kernel(monkeypatch)
        requests = [(k if k is None else min(k, 1), n) for k, n in REQUESTS]
    else:
        requests = REQUESTS
    # sub-chunks of 3 rows: a prompt's rows are reduced in several pieces
    monkeypatch.setattr(prompt_logprobs_module, "SUB_CHUNK_BYTES", 3 * 4 * 704)
    folder = str(make_tiny("llama"))
    llm = LLM(
        folder,
        max_model_len=56,
        block_size=8,
        num_blocks=7,  # 56 token slots for prompts of 109 tokens in all: forces preemption
        max_num_batched_tokens=16,  # below the longest prompts: chunk boundaries inside them
        async_batching=async_batching,
    )
    vocab = llm.engine.model_config.vocab_size
    assert vocab == 704
    ids = prompts(vocab)
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, prompt_logprobs=k)
        for k, n in requests
    ]
    outputs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)

    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.allocator.num_free == llm.engine.num_blocks
    for out, prompt, (k, n) in zip(outputs, ids, requests, strict=True):
        assert len(out.outputs[0].token_ids) == n
        assert out.outputs[0].finish_reason == "length"
        if k is None:
            assert out.prompt_logprobs is None
        else:
            assert_matches_reference(
                out.prompt_logprobs, prompt, k, reference_logprobs(folder, prompt)
            )


def test_prompt_logprobs_are_the_same_alone_and_in_a_batch(make_tiny):
    folder = str(make_tiny("qwen3"))
    llm = LLM(folder, max_model_len=128, num_blocks=64)
    ids = prompts(llm.engine.model_config.vocab_size)
    params = SamplingParams(max_tokens=0, prompt_logprobs=2)
    batch = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    for out, prompt in zip(batch, ids, strict=True):
        assert_matches_reference(out.prompt_logprobs, prompt, 2, reference_logprobs(folder, prompt))
        assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"


def test_loglikelihood_is_the_continuation_s_log_likelihood(make_tiny):
    folder = str(make_tiny("llama"))
    llm = LLM(folder, max_model_len=128, num_blocks=32, max_num_batched_tokens=8)
    tokenizer = llm.get_tokenizer()
    contexts = ["The quick brown fox", "one two", [5, 6, 7]]
    continuations = [" jumps over", " three four five", [8]]
    scores = llm.loglikelihood(contexts, continuations, use_tqdm=False)
    for context, continuation, score in zip(contexts, continuations, scores, strict=True):
        c = context if isinstance(context, list) else tokenizer.encode(context)
        x = (
            continuation
            if isinstance(continuation, list)
            else tokenizer.encode(continuation, add_special_tokens=False)
        )
        reference = reference_logprobs(folder, c + x)[len(c) - 1 :]
        expected = [reference[i, t].item() for i, t in enumerate(x)]
        assert score.token_logprobs == pytest.approx(expected, abs=TOLERANCE)
        assert score.logprob == pytest.approx(sum(expected), abs=TOLERANCE * len(x))
        assert score.is_greedy == all(reference[i].argmax().item() == t for i, t in enumerate(x))
    # a continuation that is the model's own greedy output is greedy
    greedy = (
        llm.generate(
            [{"prompt_token_ids": [5, 6, 7]}],
            SamplingParams(temperature=0, max_tokens=3),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .token_ids
    )
    assert llm.loglikelihood([[5, 6, 7]], [greedy], use_tqdm=False)[0].is_greedy


@pytest.mark.parametrize(
    ("contexts", "continuations", "message"),
    [
        ("one two", " three", "contexts must be a list"),  # read as a pair per character before
        (["one two"], " three", "continuations must be a list"),  # one pair, " three"[0], before
        (None, None, "contexts must be a list"),
        ([5], [[6]], "each context and continuation must be a text or a list of token ids"),
    ],
)
def test_loglikelihood_of_no_list_of_pairs_is_a_type_error(
    make_tiny, contexts, continuations, message
):
    llm = LLM(str(make_tiny("llama")), max_model_len=64, num_blocks=16)
    with pytest.raises(TypeError, match=message):
        llm.loglikelihood(contexts, continuations, use_tqdm=False)
    assert llm.loglikelihood([[5, 6]], [[7]], use_tqdm=False)[0].token_logprobs
    assert not llm.engine.has_unfinished()


def test_scoring_a_one_token_prompt_finishes_at_once(make_tiny):
    llm = LLM(str(make_tiny("llama")), max_model_len=64, num_blocks=16)
    out = llm.generate(
        [{"prompt_token_ids": [9]}, {"prompt_token_ids": [9, 10]}],
        SamplingParams(max_tokens=0, prompt_logprobs=0),
        use_tqdm=False,
    )
    assert out[0].prompt_logprobs == [None]
    assert out[0].outputs[0].finish_reason == "length" and out[0].outputs[0].token_ids == []
    assert out[1].prompt_logprobs[0] is None and list(out[1].prompt_logprobs[1]) == [10]
    assert not llm.engine.has_unfinished()
    assert llm.engine.allocator.num_free == llm.engine.num_blocks


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"prompt_logprobs": -2}, "prompt_logprobs"),
        ({"prompt_logprobs": 1.5}, "prompt_logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -1, "prompt_logprobs": 0}, "max_tokens"),
    ],
)
def test_bad_prompt_logprobs_params_raise_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("softcap", [None, 15.0])
@pytest.mark.parametrize("rows", [1, 20, 130])
def test_fused_lm_head_kernel_matches_log_softmax(rows, softcap):
    g = torch.Generator().manual_seed(rows)
    vocab, hidden = 1000, 48
    tokens = torch.randn(rows + 5, hidden, generator=g)
    index = torch.randperm(rows + 5, generator=g)[:rows]  # the rows are gathered in the kernel
    weight = torch.randn(vocab + 24, hidden, generator=g)  # padded past the vocabulary
    targets = torch.randint(0, vocab, (rows,), generator=g)
    values = torch.empty(rows, 2)
    ids = torch.empty(rows, 1, dtype=torch.int32)
    ranks = torch.empty(rows, dtype=torch.int32)
    lm_head_logprobs(tokens, index, weight, targets, vocab, values, ids, ranks, 3, softcap)
    reference = soft_cap(tokens[index] @ weight[:vocab].T, softcap).log_softmax(-1)
    wanted = reference.gather(1, targets[:, None])[:, 0]
    assert torch.allclose(values[:, 0], wanted, atol=1e-4)
    assert_ranks_within(ranks, reference, wanted, 1e-4)
    assert torch.allclose(values[:, 1], reference.max(-1).values, atol=1e-4)
    assert torch.equal(ids[:, 0].long(), reference.argmax(-1))


def test_two_ranks_give_the_prompt_logprobs_of_one(make_tiny):
    """Tensor parallelism over gloo: the vocabulary-sharded LM head's logits are gathered first."""

    def run(tensor_parallel_size: int):
        llm = LLM(str(make_tiny("llama")), max_model_len=56, num_blocks=7, block_size=8,
                  max_num_batched_tokens=16, tensor_parallel_size=tensor_parallel_size)  # fmt: skip
        ids = prompts(llm.engine.model_config.vocab_size)
        params = [
            SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, prompt_logprobs=k)
            for k, n in REQUESTS
        ]
        try:
            outputs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
            assert llm.engine.scheduler.num_preemptions > 0
        finally:
            llm.shutdown()
        return [(o.prompt_logprobs, o.outputs[0].token_ids) for o in outputs]

    for (two, tokens_two), (one, tokens_one) in zip(run(2), run(1), strict=True):
        assert tokens_two == tokens_one
        if one is None:
            assert two is None
            continue
        assert two[0] is None and len(two) == len(one)
        for a, b in zip(two[1:], one[1:], strict=True):
            assert a.keys() == b.keys()
            assert all(abs(a[t] - b[t]) < TOLERANCE for t in a), max(abs(a[t] - b[t]) for t in a)


def test_a_request_with_prompt_logprobs_takes_nothing_from_the_prefix_cache(make_tiny):
    """Positions served from the cache would have no hidden rows: such a request computes its
    whole prompt, while a plain request with the same prompt reuses the cached blocks."""
    folder = str(make_tiny("llama"))
    llm = LLM(folder, max_model_len=128, block_size=8, num_blocks=32, enable_prefix_caching=True)
    prompt = {"prompt_token_ids": prompts(llm.engine.model_config.vocab_size)[0]}  # 37 tokens
    plain = SamplingParams(temperature=0, max_tokens=2)
    llm.generate([prompt], plain, use_tqdm=False)
    assert llm.generate([prompt], plain, use_tqdm=False)[0].num_cached_tokens == 32
    for params in (
        SamplingParams(max_tokens=0, prompt_logprobs=1),
        replace(plain, prompt_logprobs=0),
    ):
        [out] = llm.generate([prompt], params, use_tqdm=False)
        assert out.num_cached_tokens == 0
        k = params.prompt_logprobs
        ids = prompt["prompt_token_ids"]
        assert_matches_reference(out.prompt_logprobs, ids, k, reference_logprobs(folder, ids))


def test_the_fused_path_soft_caps_gemma_2_logits(make_tiny, monkeypatch):
    use_fused_kernel(monkeypatch)
    folder = str(make_tiny("gemma2"))
    llm = LLM(folder, max_model_len=128, num_blocks=32, max_num_batched_tokens=16)
    ids = prompts(llm.engine.model_config.vocab_size)[0]
    [out] = llm.generate(
        [{"prompt_token_ids": ids}], SamplingParams(max_tokens=0, prompt_logprobs=1), use_tqdm=False
    )
    assert_matches_reference(out.prompt_logprobs, ids, 1, reference_logprobs(folder, ids))


def test_prompt_logprobs_read_as_vllms_logprob_with_rank_and_decoded_token(make_tiny):
    """The top k hold ranks 1..k in order and each token's text alone; the prompt token holds its
    own rank, within the top k or not (as vLLM's)."""
    folder = str(make_tiny("llama"))
    llm = LLM(folder, max_model_len=64)
    ids = prompts(llm.engine.model_config.vocab_size, [24])[0]
    params = SamplingParams(max_tokens=1, prompt_logprobs=5)
    [out] = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    reference = reference_logprobs(folder, ids)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    for p in range(1, len(ids)):
        entry, row = out.prompt_logprobs[p], reference[p - 1]
        for token_id, logprob in entry.items():
            value = row[token_id].item()
            assert logprob.logprob == pytest.approx(value, abs=TOLERANCE)
            assert logprob.decoded_token == hf_tokenizer.decode([token_id])
            more_likely = int((row > value + TOLERANCE).sum())
            assert more_likely + 1 <= logprob.rank <= int((row >= value - TOLERANCE).sum())
        assert next(iter(entry)) == ids[p]  # vLLM's order: the prompt's token first
        assert sorted(lp.rank for lp in entry.values())[:5] == [1, 2, 3, 4, 5]
