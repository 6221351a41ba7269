"""Prompt logprobs on CUDA: async steps with pieces and graphs, the fused LM head kernel, no
host sync, clean under the stream sanitizer."""

from __future__ import annotations

import textwrap

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.prompt_logprobs_kernel import lm_head_logprobs
from test_prompt_logprobs import assert_ranks_within

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

transformers = pytest.importorskip("transformers")

PROMPT_LENGTHS = [37, 5, 2, 23, 41, 1, 30]
# (prompt_logprobs, max_tokens): k <= 1 takes the fused kernel, 5 the sub-chunked log-softmax
REQUESTS = [(0, 0), (5, 4), (1, 0), (None, 6), (20, 3), (0, 2), (1, 5)]


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def reference(folder: str, ids: list[int]) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].log_softmax(-1)[:-1]


def run(folder: str, dtype: str, **engine_args):
    llm = LLM(folder, dtype=dtype, max_model_len=56, block_size=8, num_blocks=7,
              max_num_batched_tokens=16, **engine_args)  # fmt: skip
    ids = prompts(llm.engine.model_config.vocab_size)
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, prompt_logprobs=k)
        for k, n in REQUESTS
    ]
    outputs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0  # 56 token slots for ~160 tokens
    assert llm.engine.allocator.num_free == llm.engine.num_blocks
    return ids, outputs


@pytest.mark.parametrize("async_batching", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(
    ("dtype", "atol", "rtol"),
    [("float32", 1e-3, 1e-4), ("bfloat16", 0.35, 0.02)],
    ids=["float32", "bfloat16"],
)
def test_prompt_logprobs_on_cuda_match_transformers(make_tiny, dtype, atol, rtol, async_batching):
    """Chunks of 16 tokens through the captured pieces (decodes through the graphs), with
    preemption. Within atol + rtol * |logprob|, the error following the logits' scale
    (standard deviation 6) more than the logprob's. float32: every Triton product is IEEE (with
    TF32 products the attention was 0.005-0.03 off); bfloat16 rounds every layer's activations
    to 8 bits (0.17-0.26 seen at logprobs -22.9 and -24.8)."""
    folder = str(make_tiny("llama"))
    ids, outputs = run(folder, dtype, async_batching=async_batching)
    errors = []  # (|error|, transformers' logprob) of every compared entry
    for prompt, out, (k, _) in zip(ids, outputs, REQUESTS, strict=True):
        if k is None:
            assert out.prompt_logprobs is None
            continue
        rows = reference(folder, prompt)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for p in range(1, len(prompt)):
            entry = out.prompt_logprobs[p]
            top = [t for t in entry if entry[t].rank <= k]  # the prompt's token first: vLLM's order
            for token in [prompt[p], *top]:
                expected = rows[p - 1, token].item()
                errors.append((abs(entry[token] - expected), expected))
            assert len(entry) in (k, k + 1)
    worst = max(errors)
    print(f"{dtype}: largest error {worst[0]:.2e} at logprob {worst[1]:.2f}")
    assert all(error < atol + rtol * abs(expected) for error, expected in errors)


def test_prompt_logprob_steps_block_only_on_the_d2h_event(make_tiny, counted_waits):
    llm = LLM(str(make_tiny("qwen3")), max_model_len=256, max_num_batched_tokens=32, num_blocks=64)
    waits = counted_waits
    ids = prompts(llm.engine.model_config.vocab_size)
    params = [SamplingParams(max_tokens=n, prompt_logprobs=k) for k, n in REQUESTS if k is not None]
    torch.cuda.set_sync_debug_mode("error")
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in ids[:6]], params, use_tqdm=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert sorted(waits) == list(range(llm.engine.num_steps))
    assert all(o.prompt_logprobs is not None for o in outputs)


@pytest.mark.parametrize("rows", [1, 100, 2048])
def test_fused_lm_head_kernel_at_llama_3_8b_shape(rows):
    g = torch.Generator(device="cuda").manual_seed(rows)
    vocab, hidden = 128256, 4096
    tokens = torch.randn(rows + 3, hidden, device="cuda", generator=g).bfloat16()
    index = torch.randperm(rows + 3, device="cuda", generator=g)[:rows]
    weight = (torch.randn(vocab, hidden, device="cuda", generator=g) * 0.05).bfloat16()
    targets = torch.randint(0, vocab, (rows,), device="cuda", generator=g)
    values = torch.empty(rows, 2, device="cuda")
    ids = torch.empty(rows, 1, dtype=torch.int32, device="cuda")
    ranks = torch.empty(rows, dtype=torch.int32, device="cuda")
    lm_head_logprobs(tokens, index, weight, targets, vocab, values, ids, ranks)
    reference = (tokens[index].float() @ weight.float().T).log_softmax(-1)
    wanted = reference.gather(1, targets[:, None])[:, 0]
    assert torch.allclose(values[:, 0], wanted, atol=2e-3)
    assert_ranks_within(ranks, reference, wanted, 2e-3)
    assert torch.allclose(values[:, 1], reference.max(-1).values, atol=2e-3)
    top2 = reference.topk(2).values
    clear = top2[:, 0] - top2[:, 1] > 1e-2  # no near-tie between the two best
    assert torch.equal(ids[clear, 0].long(), reference.argmax(-1)[clear])


