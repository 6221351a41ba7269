"""transformers' own continuous batching on the same weights and requests, for `--compare transformers`.

It runs through `continuous_batching_context_manager`, the manager that `generate_batch` wraps,
because `generate_batch` takes one `max_new_tokens` for every prompt and times its own set-up
(cache allocation, CUDA-graph warm-up, thread start); here set-up and a warm-up workload stay
outside the timed runs, and each request gets its own output length.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from tandem.bench import Run, request_latencies, waves
from tandem.config import cdiv
from tandem.model.loader import DUMMY_SEED_SALT
from tandem.workload import Workload

HF_BLOCK_SIZE = 256  # transformers' default, its best setting
HF_SAFETY_MARGIN_PCT = 15  # its FIFO scheduler's default safety margin


def best_attention(device: torch.device) -> str:
    """The fastest paged attention transformers can run here without downloading kernels."""
    from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available

    if device.type == "cuda" and is_flash_attn_3_available():
        return "paged|flash_attention_3"
    if device.type == "cuda" and is_flash_attn_2_available():
        return "paged|flash_attention_2"
    return "paged|sdpa"


def build_hf_model(
    hf_config: dict,
    folder: Path | None,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    attention: str,
):
    """The checkpoint in `folder`, or for a preset the same dummy weights tandem made from `seed`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if folder is not None:
        model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=dtype, attn_implementation=attention
        )
        return model.to(device).eval()
    from tandem.model.tiny import random_weights

    fields = {k: v for k, v in hf_config.items() if k != "model_type"}
    config = AutoConfig.for_model(hf_config["model_type"], **fields)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention)
    weights = dict(
        random_weights(hf_config, seed=seed ^ DUMMY_SEED_SALT, dtype=dtype, device=device)
    )
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model.eval()


def run_transformers(
    model,
    workload: Workload,
    warmup: Workload,
    *,
    async_batching: bool,
    temperature: float,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    batch_size: int | None,
    record_tokens: bool,
    repeats: int,
    seed: int,
) -> tuple[list[Run], dict]:
    """Timed runs of `workload` (after one of `warmup`) and the resolved ContinuousBatchingConfig."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    generation = GenerationConfig(
        do_sample=temperature > 0,
        temperature=temperature if temperature > 0 else None,
        top_k=0,
        top_p=1.0,
        eos_token_id=-1,  # ignore_eos, as in tandem's runs
    )
    max_len = max(workload.max_len, warmup.max_len)
    in_flight = min(max_num_seqs, len(workload.prompts))
    # Sized from the workload, not from free memory: with a masked attention (paged|sdpa) each
    # step builds a [max_batch_tokens, cache tokens + max_batch_tokens] mask, and its async mode
    # copies that mask from pinned host memory every step, so a cache filling the GPU costs it
    # gigabytes of copies per step. What the requests in flight need, grown past its FIFO
    # scheduler's safety margin (no new prefill while under 15% of blocks are free) plus a spare
    # block each, keeps it from holding back a prompt tandem would admit; all prompts in flight
    # still fit in one step's token budget.
    needed = in_flight * cdiv(max_len, HF_BLOCK_SIZE)
    num_blocks = cdiv(needed * 100, 100 - HF_SAFETY_MARGIN_PCT) + in_flight
    prompt_tokens = sorted(map(len, workload.prompts), reverse=True)[:in_flight]
    cb_config = ContinuousBatchingConfig(
        use_async_batching=async_batching,
        max_requests_per_batch=max_num_seqs,
        max_batch_tokens=min(max_num_batched_tokens, max(sum(prompt_tokens), 1)),
        num_blocks=num_blocks,
        block_size=HF_BLOCK_SIZE,
        allow_block_sharing=False,  # tandem has no prefix caching: both do the same work
        seed=seed,
    )
    hints = WorkloadHints(
        max_prompt_length=max(map(len, workload.prompts)),
        max_generated_length=max(workload.output_lens),
        num_requests=len(workload.prompts),
    )
    with model.continuous_batching_context_manager(
        generation_config=generation,
        continuous_batching_config=cb_config,
        workload_hints=hints,
        block=True,
        timeout=30,
    ) as manager:
        time_manager(manager, warmup, None, record_tokens=False)
        runs = [time_manager(manager, workload, batch_size, record_tokens) for _ in range(repeats)]
        resolved = {
            k: str(v) if not isinstance(v, bool | int | float | str | type(None)) else v
            for k, v in vars(manager.continuous_batching_config).items()
        }
    resolved["attn_implementation"] = model.config._attn_implementation
    return runs, resolved


def time_manager(manager, workload: Workload, batch_size: int | None, record_tokens: bool) -> Run:
    """Submit `workload` in waves of `batch_size` (all at once for None); wait for every token.

    With `record_tokens`, per-token times are transformers' own stamps (`record_timestamps`).
    """
    steps_before = getattr(manager, "current_batch", 0)  # counted by the generation thread
    arrivals: list[float] = [0.0] * len(workload.prompts)
    token_times: list[list[float]] = [[] for _ in workload.prompts]
    start = time.perf_counter()
    for wave in waves(len(workload.prompts), batch_size):
        index_of = {}
        for i in wave:
            arrivals[i] = time.perf_counter()
            request_id = manager.add_request(
                workload.prompts[i],
                max_new_tokens=workload.output_lens[i],
                record_timestamps=record_tokens,
            )
            index_of[request_id] = i
        while index_of:
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' generation thread stopped; see its log above")
                continue
            if not result.is_finished():
                continue
            if result.error is not None:
                raise RuntimeError(
                    f"transformers failed request {result.request_id}: {result.error}"
                )
            i = index_of.pop(result.request_id)
            if len(result.generated_tokens) != workload.output_lens[i]:
                raise RuntimeError(
                    f"transformers made {len(result.generated_tokens)} tokens for request "
                    f"{result.request_id}, {workload.output_lens[i]} were asked for"
                )
            token_times[i] = result.timestamps
    seconds = time.perf_counter() - start
    steps = getattr(manager, "current_batch", 0) - steps_before
    latencies = request_latencies(arrivals, token_times) if record_tokens else None
    return Run(seconds, steps, latencies, list(workload.output_lens))  # every length checked
