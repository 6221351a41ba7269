"""Prompts given as embeddings (prompt_embeds.py): greedy tokens against transformers'
`inputs_embeds`, through chunked prefill, preemption, n samples, sync and async; the prefix
cache keyed by the embeddings' bytes; bad input refused before anything is queued."""

from __future__ import annotations

import asyncio
import base64
import io
from functools import cache
from pathlib import Path

import httpx
import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.async_llm import AsyncLLM
from tandem.config import EngineConfig
from tandem.server.app import build_app
from test_bad_input import transformers_greedy
from test_server import running

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@cache
def hf_model(folder: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def transformers_greedy_of_embeds(folder: Path, embeds: torch.Tensor, max_tokens: int) -> list[int]:
    """transformers' greedy tokens after `embeds` given as inputs_embeds."""
    out = hf_model(folder).generate(
        inputs_embeds=embeds[None].float(),
        attention_mask=torch.ones(1, len(embeds), dtype=torch.long),
        max_new_tokens=max_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, -max_tokens:].tolist()


def table_embeds(folder: Path, ids: list[int]) -> torch.Tensor:
    """The embedding layer's rows of `ids`, as transformers' model holds them."""
    with torch.no_grad():
        return hf_model(folder).get_input_embeddings()(torch.tensor(ids)).detach()


def random_embeds(folder: Path, tokens: int, seed: int) -> torch.Tensor:
    hidden = hf_model(folder).config.hidden_size
    return torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed)) * 0.05


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("arch", ["llama", "gemma2"])  # Gemma scales them, as transformers does
def test_embeddings_give_the_tokens_of_their_ids_and_transformers_inputs_embeds(make_tiny, arch):
    folder = make_tiny(arch)
    ids = [3, 17, 42, 99, 5, 23, 8, 61, 12]
    noise = random_embeds(folder, 12, seed=1)
    llm = LLM(str(folder), max_model_len=64, enable_prompt_embeds=True)
    noise_sparse = noise.to_sparse()  # taken as its dense values
    got = tokens(
        llm.generate(
            [{"prompt_embeds": table_embeds(folder, ids)}, {"prompt_token_ids": ids},
             {"prompt_embeds": noise}, {"prompt_embeds": noise_sparse}],
            GREEDY, use_tqdm=False,
        )
    )  # fmt: skip
    want = transformers_greedy(folder, tuple(ids), GREEDY.max_tokens)
    assert got[0] == got[1] == want
    assert got[2] == got[3] == transformers_greedy_of_embeds(folder, noise, GREEDY.max_tokens)


