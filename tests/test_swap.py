"""Preemption by swap (swap.py): swapped requests get exactly the tokens of a run where
everything fits; the host pool, its reference counts and shared blocks stay accounted."""

from __future__ import annotations

import re

import numpy as np
import pytest

from tandem import swap as swap_module
from tandem.config import EngineConfig, ModelConfig
from tandem.engine import Engine
from tandem.llm import LLM
from tandem.request import Status
from tandem.sampling import SamplingParams
from tandem.swap import (
    PCIE_BYTES_PER_S,
    RECOMPUTE_FLOPS_PER_S,
    SwapManager,
    _runs,
    recompute_flops,
)

# 12 blocks of 4 tokens: three 40-token sequences cannot all fit, so the newest is preempted
TIGHT = {"device": "cpu", "dtype": "float32", "block_size": 4, "num_blocks": 12}
ROOMY = {"device": "cpu", "dtype": "float32", "block_size": 4, "num_blocks": 64}
PROMPTS = [list(range(10 + 9 * i, 22 + 9 * i)) for i in range(3)]  # 12 tokens each


def generate(folder, engine_args: dict, params: SamplingParams, prompts=PROMPTS):
    llm = LLM(folder, max_model_len=48, **engine_args)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    engine = llm.engine
    assert not engine.has_unfinished() and not engine.scheduler.swapped
    assert engine.allocator.num_free == engine.num_blocks
    swap = engine.scheduler.swap
    assert swap.host.num_free == swap.host.num_blocks and not swap.host.ref_counts.any()
    assert not swap.host_of and not swap.device_of
    tokens = [[c.token_ids for c in out.outputs] for out in outs]
    return tokens, engine


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded"])
def test_forced_swapping_gives_the_tokens_of_a_run_with_room_for_everything(make_tiny, temperature):
    folder = str(make_tiny("llama"))
    params = SamplingParams(temperature=temperature, seed=7, max_tokens=16, ignore_eos=True)
    expected, _ = generate(folder, ROOMY, params)
    for async_batching in (False, True):
        args = {**TIGHT, "async_batching": async_batching, "preemption_mode": "swap"}
        swapped, engine = generate(folder, args, params)
        assert engine.scheduler.swap.num_swapped_out > 0, "nothing was swapped: the test is void"
        assert engine.swapper.bytes_out > 0 and engine.swapper.bytes_in > 0
        assert swapped == expected, f"async_batching={async_batching}"


def test_an_fp8_cache_swaps_its_bytes_and_gives_the_tokens_of_a_roomy_run(make_tiny):
    """The FP8 cache's blocks go out and back as bytes (torch indexes no float8 tensor on the
    CPU: swapping in raised)."""
    folder = str(make_tiny("llama"))
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    fp8 = {"kv_cache_dtype": "fp8"}
    expected, _ = generate(folder, {**ROOMY, **fp8}, params)
    swapped, engine = generate(folder, {**TIGHT, **fp8, "preemption_mode": "swap"}, params)
    assert engine.scheduler.swap.num_swapped_out > 0, "nothing was swapped: the test is void"
    assert swapped == expected


def test_n_samples_share_their_prompt_blocks_on_the_host_and_match_a_roomy_run(make_tiny):
    folder = str(make_tiny("llama"))
    # an older neighbour, then a 20-token prompt: 4 full blocks its 3 samples share, 4 own
    # blocks each; the newest samples are the victims
    prompts = [{"prompt_token_ids": PROMPTS[0]}, {"prompt_token_ids": list(range(30, 50))}]
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True),
    ]
    roomy = LLM(folder, max_model_len=48, **ROOMY).generate(prompts, params, use_tqdm=False)
    llm = LLM(folder, max_model_len=48, preemption_mode="swap", **{**TIGHT, "num_blocks": 16})
    engine = llm.engine
    swap = engine.scheduler.swap
    most_owners = []
    swap_out = swap.swap_out

    def watched(request):
        swap_out(request)
        most_owners.append(int(swap.host.ref_counts[request.host_blocks].max()))

    swap.swap_out = watched
    outs = llm.generate(prompts, params, use_tqdm=False)
    tokens = [[c.token_ids for c in out.outputs] for out in outs]
    assert tokens == [[c.token_ids for c in out.outputs] for out in roomy]
    assert swap.num_swapped_out > 0
    assert max(most_owners) > 1, "no host block was shared between samples"
    assert not swap.host.ref_counts.any() and not swap.host_of and not swap.device_of
    assert engine.allocator.num_free == engine.num_blocks


