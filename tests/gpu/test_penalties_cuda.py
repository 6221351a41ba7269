"""Penalties on the CUDA path: captured graphs == eager, async == sync, no host wait, the fused
kernel against the torch ops, and a clean stream sanitizer run, all with preemption mid-flight."""

from __future__ import annotations

import pytest
import torch

from conftest import preempting_run
from tandem import LLM, SamplingParams
from tandem.penalties import apply_dense
from tandem.runner import Runner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPT_LENGTHS = [3, 41, 7, 18, 29, 1, 60, 5]
MAX_TOKENS = [24, 9, 30, 16, 24, 12, 20, 33]


def prompts(vocab: int) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    return [
        {"prompt_token_ids": torch.randint(0, vocab, (n,), generator=g).tolist()}
        for n in PROMPT_LENGTHS
    ]


def params(temperature: float) -> list[SamplingParams]:
    """Every processor on some rows, none on others, filters on a few: all four graph variants
    (greedy too: min_tokens takes the filters' sampler)."""
    out = []
    for i, n in enumerate(MAX_TOKENS):
        fields = dict(temperature=temperature, max_tokens=n, ignore_eos=True, seed=i)
        if i % 4 != 3:
            fields |= dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1)
        if i == 1:
            fields |= dict(logit_bias={5: 3.0, 6: -100.0}, allowed_token_ids=list(range(40)))
        if i == 2:
            fields |= dict(bad_words=["the scheduler", "token"])
        if i in (0, 3):
            fields |= dict(top_p=0.9)
        if i == 3:  # min_tokens bans EOS: the filters' sampler, greedy too
            fields |= dict(min_tokens=14, ignore_eos=False)
        out.append(SamplingParams(**fields))
    return out


def generate(folder, dtype="float32", temperature=0.0, num_blocks=16, **engine_args):
    llm = LLM(
        str(folder),
        dtype=dtype,
        max_model_len=128,
        block_size=8,
        max_num_batched_tokens=32,
        num_blocks=num_blocks,  # 16: 128 slots for 8 requests of up to 80 tokens: preemption
        **engine_args,
    )
    outs = llm.generate(
        prompts(llm.engine.model_config.vocab_size), params(temperature), use_tqdm=False
    )
    assert llm.engine.allocator.num_free == llm.engine.num_blocks
    if num_blocks == 16:
        assert llm.engine.scheduler.num_preemptions > 0
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_async_equals_sync_with_penalties_and_preemption(make_tiny, dtype):
    for temperature in (0.0, 1.0):
        sync = generate(make_tiny("llama"), dtype, temperature, async_batching=False)
        assert generate(make_tiny("llama"), dtype, temperature, async_batching=True) == sync


def test_graphs_equal_eager_with_penalties_and_the_penalty_graphs_replay(make_tiny, monkeypatch):
    replayed = []
    original = Runner._sample_step

    def recorded(self, batch):
        replayed.append((batch.graphed, batch.use_penalties, batch.use_filters))
        return original(self, batch)

    monkeypatch.setattr(Runner, "_sample_step", recorded)
    eager = generate(make_tiny("llama"), cuda_graphs=False)
    assert generate(make_tiny("llama"), cuda_graphs=True) == eager
    assert (True, True, False) in replayed and (True, True, True) in replayed


def test_penalty_steps_block_only_on_the_d2h_event(make_tiny, counted_waits):
    llm = LLM(str(make_tiny("qwen3")), max_model_len=256, max_num_batched_tokens=32, num_blocks=64)
    waits = counted_waits
    torch.cuda.set_sync_debug_mode("error")
    try:
        llm.generate(prompts(704)[:6], params(1.0)[:6], use_tqdm=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert sorted(waits) == list(range(llm.engine.num_steps))


@pytest.mark.parametrize("count_dtype", [torch.int16, torch.int32])
def test_fused_kernel_matches_the_torch_ops_at_llama_3_vocabulary(count_dtype):
    from tandem.penalties_kernel import apply_penalties

    g = torch.Generator(device="cuda").manual_seed(0)
    seqs, rows, vocab = 32, 257, 128_256
    logits = torch.randn(seqs, vocab, device="cuda", generator=g) * 4
    counts = torch.randint(0, 3, (rows, vocab), device="cuda", generator=g).to(count_dtype)
    flags = torch.randint(0, 4, (rows, vocab), device="cuda", generator=g).to(torch.uint8)
    state_rows = torch.randperm(rows, device="cuda", generator=g)[:seqs].int()
    presence = torch.rand(seqs, device="cuda", generator=g) * 4 - 2
    frequency = torch.rand(seqs, device="cuda", generator=g) * 4 - 2
    repetition = torch.rand(seqs, device="cuda", generator=g) + 0.5
    index = state_rows.long()
    expected = apply_dense(logits, counts[index], flags[index], presence, frequency, repetition)
    fused = logits.clone()
    apply_penalties(fused, counts, flags, state_rows, presence, frequency, repetition)
    torch.testing.assert_close(fused, expected, rtol=1e-6, atol=1e-5)


SANITIZED_RUN = preempting_run(
    "llama",
    """
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, presence_penalty=0.5,
                            repetition_penalty=1.2, logit_bias={3: 2.0}, bad_words=["the cat"])
    """,
)


def test_penalty_steps_are_clean_under_the_stream_sanitizer(run_sanitized):
    assert run_sanitized(SANITIZED_RUN).count("ok") == 2
