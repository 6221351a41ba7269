"""Preemption by swap on CUDA: the swap stream's copies are ordered by events (the stream
sanitizer sees no unsynchronized access), no host wait enters the step loop, and forced
swapping gives the tokens of a run with room for everything."""

from __future__ import annotations

import textwrap

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.runner import Runner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPTS = [{"prompt_token_ids": list(range(3 + 7 * i, 20 + 9 * i))} for i in range(6)]


def generate(folder, num_blocks: int, async_batching: bool = True, **engine_args):
    llm = LLM(
        str(folder),
        dtype="float32",
        max_model_len=128,
        max_num_batched_tokens=16,
        num_blocks=num_blocks,
        async_batching=async_batching,
        **engine_args,
    )
    params = [
        SamplingParams(temperature=t, max_tokens=24, ignore_eos=True, seed=i)
        for i, t in enumerate([0.0, 1.0] * 3)
    ]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    engine = llm.engine
    assert engine.allocator.num_free == engine.num_blocks
    assert not engine.scheduler.swap.host.ref_counts.any()
    return [o.outputs[0].token_ids for o in outs], engine


@pytest.mark.parametrize("async_batching", [False, True], ids=["sync", "async"])
def test_forced_swapping_on_cuda_gives_the_tokens_of_a_roomy_run(make_tiny, async_batching):
    """The same steps in both runs are not guaranteed (batches differ), so this compares in
    float32 with the torch attention, where a row's logits do not depend on its neighbours'."""
    folder = make_tiny("llama")
    expected, _ = generate(folder, 256, async_batching, attention_backend="torch")
    tokens, engine = generate(
        folder, 12, async_batching, attention_backend="torch", preemption_mode="swap"
    )
    assert engine.scheduler.swap.num_swapped_out > 0
    assert engine.swapper.bytes_out > 0 and engine.swapper.bytes_in > 0
    assert tokens == expected


def test_an_fp8_cache_swaps_its_bytes_on_cuda_and_gives_the_tokens_of_a_roomy_run(make_tiny):
    """The swap copies an FP8 cache's blocks through byte views (``swap.raw``); the CUDA copy
    path must move exactly the bytes the roomy FP8 run keeps on the device."""
    folder = make_tiny("llama")
    fp8 = {"attention_backend": "torch", "kv_cache_dtype": "fp8"}
    expected, _ = generate(folder, 256, **fp8)
    tokens, engine = generate(folder, 12, preemption_mode="swap", **fp8)
    assert engine.scheduler.swap.num_swapped_out > 0
    assert engine.swapper.bytes_in > 0
    assert tokens == expected


def test_swapping_adds_no_host_wait_to_the_step_loop(make_tiny, monkeypatch):
    """Sync debug mode "error" raises on any synchronizing call; only Runner.wait may block."""
    original_wait = Runner.wait

    def lifted_wait(self, batch, check=None):
        torch.cuda.set_sync_debug_mode("default")
        try:
            return original_wait(self, batch, check)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    monkeypatch.setattr(Runner, "wait", lifted_wait)
    llm = LLM(str(make_tiny("llama")), max_model_len=128, max_num_batched_tokens=16,
              num_blocks=12, preemption_mode="swap")  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    torch.cuda.set_sync_debug_mode("error")
    try:
        llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert llm.engine.scheduler.swap.num_swapped_out > 0


def test_swap_copies_show_on_their_own_lane_with_their_bytes(make_tiny):
    from tandem.trace import summarize

    llm = LLM(str(make_tiny("llama")), max_model_len=128, max_num_batched_tokens=16,
              num_blocks=12, preemption_mode="swap")  # fmt: skip
    llm.engine.start_trace()
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                 use_tqdm=False)  # fmt: skip
    trace = llm.engine.stop_trace().to_chrome_trace({})
    swap = summarize(trace)["swap"]
    assert swap["batches"] > 0 and swap["gpu_ms"] > 0
    assert swap["bytes_out"] + swap["bytes_in"] == (
        llm.engine.swapper.bytes_out + llm.engine.swapper.bytes_in
    )


SANITIZED_SWAP_RUN = textwrap.dedent(
    """
    import sys
    from tandem import LLM, SamplingParams
    from tandem.model.tiny import make_tiny_model
    folder = make_tiny_model(sys.argv[1], "llama")
    prompts = [{"prompt_token_ids": list(range(3 + 7 * i, 20 + 9 * i))} for i in range(6)]
    for graphs in (False, True):
        for n in (1, 3):
            llm = LLM(str(folder), max_model_len=128, max_num_batched_tokens=16, num_blocks=12,
                      cuda_graphs=graphs, preemption_mode="swap", swap_space=0.01)
            params = SamplingParams(n=n, temperature=1.0, max_tokens=24, ignore_eos=True, seed=1)
            outs = llm.generate(prompts[: 6 // n], params, use_tqdm=False)
            assert llm.engine.scheduler.swap.num_swapped_out > 0
            assert not llm.engine.scheduler.swap.host.ref_counts.any()
            print("ok", graphs, n, sum(len(c.token_ids) for o in outs for c in o.outputs))
    """
)


def test_async_loop_with_forced_swapping_is_clean_under_the_stream_sanitizer(run_sanitized):
    assert run_sanitized(SANITIZED_SWAP_RUN).count("ok") == 4
