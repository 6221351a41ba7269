"""Prefix caching, copy on write and the shared-prefix decode on CUDA: graphs, async, the
stream sanitizer."""

from __future__ import annotations

import textwrap

import pytest
import torch

from tandem import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def shared_prompts(vocab: int) -> list[dict]:
    """Two system prompts of 70 and 45 tokens, each under four questions."""
    g = torch.Generator().manual_seed(4)
    systems = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (70, 45)]
    return [
        {"prompt_token_ids": s + torch.randint(0, vocab, (5 + 3 * i,), generator=g).tolist()}
        for s in systems
        for i in range(4)
    ]


def run(
    folder, caching: bool, backend: str, prompts=shared_prompts, repeat: bool = False, **engine_args
) -> tuple[list[list[list[int]]], LLM]:
    """(each prompt's samples' tokens, the LLM) for the prompts `prompts(vocab)` makes, n=3 seeded
    samples each; with `repeat`, the same prompts again once the cache holds them."""
    llm = LLM(
        str(folder),
        dtype="float32",
        max_model_len=256,
        num_blocks=256,
        enable_prefix_caching=caching,
        attention_backend=backend,
        **engine_args,
    )
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=40, ignore_eos=True)
    prompts = prompts(llm.engine.model_config.vocab_size)
    outs = llm.generate(prompts, params, use_tqdm=False)
    if repeat:
        outs += llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.allocator.num_free == llm.engine.num_blocks
    return [[c.token_ids for c in o.outputs] for o in outs], llm


@pytest.mark.parametrize("async_batching", [False, True], ids=["sync", "async"])
def test_cached_shared_decode_in_graphs_samples_what_the_reference_attention_does(
    make_tiny, async_batching
):
    # the same Triton kernels without the cache: tl.dot rounds float32 inputs to TF32 on CUDA,
    # so the torch attention would differ by more than the order of the sums does
    folder = make_tiny("llama")
    reference, _ = run(folder, False, "triton", cuda_graphs=False)
    assert run(folder, True, "triton", async_batching=async_batching)[0] == reference


def aligned_prompts(vocab: int) -> list[dict]:
    """Prompts of whole 16-token blocks (64 and 48 tokens), each twice: the repeat and the
    other samples copy their last block on write."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (64, 48)]
    return [{"prompt_token_ids": p} for p in prompts for _ in range(2)]


@pytest.mark.parametrize("async_batching", [False, True], ids=["sync", "async"])
def test_samples_copied_on_write_in_graphs_sample_what_an_uncached_run_does(
    make_tiny, async_batching
):
    folder = make_tiny("llama")
    # and again once the cache holds every block: each prompt's first sample copies too
    reference, _ = run(folder, False, "triton", aligned_prompts, repeat=True, cuda_graphs=False)
    got, llm = run(
        folder, True, "triton", aligned_prompts, repeat=True, async_batching=async_batching
    )
    assert got == reference
    # per call: 2 prompts x 2 repeats x 3 samples, all but the first of each prompt copied,
    # then all 12 in the second call
    assert llm.engine.scheduler.num_block_copies == 2 * 5 + 12


def test_copy_on_write_steps_block_only_on_the_d2h_event(make_tiny, counted_waits):
    llm = LLM(str(make_tiny("llama")), max_model_len=256, num_blocks=64)
    waits = counted_waits
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=16, ignore_eos=True)
    torch.cuda.set_sync_debug_mode("error")
    try:
        llm.generate(aligned_prompts(llm.engine.model_config.vocab_size), params, use_tqdm=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert llm.engine.scheduler.num_block_copies > 0
    assert sorted(waits) == list(range(llm.engine.num_steps))


SANITIZED_RUN = textwrap.dedent(
    """
    import sys
    from tandem import LLM, SamplingParams
    from tandem.model.tiny import make_tiny_model
    folder = make_tiny_model(sys.argv[1], "llama")
    head = list(range(5, 45))
    for graphs in (False, True):
        llm = LLM(str(folder), max_model_len=128, max_num_batched_tokens=32, num_blocks=24,
                  cuda_graphs=graphs)
        prompts = [{"prompt_token_ids": head + list(range(100 + 7 * i, 110 + 7 * i))}
                   for i in range(6)]
        # and two of whole blocks (48 tokens): their samples copy the last block on write
        prompts += [{"prompt_token_ids": head + list(range(300, 308))}] * 2
        params = SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=24, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.scheduler.cache.num_hit_tokens > 0
        assert llm.engine.scheduler.num_block_copies > 0
        print("ok", graphs, sum(len(c.token_ids) for o in outs for c in o.outputs))
    """
)


def test_cached_shared_decode_is_clean_under_the_stream_sanitizer(run_sanitized):
    assert run_sanitized(SANITIZED_RUN).count("ok") == 2
