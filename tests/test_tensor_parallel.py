"""Tensor parallelism over gloo on the CPU: 2 processes give the tokens of 1."""

from __future__ import annotations

import pytest
import torch

from tandem import LLM, SamplingParams

PROMPTS = [{"prompt_token_ids": list(range(3 + 7 * i, 20 + 9 * i))} for i in range(5)]
MAX_TOKENS = [14, 6, 20, 9, 16]


def run(
    folder, tensor_parallel_size: int, temperature: float = 0.0, **engine_args
) -> list[list[int]]:
    llm = LLM(str(folder), max_model_len=96, num_blocks=12, block_size=8, max_num_batched_tokens=24,
              tensor_parallel_size=tensor_parallel_size, **engine_args)  # fmt: skip
    params = [
        SamplingParams(temperature=temperature, top_p=0.9, max_tokens=n, ignore_eos=True, seed=i)
        for i, n in enumerate(MAX_TOKENS)
    ]
    try:
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0  # 96 token slots for ~190 tokens
        assert llm.engine.allocator.num_free == llm.engine.num_blocks
    finally:
        llm.engine.shutdown()
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize(
    "arch", ["llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "phi4_mini", "glm4"]
)
def test_two_ranks_give_the_greedy_tokens_of_one_with_chunking_and_preemption(make_tiny, arch):
    # mistral's single KV head is replicated on both ranks; the others split their KV heads;
    # the MoE experts (and qwen2_moe's shared expert) are split as the dense MLPs are
    assert run(make_tiny(arch), 2) == run(make_tiny(arch), 1)


def test_two_ranks_in_sync_mode_give_the_tokens_of_one(make_tiny):
    assert run(make_tiny("llama"), 2, async_batching=False) == run(make_tiny("llama"), 1)


def test_two_ranks_draw_the_seeded_samples_of_one(make_tiny):
    assert run(make_tiny("qwen3"), 2, temperature=0.8) == run(
        make_tiny("qwen3"), 1, temperature=0.8
    )


def test_ranks_each_hold_their_shard_of_the_weights(make_tiny):
    from tandem.config import ModelConfig
    from tandem.model.loader import build_model, read_hf_config
    from tandem.parallel import TensorParallel

    hf_config, folder = read_hf_config(str(make_tiny("llama")))
    cfg = ModelConfig.from_hf(hf_config)
    full = build_model(
        cfg, hf_config, folder, "auto", torch.float32, torch.device("cpu"), 64, 0, TensorParallel()
    )
    for rank in range(2):
        shard = build_model(cfg, hf_config, folder, "auto", torch.float32, torch.device("cpu"), 64, 0,
                            TensorParallel(rank, 2))  # fmt: skip
        attn, whole = shard.layers[0].self_attn, full.layers[0].self_attn
        q_rows = cfg.q_size // 2
        assert torch.equal(
            attn.qkv_proj.weight[:q_rows],
            whole.qkv_proj.weight[rank * q_rows : (rank + 1) * q_rows],
        )
        o_cols = whole.o_proj.weight[:, rank * q_rows : (rank + 1) * q_rows]
        assert torch.equal(attn.o_proj.weight, o_cols)
        vocab_rows = -(-cfg.vocab_size // 2)
        assert torch.equal(
            shard.embed_tokens.weight,
            full.embed_tokens.weight[rank * vocab_rows : (rank + 1) * vocab_rows],
        )


def test_ranks_each_hold_their_slice_of_every_expert(make_tiny):
    from tandem.config import ModelConfig
    from tandem.model.loader import build_model, read_hf_config
    from tandem.parallel import TensorParallel

    hf_config, folder = read_hf_config(str(make_tiny("qwen3_moe")))
    cfg = ModelConfig.from_hf(hf_config)
    inter, half = cfg.moe_intermediate_size, cfg.moe_intermediate_size // 2
    args = (cfg, hf_config, folder, "auto", torch.float32, torch.device("cpu"), 64, 0)
    whole = build_model(*args, TensorParallel()).layers[0].mlp
    for rank in range(2):
        shard = build_model(*args, TensorParallel(rank, 2)).layers[0].mlp
        mine = slice(rank * half, (rank + 1) * half)
        gate_up = whole.experts.gate_up_proj
        expected = torch.cat([gate_up[:, :inter][:, mine], gate_up[:, inter:][:, mine]], dim=1)
        assert torch.equal(shard.experts.gate_up_proj, expected)
        assert torch.equal(shard.experts.down_proj, whole.experts.down_proj[:, :, mine])
        assert torch.equal(shard.gate.weight, whole.gate.weight)  # the router is replicated


def test_a_size_that_does_not_divide_the_heads_is_rejected(make_tiny):
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        LLM(str(make_tiny("llama")), tensor_parallel_size=3)


def test_the_streaming_api_drives_two_ranks(make_tiny):
    import asyncio

    from tandem.async_llm import AsyncLLM

    expected = run(make_tiny("qwen2"), 1)
    llm = AsyncLLM.from_model(str(make_tiny("qwen2")), max_model_len=96, num_blocks=12, block_size=8,
                              max_num_batched_tokens=24, tensor_parallel_size=2)  # fmt: skip

    async def one(i: int) -> list[int]:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS[i], ignore_eos=True)
        outputs = [out async for out in llm.generate(PROMPTS[i], params, f"r{i}")]
        return outputs[-1].outputs[0].token_ids

    async def all_requests() -> list[list[int]]:
        return await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))

    try:
        assert asyncio.run(all_requests()) == expected
    finally:
        llm.shutdown()


