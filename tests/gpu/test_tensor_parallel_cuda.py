"""Tensor parallelism over NCCL on 2 GPUs (run on a machine with two or more)."""

from __future__ import annotations

import gc

import pytest
import torch

from tandem import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]


def first_token_logprobs(
    model: str, tensor_parallel_size: int, dtype: str
) -> list[dict[int, float]]:
    # float32 runs use the torch reference attention: the reference model of the bf16 test
    backend = "torch" if dtype == "float32" else "triton"
    llm = LLM(model, load_format="dummy", dtype=dtype, attention_backend=backend, max_model_len=512,
              max_num_seqs=8, gpu_memory_utilization=0.5,
              tensor_parallel_size=tensor_parallel_size)  # fmt: skip
    prompts = [{"prompt_token_ids": list(range(100 + 37 * i, 228 + 37 * i))} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    try:
        return [o.outputs[0].logprobs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.engine.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def llama_3_8b_logprobs() -> dict[tuple[str, int], list[dict[int, float]]]:
    """First-token top-5 logprobs of the same dummy Llama-3-8B, per (dtype, ranks)."""
    return {
        (dtype, tp): first_token_logprobs("llama-3-8b", tp, dtype)
        for dtype in ("float32", "bfloat16")
        for tp in (1, 2)
    }


def largest_difference(a: list[dict[int, float]], b: list[dict[int, float]]) -> float:
    """Over the prompts, the largest |logprob difference| of a token both top-5s hold."""
    gaps = [abs(x[t] - y[t]) for x, y in zip(a, b, strict=True) for t in x.keys() & y.keys()]
    assert len(gaps) >= 3 * len(a)  # most of the top-5 agree, or the comparison says little
    return max(gaps)


def test_two_gpus_give_the_float32_logprobs_of_one_on_a_llama_3_8b_shape(llama_3_8b_logprobs):
    one, two = llama_3_8b_logprobs["float32", 1], llama_3_8b_logprobs["float32", 2]
    assert [max(x, key=x.get) for x in two] == [max(x, key=x.get) for x in one]
    # the only differences are fp32 summation orders (sharded GEMMs, the all-reduce)
    assert largest_difference(one, two) < 5e-3


def test_two_gpus_stay_within_bf16_rounding_on_a_llama_3_8b_shape(llama_3_8b_logprobs):
    # bf16 rounds every partial sum, and TP=2 adds one more rounding per all-reduce: the two
    # ranks may differ from one by as much as one differs from the float32 model, not more
    reference = llama_3_8b_logprobs["float32", 1]
    one_error = largest_difference(llama_3_8b_logprobs["bfloat16", 1], reference)
    two_error = largest_difference(llama_3_8b_logprobs["bfloat16", 2], reference)
    print(
        f"bf16 vs float32, largest logprob difference: TP=1 {one_error:.4f}, TP=2 {two_error:.4f}"
    )
    assert two_error < 2 * one_error + 0.01


@pytest.mark.skipif(
    torch.cuda.device_count() < 2 or torch.cuda.get_device_properties(0).total_memory < 120e9,
    reason="a 70B shape in bf16 needs two GPUs of over 120 GB",
)
def test_a_llama_3_70b_shape_runs_on_two_gpus():
    llm = LLM(
        "llama-3-70b",
        load_format="dummy",
        max_model_len=1024,
        max_num_seqs=16,
        tensor_parallel_size=2,
    )
    try:
        outputs = llm.generate(
            [{"prompt_token_ids": list(range(1, 129))}] * 4,
            SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True, seed=0),
            use_tqdm=False,
        )
        assert all(len(o.outputs[0].token_ids) == 32 for o in outputs)
    finally:
        llm.engine.shutdown()


def test_a_rank_killed_while_starting_raises_on_two_gpus_within_seconds(kill_rank_1_at_start):
    """The NCCL start-up: rank 0 waits at the rendezvous while it checks the other rank, so a
    rank that dies before it joins raises instead of leaving rank 0 waiting forever."""
    import time

    from tandem.workers import RankExited

    start = time.monotonic()
    with pytest.raises(RankExited, match="rank 1 exited"):
        LLM("qwen3-0.6b", load_format="dummy", max_model_len=256, max_num_seqs=4,
            gpu_memory_utilization=0.3, tensor_parallel_size=2)  # fmt: skip
    assert time.monotonic() - start < 60
