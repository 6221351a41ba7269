"""deterministic=True on CUDA in bf16: a request's tokens and logprobs are bit-identical alone
and inside batches of 1, 7, 32 and 100 others, async and sync, with preemption forced; the
default mode is shown to differ on the same batches."""

from __future__ import annotations

import gc

import pytest
import torch

from tandem import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MODEL_ARGS = {"load_format": "dummy", "dtype": "bfloat16", "max_model_len": 1024}
PARAMS = SamplingParams(temperature=0.8, seed=3, max_tokens=48, ignore_eos=True, logprobs=4)
OTHERS = SamplingParams(temperature=1.0, max_tokens=64, ignore_eos=True)


def prompts(count: int, vocab: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(8, 300, (count,), generator=g).tolist()
    return [{"prompt_token_ids": torch.randint(0, vocab, (n,), generator=g).tolist()} for n in lens]


def target_in_batches(
    deterministic: bool, async_batching: bool, num_blocks: int | None = None, params=PARAMS
):
    """The target request's (tokens, logprobs, prompt logprobs) alone and in batches of 1, 7,
    32, 100 others."""
    llm = LLM("qwen3-0.6b", deterministic=deterministic, async_batching=async_batching,
              num_blocks=num_blocks, max_num_batched_tokens=512, **MODEL_ARGS)  # fmt: skip
    vocab = llm.engine.model_config.vocab_size
    target = prompts(1, vocab, seed=0)
    results = []
    for count in (0, 1, 7, 32, 100):
        batch = target + prompts(count, vocab, seed=count + 1)
        llm.engine.reset_prefix_cache()  # each batch computes the target's KV again
        out = llm.generate(batch, [params] + [OTHERS] * count, use_tqdm=False)[0]
        sample = out.outputs[0]
        results.append((sample.token_ids, sample.logprobs, out.prompt_logprobs))
    preemptions = llm.engine.scheduler.num_preemptions
    llm.shutdown()
    del llm  # the next engine sizes its cache by the free memory: this one's is given back
    gc.collect()
    torch.cuda.empty_cache()
    return results, preemptions


@pytest.mark.parametrize("async_batching", [True, False], ids=["async", "sync"])
def test_deterministic_mode_gives_the_bits_of_the_request_alone(async_batching):
    results, _ = target_in_batches(True, async_batching)
    assert all(r == results[0] for r in results[1:])


def test_deterministic_prompt_logprobs_keep_their_bits_in_batches():
    """Prompt logprobs take the batch-invariant LM head, not the fused kernel whose vocabulary
    splits follow the step's rows."""
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=2, prompt_logprobs=1)
    results, _ = target_in_batches(True, True, params=params)
    assert results[0][2] is not None and len(results[0][2]) > 8
    assert all(r == results[0] for r in results[1:])


def test_deterministic_mode_keeps_the_bits_through_forced_preemption():
    alone, _ = target_in_batches(True, True)
    # 96 blocks of 16 tokens for up to 101 requests of ~200 tokens: preemption throughout
    squeezed, preemptions = target_in_batches(True, True, num_blocks=96)
    assert preemptions > 0
    assert squeezed == alone


def test_deterministic_sync_equals_async():
    assert target_in_batches(True, True)[0] == target_in_batches(True, False)[0]


def test_the_default_mode_differs_across_batches():
    """Not a requirement, the reason for the mode: batch-size-dependent GEMM and attention
    choices change the target's logprobs' low bits (and so, sooner or later, a token)."""
    results, _ = target_in_batches(False, True)
    assert any(r != results[0] for r in results[1:])
