"""Greedy tokens equal transformers' generate (fp32, eager, one prompt at a time) on every architecture."""

from __future__ import annotations

import functools

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.engine import Engine

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
TIE = 1e-4
PROMPT_LENGTHS = [3, 41, 7, 18, 29, 1]
MAX_TOKENS = [24, 9, 30, 16, 24, 12]


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@functools.cache
def reference(folder: str) -> list[tuple[list[int], list[torch.Tensor]]]:
    """(tokens, per-step logits) of transformers' greedy generate for each prompt alone."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    )
    results = []
    for ids, max_tokens in zip(prompts(model.config.vocab_size), MAX_TOKENS, strict=True):
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            eos_token_id=None,
            pad_token_id=model.config.vocab_size - 1,
        )
        results.append((out.sequences[0, len(ids) :].tolist(), [s[0] for s in out.logits]))
    return results


def assert_same_greedy(ours: list[int], theirs: list[int], logits: list[torch.Tensor]) -> None:
    """Equal tokens, except that the sequences may part where transformers' top-2 logits tie."""
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if a != b:
            top2 = logits[i].topk(2).values
            assert top2[0] - top2[1] < TIE, (
                f"token {i}: ours {a}, transformers {b}, no tie ({top2.tolist()})"
            )
            return


def run_pieces_eagerly(monkeypatch) -> None:
    """Steps that no whole graph runs go through the pieces of piecewise.py, uncaptured on CPU:
    the step cut at its attentions, its tokens padded to the next bucket."""
    monkeypatch.setattr(Engine, "_use_piecewise", lambda self: True)


@pytest.mark.parametrize("pieces", [False, True], ids=["whole", "pieces"])
@pytest.mark.parametrize("async_batching", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers_with_chunked_prefill_and_preemption(
    make_tiny, monkeypatch, arch, async_batching, pieces
):
    if pieces:
        run_pieces_eagerly(monkeypatch)
    folder = str(make_tiny(arch))
    llm = LLM(
        folder,
        max_model_len=96,
        block_size=8,
        num_blocks=14,  # 112 token slots for 6 requests of up to 71 tokens: forces preemption
        max_num_batched_tokens=16,  # below the longest prompt: forces chunked prefill
        async_batching=async_batching,
    )
    vocab = llm.engine.model_config.vocab_size
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts(vocab)], params, use_tqdm=False
    )

    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.allocator.num_free == llm.engine.num_blocks
    assert (llm.engine.runner.pieces is not None) == pieces
    for out, (tokens, logits) in zip(outputs, reference(folder), strict=True):
        assert out.outputs[0].finish_reason == "length"
        assert_same_greedy(out.outputs[0].token_ids, tokens, logits)


@pytest.mark.parametrize("pieces", [False, True], ids=["whole", "pieces"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers_with_everything_in_one_batch(
    make_tiny, monkeypatch, arch, pieces
):
    if pieces:
        run_pieces_eagerly(monkeypatch)
    folder = str(make_tiny(arch))
    llm = LLM(folder, max_model_len=256, num_blocks=64)
    vocab = llm.engine.model_config.vocab_size
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts(vocab)], params, use_tqdm=False
    )

    assert llm.engine.scheduler.num_preemptions == 0
    for out, (tokens, logits) in zip(outputs, reference(folder), strict=True):
        assert_same_greedy(out.outputs[0].token_ids, tokens, logits)