@pytest.mark.parametrize("async_batching", [False, True], ids=["sync", "async"])
def test_aborting_a_swapped_request_frees_its_host_blocks_and_others_finish_unharmed(
    make_tiny, async_batching
):
    folder = str(make_tiny("llama"))
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    expected, _ = generate(folder, {**ROOMY, "async_batching": async_batching}, params)
    engine = Engine(
        EngineConfig(
            folder,
            max_model_len=48,
            preemption_mode="swap",
            async_batching=async_batching,
            **TIGHT,
        )
    )
    requests = []
    for i, prompt in enumerate(PROMPTS):
        requests.append(engine.make_request(str(i), params, prompt_token_ids=prompt))
        engine.enqueue(requests[-1])
    aborted = None
    while engine.has_unfinished():
        engine.step()
        if aborted is None and engine.scheduler.swapped:
            aborted = engine.scheduler.swapped[0]
            engine.abort(aborted.request_id)
            assert aborted.finished and not aborted.host_blocks
    assert aborted is not None, "nothing was swapped"
    swap = engine.scheduler.swap
    assert not swap.host.ref_counts.any() and swap.host.num_free == swap.host.num_blocks
    assert engine.allocator.num_free == engine.num_blocks
    for request, tokens in zip(requests, expected, strict=True):
        if request is not aborted:
            assert [request.output_token_ids] == tokens


def test_a_full_swap_space_falls_back_to_recompute(make_tiny):
    folder = str(make_tiny("llama"))
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    expected, _ = generate(folder, ROOMY, params)
    # room on the host for a few blocks only: most victims must recompute
    tokens, engine = generate(
        folder, {**TIGHT, "preemption_mode": "swap", "swap_space": 3 * 2048 / 2**30}, params
    )
    assert engine.scheduler.swap.host.num_blocks < 10
    assert tokens == expected


@pytest.mark.parametrize(
    "penalty",
    [{"repetition_penalty": 1.8}, {"frequency_penalty": 1.5, "temperature": 1.0, "seed": 7}],
    ids=["repetition", "frequency"],
)
def test_victims_with_penalties_recompute_so_their_counts_are_fed_again(make_tiny, penalty):
    """A penalized request counts its tokens on the device as the steps feed them
    (penalties.py): swapped, it would resume with its state reset and its tokens never fed
    again. Under preemption_mode="swap" it recomputes instead, and gets the roomy run's tokens."""
    folder = str(make_tiny("llama"))
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": 16, "ignore_eos": True, **penalty})
    expected, _ = generate(folder, ROOMY, params)
    for async_batching in (False, True):
        args = {**TIGHT, "async_batching": async_batching, "preemption_mode": "swap"}
        tokens, engine = generate(folder, args, params)
        assert engine.scheduler.num_preemptions > 0, "nothing was preempted: the test is void"
        assert engine.scheduler.swap.num_swapped_out == 0
        assert tokens == expected, f"async_batching={async_batching}"