def test_a_rank_that_died_is_named_and_the_engine_still_shuts_down(make_tiny):
    import os
    import signal

    from tandem.workers import RankExited

    folder = make_tiny("llama")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm = LLM(str(folder), max_model_len=96, num_blocks=12, block_size=8, tensor_parallel_size=2)
    try:
        assert llm.get_world_size() == llm.get_world_size(include_dp=False) == 2  # vLLM's
        expected = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0].token_ids
        worker = llm.engine.workers.processes[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join()
        with pytest.raises(RankExited, match="rank 1 exited"):
            llm.generate(PROMPTS[:1], params, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    # the process group was left: a new engine forms one again
    llm = LLM(str(folder), max_model_len=96, num_blocks=12, block_size=8, tensor_parallel_size=2)
    try:
        assert llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0].token_ids == expected
    finally:
        llm.engine.shutdown()


def test_a_second_shutdown_does_nothing_and_a_shut_engine_refuses_to_step(make_tiny):
    folder = make_tiny("llama")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    old = LLM(str(folder), max_model_len=96, num_blocks=12, block_size=8, tensor_parallel_size=2)
    old.engine.shutdown()
    new = LLM(str(folder), max_model_len=96, num_blocks=12, block_size=8, tensor_parallel_size=2)
    try:
        old.engine.shutdown()  # must not leave the new engine's process group
        with pytest.raises(RuntimeError, match="shut down"):
            old.generate(PROMPTS[:1], params, use_tqdm=False)
        assert len(new.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0].token_ids) == 4
    finally:
        new.engine.shutdown()


def test_cpu_ranks_split_the_hosts_cores_while_the_engine_lives(make_tiny, monkeypatch):
    import os

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    llm = LLM(str(make_tiny("llama")), max_model_len=96, num_blocks=12, tensor_parallel_size=2)
    try:
        assert torch.get_num_threads() == max(1, len(os.sched_getaffinity(0)) // 2)
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        assert len(llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0].token_ids) == 4
    finally:
        llm.engine.shutdown()
    assert torch.get_num_threads() == before


def test_omp_num_threads_where_set_decides_a_cpu_ranks_threads(monkeypatch):
    from tandem import parallel

    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    before = torch.get_num_threads()
    parallel.share_cores(64)
    assert torch.get_num_threads() == before


def test_ranks_that_do_not_leave_in_time_are_killed(monkeypatch):
    import multiprocessing
    import time

    from tandem import workers

    monkeypatch.setattr(workers, "JOIN_TIMEOUT_S", 0.5)
    stuck = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,))
    stuck.start()
    ranks = object.__new__(workers.Workers)  # its processes, without the engines they run
    ranks.pipes, ranks.processes, ranks.errors = [], [stuck], {}
    start = time.monotonic()
    ranks.join()
    assert not stuck.is_alive() and time.monotonic() - start < 10