@pytest.mark.parametrize("async_batching", [False, True], ids=["sync", "async"])
def test_chunked_preempted_and_sampled_n_times_as_transformers(make_tiny, async_batching):
    """Prompts longer than a step's token budget, too few blocks for all at once (preemption
    recomputes their prompt from the embeddings again), text prompts between, each twice
    (the second shares the first's blocks)."""
    folder = make_tiny("llama")
    prompts = [{"prompt_embeds": random_embeds(folder, 30 + 7 * i, seed=i)} for i in range(4)]
    prompts.insert(2, {"prompt_token_ids": list(range(5, 40))})
    llm = LLM(
        str(folder), max_model_len=96, enable_prompt_embeds=True, max_num_batched_tokens=16,
        block_size=8, num_blocks=24, async_batching=async_batching,
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate([p for p in prompts for _ in range(2)], params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    pairs = zip(outputs[::2], outputs[1::2], strict=True)
    for prompt, pair in zip(prompts, pairs, strict=True):
        if "prompt_embeds" in prompt:
            want = transformers_greedy_of_embeds(folder, prompt["prompt_embeds"], 12)
            assert pair[0].prompt_token_ids == []  # the prompt had no ids
        else:
            want = transformers_greedy(folder, tuple(prompt["prompt_token_ids"]), 12)
        assert [o.outputs[0].token_ids for o in pair] == [want, want]
    assert llm.engine.allocator.num_free == llm.engine.num_blocks


def test_the_prefix_cache_shares_blocks_of_the_same_embeddings_only(make_tiny):
    folder = make_tiny("llama")
    llm = LLM(str(folder), max_model_len=96, enable_prompt_embeds=True, block_size=8)
    embeds = random_embeds(folder, 40, seed=3)
    other = embeds.clone()
    other[-1] += 0.01  # the last row differs: its whole prompt is another
    placeholders = [0] * 40  # the ids the engine gives a prompt of embeddings
    first, again, changed, zeros = llm.generate(
        [{"prompt_embeds": embeds}, {"prompt_embeds": embeds.clone()}, {"prompt_embeds": other},
         {"prompt_token_ids": placeholders}],
        GREEDY, use_tqdm=False,
    )  # fmt: skip
    assert first.num_cached_tokens == 0 and zeros.num_cached_tokens == 0
    assert again.num_cached_tokens == 39  # all but the last token, which is computed
    assert changed.num_cached_tokens == 0
    assert first.outputs[0].token_ids == again.outputs[0].token_ids
    assert changed.outputs[0].token_ids == transformers_greedy_of_embeds(folder, other, 8)


def test_async_llm_streams_a_prompt_of_embeddings(make_tiny):
    folder = make_tiny("llama")
    embeds = random_embeds(folder, 10, seed=4)

    async def main():
        llm = AsyncLLM.from_model(str(folder), max_model_len=64, enable_prompt_embeds=True)
        try:
            final = None
            async for output in llm.generate({"prompt_embeds": embeds}, GREEDY, "r"):
                final = output
            return final
        finally:
            llm.shutdown()

    final = asyncio.run(main())
    assert final.prompt_token_ids == []
    assert final.outputs[0].token_ids == transformers_greedy_of_embeds(folder, embeds, 8)


@pytest.mark.parametrize(
    ("prompt", "params", "error", "words"),
    [
        ({"prompt_embeds": [[0.0] * 64]}, GREEDY, TypeError, "torch.Tensor"),
        ({"prompt_embeds": torch.zeros(64)}, GREEDY, ValueError, "[tokens, 64]"),
        ({"prompt_embeds": torch.zeros(3, 65)}, GREEDY, ValueError, "hidden size"),
        ({"prompt_embeds": torch.zeros(0, 64)}, GREEDY, ValueError, "at least one token"),
        ({"prompt_embeds": torch.zeros(3, 64, dtype=torch.int32)}, GREEDY, ValueError, "floating"),
        ({"prompt_embeds": torch.full((3, 64), float("nan"))}, GREEDY, ValueError, "finite"),
        ({"prompt_embeds": torch.zeros(3, 64, device="meta")}, GREEDY, ValueError, "meta"),
        ({"prompt_embeds": torch.zeros(64, 64)}, GREEDY, ValueError, "max_model_len"),
        ({"prompt_embeds": torch.zeros(3, 64), "prompt_token_ids": [1]}, GREEDY, ValueError,
         "give one of them"),
        ({"prompt_embeds": torch.zeros(3, 64)}, SamplingParams(repetition_penalty=1.2),
         ValueError, "repetition_penalty"),
        ({"prompt_embeds": torch.zeros(3, 64)}, SamplingParams(prompt_logprobs=1), ValueError,
         "prompt_logprobs"),
    ],
)  # fmt: skip
def test_bad_embeddings_are_refused_and_nothing_is_queued(make_tiny, prompt, params, error, words):
    folder = make_tiny("llama")
    llm = LLM(str(folder), max_model_len=64, enable_prompt_embeds=True)
    good = {"prompt_embeds": random_embeds(folder, 5, seed=5)}
    with pytest.raises(error) as raised:
        llm.generate([good, prompt], [GREEDY, params], use_tqdm=False)
    assert words in str(raised.value), raised.value
    assert not llm.engine.has_unfinished() and not llm.engine.requests
    [output] = llm.generate([good], GREEDY, use_tqdm=False)
    assert output.outputs[0].token_ids == transformers_greedy_of_embeds(
        folder, good["prompt_embeds"], 8
    )


def test_embeddings_need_the_engine_argument_and_one_device(make_tiny):
    folder = make_tiny("llama")
    llm = LLM(str(folder), max_model_len=64)
    with pytest.raises(ValueError, match="enable_prompt_embeds"):
        llm.generate({"prompt_embeds": torch.zeros(3, 64)}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="tensor_parallel_size must be 1"):
        EngineConfig(
            model=str(folder), enable_prompt_embeds=True, tensor_parallel_size=2
        ).validate()
    with pytest.raises(ValueError, match="enable_prompt_embeds must be True or False"):
        LLM(str(folder), enable_prompt_embeds="yes")


def test_a_step_s_embedding_rows_are_its_prompt_positions_of_embedding_prompts():
    """plan_rows against a direct count: each embedding prompt's positions computed in the step
    (a chunk, not its generated tokens), at their token rows, with their vectors; has_rows says
    whether a planned step has any."""
    import numpy as np

    from tandem.prompt_embeds import PromptEmbedBuffers, has_rows, plan_rows
    from tandem.request import Request

    def request(tokens: int, computed: int, embeds: bool) -> Request:
        r = Request("r", [0] * tokens, GREEDY, 0)
        r.prompt_embeds = torch.arange(tokens * 4.0).view(tokens, 4) if embeds else None
        r.num_computed_tokens = computed
        return r

    # a chunk of 5 of an 8-token embedding prompt, a text prompt, one decode past its prompt
    requests = [request(8, 7, True), request(6, 6, False), request(3, 4, True)]
    num_new = np.array([5, 6, 1])
    start = np.array([r.num_computed_tokens for r in requests]) - num_new
    qsl = np.concatenate([[0], np.cumsum(num_new)])
    buffers = PromptEmbedBuffers(16, 4, torch.float32, torch.device("cpu"))
    step = plan_rows(requests, start, num_new, qsl, buffers)
    assert step.num_rows == 5
    assert buffers.host_rows[:5].tolist() == [0, 1, 2, 3, 4]
    torch.testing.assert_close(buffers.host_values[:5], requests[0].prompt_embeds[2:7])
    assert has_rows(requests, num_new.tolist())
    assert not has_rows(requests[1:], num_new[1:].tolist())  # a decode is no prompt position
    assert plan_rows(requests[1:], start[1:], num_new[1:], qsl[1:] - 5, buffers) is None


def encoded(embeds: torch.Tensor) -> str:
    """vLLM's wire form of prompt_embeds: base64 of the tensor's torch.save bytes."""
    buffer = io.BytesIO()
    torch.save(embeds, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def test_the_server_takes_prompt_embeds_as_base64_of_torch_save(make_tiny):
    """/v1/completions' prompt_embeds (one, or a batch; a [1, tokens, hidden] batch of one
    too): transformers' tokens; bad ones are 400s naming the field."""
    folder = make_tiny("llama")
    embeds = [random_embeds(folder, 6 + i, seed=10 + i) for i in range(2)]
    llm = AsyncLLM.from_model(str(folder), max_model_len=64, enable_prompt_embeds=True)
    body = {"model": "tiny", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    try:
        with running(build_app(llm, "tiny")) as url:
            completions = f"{url}/v1/completions"
            answer = httpx.post(completions, json={**body, "prompt_embeds": encoded(embeds[0])})
            assert answer.status_code == 200, answer.text
            [choice] = answer.json()["choices"]
            assert choice["token_ids"] == transformers_greedy_of_embeds(folder, embeds[0], 8)
            batch = [encoded(embeds[0][None]), encoded(embeds[1])]
            answer = httpx.post(completions, json={**body, "prompt_embeds": batch})
            got = [c["token_ids"] for c in answer.json()["choices"]]
            assert got == [transformers_greedy_of_embeds(folder, e, 8) for e in embeds]
            for fields, param in (
                ({"prompt_embeds": "not base64!"}, "prompt_embeds"),
                ({"prompt_embeds": base64.b64encode(b"junk").decode()}, "prompt_embeds"),
                ({"prompt_embeds": encoded(torch.zeros(3, 65))}, "prompt_embeds"),
                ({"prompt_embeds": encoded(embeds[0]), "prompt": "x"}, "prompt"),
                ({"prompt_embeds": encoded(embeds[0]), "echo": True}, "echo"),
                ({}, "prompt"),
            ):
                answer = httpx.post(completions, json={**body, **fields})
                assert answer.status_code == 400, (fields, answer.text)
                assert answer.json()["error"]["param"] == param, answer.text
    finally:
        llm.shutdown()