SANITIZED_RUN = textwrap.dedent(
    """
    import sys
    from tandem import LLM, SamplingParams
    from tandem.model.tiny import make_tiny_model
    folder = make_tiny_model(sys.argv[1], "llama")
    for graphs in (False, True):
        llm = LLM(str(folder), max_model_len=64, max_num_batched_tokens=16, num_blocks=12,
                  block_size=8, cuda_graphs=graphs)
        prompts = [{"prompt_token_ids": list(range(3 + 7 * i, 20 + 9 * i))} for i in range(6)]
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, prompt_logprobs=k)
                  for k, n in [(0, 0), (1, 24), (5, 20), (None, 24), (0, 18), (3, 0)]]
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0
        print("ok", graphs, sum(len(o.prompt_logprobs or []) for o in outs))
    """
)


def test_prompt_logprobs_are_clean_under_the_stream_sanitizer(run_sanitized):
    assert run_sanitized(SANITIZED_RUN).count("ok") == 2


@pytest.mark.parametrize("async_batching", [False, True], ids=["sync", "async"])
def test_logprob_token_ids_on_cuda_match_transformers_with_only_the_d2h_wait(
    make_tiny, counted_waits, async_batching
):
    """Named ids' logprobs (token_logprobs.py) beside top-k and plain rows, float32 on CUDA:
    within 1e-3 of transformers', the step loop waiting only on its D2H events."""
    folder = str(make_tiny("llama"))
    # cuda_graphs=False: every step has a logprob row, so no sampling graph would replay
    llm = LLM(
        folder, dtype="float32", max_model_len=128, async_batching=async_batching, cuda_graphs=False
    )
    ids = prompts(llm.engine.model_config.vocab_size)[:4]
    named = [[5, 17, 99, 3], None, [42], None]
    params = [
        SamplingParams(seed=i, temperature=1.0, max_tokens=8, ignore_eos=True,
                       logprob_token_ids=n, logprobs=None if n else (2 if i == 1 else None))
        for i, n in enumerate(named)
    ]  # fmt: skip
    torch.cuda.set_sync_debug_mode("error")
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert sorted(counted_waits) == list(range(llm.engine.num_steps))
    for prompt, out, n in zip(ids, outputs, named, strict=True):
        completion = out.outputs[0]
        if n is None:
            continue
        rows = reference(folder, prompt + completion.token_ids)[len(prompt) - 1 :]
        for step, (token, entry) in enumerate(
            zip(completion.token_ids, completion.logprobs, strict=True)
        ):
            assert set(entry) == {*n, token}
            for t, logprob in entry.items():
                assert logprob.logprob == pytest.approx(rows[step, t].item(), abs=1e-3)


def test_logprob_token_ids_are_clean_under_the_stream_sanitizer(run_sanitized):
    script = textwrap.dedent("""
        import sys
        from tandem import LLM, SamplingParams
        from tandem.model.tiny import make_tiny_model
        llm = LLM(str(make_tiny_model(sys.argv[1], "llama")), max_model_len=128,
                  num_blocks=32, cuda_graphs=False)  # the test process holds the device too
        params = [SamplingParams(max_tokens=12, ignore_eos=True, logprob_token_ids=[5, 9]),
                  SamplingParams(max_tokens=9, ignore_eos=True)]
        outs = llm.generate([{"prompt_token_ids": [1, 2, 3]}] * 2, params, use_tqdm=False)
        assert all(set(e) >= {5, 9} for e in outs[0].outputs[0].logprobs)
        print("ok")
    """)
    assert run_sanitized(script).strip().endswith("ok")


def test_logprobs_of_the_whole_vocabulary_are_clean_under_the_stream_sanitizer(run_sanitized):
    """max_logprobs=-1: the slots' top-logprob buffers (written on the compute stream, copied
    on the D2H stream, as wide as the vocabulary) beside a plain row and prompt logprobs."""
    script = textwrap.dedent("""
        import sys
        from tandem import LLM, SamplingParams
        from tandem.model.tiny import make_tiny_model
        llm = LLM(str(make_tiny_model(sys.argv[1], "llama")), max_model_len=128,
                  num_blocks=32, max_logprobs=-1)  # the test process holds the device too
        vocab = llm.engine.model_config.vocab_size
        params = [SamplingParams(max_tokens=12, ignore_eos=True, logprobs=-1, prompt_logprobs=50),
                  SamplingParams(max_tokens=9, ignore_eos=True),
                  SamplingParams(max_tokens=10, ignore_eos=True, logprobs=40)]
        outs = llm.generate([{"prompt_token_ids": [1, 2, 3]}] * 3, params, use_tqdm=False)
        assert all(len(e) == vocab for e in outs[0].outputs[0].logprobs)
        assert all(len(e) in (50, 51) for e in outs[0].prompt_logprobs[1:])
        assert all(len(e) in (40, 41) for e in outs[2].outputs[0].logprobs)
        print("ok")
    """)
    assert run_sanitized(script).strip().endswith("ok")