def test_swap_space_beyond_host_memory_is_a_start_up_error_naming_the_number(
    make_tiny, monkeypatch
):
    for space in (1000000, 1e308):  # 1e308 GiB: no int of bytes either
        with pytest.raises(
            ValueError, match=rf"swap_space={re.escape(str(space))} GiB is more than this host's"
        ):
            Engine(
                EngineConfig(str(make_tiny("llama")), max_model_len=48, swap_space=space, **TIGHT)
            )
    # the pool is capped at every sequence's blocks; that much must fit too
    monkeypatch.setattr(swap_module, "host_memory_available", lambda: 1024)
    with pytest.raises(ValueError, match=r"swap_space=0.5 GiB .* 0.00 GiB of host memory"):
        Engine(EngineConfig(str(make_tiny("llama")), max_model_len=48, swap_space=0.5, **TIGHT))
    Engine(EngineConfig(str(make_tiny("llama")), max_model_len=48, preemption_mode="recompute",
                        swap_space=0.5, **TIGHT))  # fmt: skip
    for bad in (-1, "4", True):
        with pytest.raises(ValueError, match="swap_space"):
            EngineConfig("x", swap_space=bad).validate()
    with pytest.raises(ValueError, match="preemption_mode"):
        EngineConfig("x", preemption_mode="offload").validate()


def llama_8b() -> ModelConfig:
    return ModelConfig(
        "LlamaForCausalLM", 128256, 4096, 14336, 32, 32, 8, 128, 1e-5, 5e5, None, 8192,
        False, False, False, False, "bfloat16", (),
    )  # fmt: skip


def test_auto_swaps_a_long_victim_by_the_stated_rates_and_recomputes_when_cheaper():
    cfg = llama_8b()
    per_block = 2 * 32 * 16 * 8 * 128 * 2  # bf16, 16-token blocks: 2 MiB
    from tandem.kv_cache import BlockAllocator
    from tandem.request import Request

    allocator = BlockAllocator(1024)
    swap = SwapManager(allocator, 1024, "auto", per_block, cfg)
    request = Request("r", [1] * 4096, SamplingParams(), 0)
    request.block_table = allocator.allocate(256)
    request.num_computed_tokens = 4096
    swap_s = 2 * 256 * per_block / PCIE_BYTES_PER_S
    recompute_s = recompute_flops(cfg, 4096) / RECOMPUTE_FLOPS_PER_S
    assert swap_s < recompute_s and swap.should_swap(request)
    # the same bytes with a slow enough link: recompute wins
    swap.bytes_per_block = int(per_block * 2 * recompute_s / swap_s)
    assert not swap.should_swap(request)
    # a direct formula: 2 FLOPs per weight per token plus the causal attention pairs
    assert recompute_flops(cfg, 10) == 2 * cfg.num_params() * 10 + 2 * 32 * 4096 * 100


def test_runs_of_consecutive_host_blocks():
    assert _runs([4, 5, 6, 9, 2, 3]) == [(0, 3, 4), (3, 1, 9), (4, 2, 2)]
    assert _runs([]) == []


def test_swapped_requests_hold_only_host_blocks_and_the_trace_counts_the_bytes(make_tiny):
    from tandem.trace import summarize

    engine = Engine(
        EngineConfig(str(make_tiny("llama")), max_model_len=48, preemption_mode="swap", **TIGHT)
    )
    engine.start_trace()
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.enqueue(engine.make_request(str(i), params, prompt_token_ids=prompt))
    swap, seen = engine.scheduler.swap, set()
    while engine.has_unfinished():
        engine.step()
        held = np.zeros(swap.host.num_blocks, dtype=np.int32)
        for request in engine.scheduler.swapped:
            assert request.status is Status.SWAPPED and not request.block_table
            assert len(request.host_blocks) == -(-request.num_computed_tokens // 4)
            held[request.host_blocks] += 1
            seen.add(request.request_id)
        assert (swap.host.ref_counts == held).all()
    assert seen
    summary = summarize(engine.stop_trace().to_chrome_trace({}))["swap"]
    assert summary["batches"] > 0 and summary["bytes_out"] == engine.swapper.bytes_out > 0
    assert summary["bytes_in"] == engine.swapper.bytes_in > 0
    # every block swapped out came back in (none finished or was aborted while swapped)
    assert summary["bytes_out"] == summary["bytes_in"]
    assert summary["bytes_out"] % swap.bytes_per_block == 0
