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


def first_token_logprobs(model: str, tensor_parallel_size: int) -> list[dict[int, float]]:
    llm = LLM(model, load_format="dummy", max_model_len=512, max_num_seqs=8, gpu_memory_utilization=0.5,
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


def test_two_gpus_match_one_on_a_llama_3_8b_shape_within_bf16_tolerance():
    one, two = first_token_logprobs("llama-3-8b", 1), first_token_logprobs("llama-3-8b", 2)
    for a, b in zip(one, two, strict=True):
        for token in a.keys() & b.keys():
            assert abs(a[token] - b[token]) < 0.1


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