def test_rank_0_failing_alone_mid_step_still_shuts_down_and_a_new_engine_works(
    make_tiny, monkeypatch
):
    """Rank 0 raises after the workers were told to step (they wait in a collective for it):
    the error reaches the caller, shutdown returns, no rank is left behind, and the process
    group was left, so the next engine forms one."""
    import time

    from tandem import workers

    monkeypatch.setattr(workers, "JOIN_TIMEOUT_S", 5)
    folder = make_tiny("llama")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm = LLM(str(folder), max_model_len=96, num_blocks=12, block_size=8, tensor_parallel_size=2)
    processes = llm.engine.workers.processes
    build = llm.engine.builder.build
    calls = []

    def failing_build(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("rank 0 alone failed")
        return build(*args, **kwargs)

    monkeypatch.setattr(llm.engine.builder, "build", failing_build)
    try:
        with pytest.raises(RuntimeError, match="rank 0 alone failed"):
            llm.generate(PROMPTS[:2], params, use_tqdm=False)
    finally:
        start = time.monotonic()
        llm.engine.shutdown()
    assert time.monotonic() - start < 30
    assert not any(p.is_alive() for p in processes)
    new = LLM(str(folder), max_model_len=96, num_blocks=12, block_size=8, tensor_parallel_size=2)
    try:
        assert len(new.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0].token_ids) == 4
    finally:
        new.engine.shutdown()


SCRIPT = """
from tandem import LLM, SamplingParams
llm = LLM({folder!r}, max_model_len=96, num_blocks=12, block_size=8, tensor_parallel_size=2)
params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
print("tokens", llm.generate([{{"prompt_token_ids": [3, 4, 5]}}], params, use_tqdm=False)[0].outputs[0].token_ids)
llm.shutdown()
"""


