"""Prompts of embeddings and compilation_config's graph plan on CUDA: the steps that take
embeddings run eagerly beside graphed decode steps, clean under the stream sanitizer; the
decode graphs have the sizes compilation_config names."""

from __future__ import annotations

import gc

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.runner import Runner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [list(range(3 + 5 * i, 20 + 7 * i)) for i in range(5)]


def recorded_launches(monkeypatch) -> list:
    """Every step the runner launches, as it launches it."""
    launched = []
    launch = Runner.launch

    def record(self, batch, timeline):
        launched.append((batch.prompt_embeds is not None, batch.graphed, batch.token_bucket,
                         batch.num_seqs_padded))  # fmt: skip
        return launch(self, batch, timeline)

    monkeypatch.setattr(Runner, "launch", record)
    return launched


@pytest.mark.parametrize("async_batching", [False, True], ids=["sync", "async"])
def test_embedding_prompts_run_eagerly_beside_graphed_steps_and_give_their_ids_tokens(
    make_tiny, monkeypatch, async_batching
):
    llm = LLM(str(make_tiny("llama")), dtype="float32", max_model_len=128,
              enable_prompt_embeds=True, async_batching=async_batching)  # fmt: skip
    table = llm.engine.model.embed_tokens.weight.detach().cpu()
    launched = recorded_launches(monkeypatch)
    by_ids = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    mixed = [{"prompt_embeds": table[p]} if i % 2 else {"prompt_token_ids": p}
             for i, p in enumerate(PROMPTS)]  # fmt: skip
    by_embeds = llm.generate(mixed, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in by_embeds] == [o.outputs[0].token_ids for o in by_ids]
    embed_steps = [step for step in launched if step[0]]
    assert embed_steps and all(
        not graphed and bucket is None for _, graphed, bucket, _ in embed_steps
    )
    assert any(graphed for _, graphed, _, _ in launched)  # the decode steps still replay graphs


def test_embedding_prompts_are_clean_under_the_stream_sanitizer(run_sanitized):
    run_sanitized(
        """
import sys
from tandem import LLM, SamplingParams
from tandem.model.tiny import make_tiny_model
folder = make_tiny_model(sys.argv[1], "llama")
llm = LLM(str(folder), max_model_len=128, max_num_batched_tokens=16, num_blocks=12,
          enable_prompt_embeds=True)
table = llm.engine.model.embed_tokens.weight.detach().cpu()
prompts = [{"prompt_embeds": table[list(range(3 + 7 * i, 20 + 9 * i))]} for i in range(6)]
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                    use_tqdm=False)
assert llm.engine.scheduler.num_preemptions > 0
print(len(outs))
"""
    )


@pytest.mark.parametrize(
    ("config", "sizes", "pieces", "replayed"),
    [
        ({"cudagraph_capture_sizes": [1, 4]}, [1, 4], True, {4}),  # 3 rows: the next size up
        ({"cudagraph_mode": "PIECEWISE"}, [], True, set()),
        # 3 rows, more than the largest graph's: eager
        ({"cudagraph_mode": "FULL_DECODE_ONLY", "max_cudagraph_capture_size": 2}, [1, 2], False,
         set()),
    ],
)  # fmt: skip
def test_the_decode_graphs_have_the_sizes_compilation_config_names(
    make_tiny, monkeypatch, config, sizes, pieces, replayed
):
    folder = str(make_tiny("llama"))
    eager = LLM(folder, dtype="float32", max_model_len=128, cuda_graphs=False)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, GREEDY, use_tqdm=False)]
    del eager  # the next engine sizes its cache by the free memory: this one's given back
    gc.collect()
    llm = LLM(folder, dtype="float32", max_model_len=128, compilation_config=config)
    assert llm.engine.runner.graph_sizes == sizes
    assert (llm.engine.runner.pieces is not None) == pieces
    launched = recorded_launches(monkeypatch)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == want
    assert {padded for _, graphed, _, padded in launched if graphed} == replayed