def run_script(args: list[str], stdin: str | None, timeout: float = 120):
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    return subprocess.run([sys.executable, *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout, env=env)  # fmt: skip


def test_a_script_read_from_standard_input_runs_two_ranks(make_tiny):
    """The spawned rank must not re-import a __main__ it cannot find (`python - < script.py`)."""
    result = run_script(["-"], SCRIPT.format(folder=str(make_tiny("llama"))))
    assert result.returncode == 0, result.stderr
    assert "tokens [" in result.stdout


def test_a_script_without_a_main_guard_does_not_start_its_engine_again_in_the_rank(
    make_tiny, tmp_path
):
    script = tmp_path / "unguarded.py"
    script.write_text(SCRIPT.format(folder=str(make_tiny("llama"))))
    result = run_script([str(script)], None)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("tokens [") == 1


def test_a_rank_that_fails_while_starting_raises_in_rank_0_with_its_error(make_tiny):
    """A bad setting only the fresh worker process reads: rank 0 raises within seconds, with the
    worker's own error, instead of waiting forever for it to join."""
    script = SCRIPT.format(folder=str(make_tiny("llama")))
    script = "import os\nimport tandem.runner\nos.environ['TANDEM_BLAS'] = 'nonsense'\n" + script
    result = run_script(["-"], script, timeout=60)
    assert result.returncode != 0
    assert "RankExited: tensor-parallel rank 1 exited" in result.stderr
    assert "TANDEM_BLAS" in result.stderr.split("RankExited")[-1]


def test_a_rank_killed_while_starting_raises_in_rank_0_within_seconds(
    make_tiny, kill_rank_1_at_start
):
    import time

    from tandem.workers import RankExited

    start = time.monotonic()
    with pytest.raises(RankExited, match=r"rank 1 exited \(exit code -9\)"):
        LLM(str(make_tiny("llama")), max_model_len=96, num_blocks=12, tensor_parallel_size=2)
    assert time.monotonic() - start < 30


def test_a_rank_that_raises_in_a_step_names_its_error_in_rank_0(make_tiny):
    from tandem.workers import RankExited

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm = LLM(str(make_tiny("llama")), max_model_len=96, num_blocks=12, block_size=8,
              tensor_parallel_size=2)  # fmt: skip
    try:
        llm.engine.workers.pipes[0].send(("step", [("abort",)]))  # a command it cannot apply
        llm.engine.workers.processes[0].join(timeout=30)
        with pytest.raises(RankExited, match=r"(?s)rank 1 exited \(exit code 1\).*IndexError"):
            llm.generate(PROMPTS[:1], params, use_tqdm=False)
    finally:
        llm.engine.shutdown()


def test_two_ranks_keep_structured_outputs_in_step(make_tiny):
    """Every rank defers a masked step's sampling (its collective) to the same point of its
    loop; the constrained rows and the free ones give the tokens of one rank."""
    pytest.importorskip("xgrammar")
    from tandem import StructuredOutputsParams

    folder = make_tiny("qwen3")
    constraint = StructuredOutputsParams(regex=r"[0-9]{2,5}(-[a-z]{1,3})?")
    params = [
        SamplingParams(temperature=1.0, max_tokens=12, seed=i, ignore_eos=i % 2 == 0,
                       structured_outputs=constraint if i % 2 else None)
        for i in range(len(PROMPTS))
    ]  # fmt: skip
    results = []
    for size in (1, 2):
        llm = LLM(str(folder), max_model_len=96, num_blocks=12, block_size=8,
                  max_num_batched_tokens=24, tensor_parallel_size=size)  # fmt: skip
        try:
            outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        finally:
            llm.engine.shutdown()
        results.append([o.outputs[0].token_ids for o in outputs])
        for p, out in zip(params, outputs, strict=True):
            if p.structured_outputs is not None:
                assert out.outputs[0].finish_reason == "stop"
    assert results[1] == results[0]


def test_two_ranks_copy_the_same_blocks_on_write_and_sample_the_tokens_of_one(make_tiny):
    """Every rank schedules alike, so each copies the same cached blocks into its KV heads."""
    folder = make_tiny("llama")
    prompt = {"prompt_token_ids": list(range(5, 29))}  # 3 whole blocks of 8
    params = SamplingParams(n=3, temperature=0.8, max_tokens=8, ignore_eos=True, seed=2)

    def run_n(tensor_parallel_size: int) -> list[list[int]]:
        llm = LLM(str(folder), max_model_len=96, num_blocks=24, block_size=8,
                  tensor_parallel_size=tensor_parallel_size)  # fmt: skip
        try:
            out = llm.generate([prompt, prompt], params, use_tqdm=False)
            assert llm.engine.scheduler.num_block_copies == 5
        finally:
            llm.engine.shutdown()
        return [c.token_ids for o in out for c in o.outputs]

    assert run_n(2) == run_n(1)


def test_two_ranks_key_salted_prompts_alike(make_tiny):
    """Every rank hashes a request's cache salt, so each maps the same cached blocks."""
    folder = make_tiny("llama")
    ids = list(range(5, 29))  # 3 whole blocks of 8
    prompts = [{"prompt_token_ids": ids, "cache_salt": s} for s in ("a", "b", "a", None)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def run_salted(tensor_parallel_size: int) -> list[list[int]]:
        llm = LLM(str(folder), max_model_len=96, num_blocks=24, block_size=8,
                  tensor_parallel_size=tensor_parallel_size)  # fmt: skip
        try:
            first = llm.generate(prompts[:1], params, use_tqdm=False)
            out = first + llm.generate(prompts[1:], params, use_tqdm=False)
            assert [o.num_cached_tokens for o in out] == [0, 0, 23, 0]
        finally:
            llm.engine.shutdown()
        return [o.outputs[0].token_ids for o in out]

    assert run_salted(2) == run_salted(1)


def waiting_order(engine) -> list[tuple[str, int]]:
    return [(r.request_id, r.priority) for r in engine.scheduler.waiting]


def test_two_ranks_queue_by_priority_alike_and_give_the_tokens_of_one(make_tiny):
    """Every rank gets each request's priority with the request, so all keep one queue order
    and preempt the same victims."""
    folder = make_tiny("llama")
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]

    def run_by_priority(tensor_parallel_size: int) -> tuple[list, list[list[int]]]:
        llm = LLM(str(folder), max_model_len=96, num_blocks=12, block_size=8,
                  max_num_batched_tokens=24, scheduling_policy="priority",
                  tensor_parallel_size=tensor_parallel_size)  # fmt: skip
        try:
            llm.enqueue(PROMPTS, params, priority=[2, 0, 1, -1, 0])
            [order, *others] = llm.collective_rpc(waiting_order)
            assert others == [order] * (tensor_parallel_size - 1)
            outputs = llm.wait_for_completion(use_tqdm=False)
            assert llm.engine.scheduler.num_preemptions > 0
        finally:
            llm.engine.shutdown()
        return order, [o.outputs[0].token_ids for o in outputs]

    order, tokens = run_by_priority(2)
    assert [priority for _, priority in order] == [-1, 0, 0, 1, 2]
    assert (order, tokens) == run_by_priority(1)
