"""The RL hooks on CUDA with graphs and async batching: weights updated in place under captured
graphs, sleep levels 1 and 2 giving the device memory back and waking to the same tokens."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tandem import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ENGINE_ARGS = {"max_model_len": 256, "block_size": 16, "dtype": "bfloat16", "num_blocks": 64}
PROMPTS = [
    {"prompt_token_ids": [(5 * i + 3 * j) % 200 + 3 for j in range(20 + i)]} for i in range(6)
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("call", ["update_weights", "apply_model"])
def test_update_weights_under_captured_graphs_equals_a_fresh_engine(checkpoints, call):
    """Device tensors copied in place, by `update_weights` or by the model's `load_weights`
    in `apply_model` (vLLM's RL idiom), while a decode step may still be in flight."""
    a, b = checkpoints
    llm = LLM(a, **ENGINE_ARGS)
    assert llm.engine.runner.graphs  # the decode steps replay graphs
    on_a = tokens(llm)
    state = {k: v.cuda() for k, v in load_file(f"{b}/model.safetensors").items()}
    if call == "update_weights":
        llm.update_weights(state.items())
    else:
        assert llm.apply_model(lambda model: model.load_weights(state.items())) == [set(state)]
    on_b = tokens(LLM(b, **ENGINE_ARGS))
    assert on_a != on_b
    assert tokens(llm) == on_b


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_the_weights_and_kv_cache_and_wakes_to_the_same_tokens(checkpoints, level):
    a, _ = checkpoints
    llm = LLM(a, **ENGINE_ARGS)
    engine = llm.engine
    before = tokens(llm)
    num_graphs = len(engine.runner.graphs)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    freed = llm.sleep(level)
    assert freed >= engine.memory.kv_bytes + sum(engine.memory.weight_bytes)
    assert allocated - torch.cuda.memory_allocated() >= freed
    llm.wake_up()
    assert len(engine.runner.graphs) == num_graphs  # captured again
    if level == 2:
        llm.update_weights_from_path(a)
    assert tokens(llm) == before


def test_wake_up_by_tags_loads_new_weights_before_the_cache_and_captures_graphs_once(checkpoints):
    """The trainer's order (vLLM's tags): sleep at level 2, wake the weights alone, send new
    ones while the cache still has no memory, then wake the cache: graphs captured once, at the
    end, and the tokens are those of an engine started on the new weights."""
    a, b = checkpoints
    llm = LLM(a, **ENGINE_ARGS)
    engine = llm.engine
    num_graphs = len(engine.runner.graphs)
    llm.sleep(2)
    llm.wake_up(["weights"])
    assert engine.is_sleeping and not engine.runner.graphs
    assert engine.memory.kv_cache.untyped_storage().nbytes() == 0
    state = {k: v.cuda() for k, v in load_file(f"{b}/model.safetensors").items()}
    llm.update_weights(state.items())
    llm.wake_up(["kv_cache"])
    assert not engine.is_sleeping and len(engine.runner.graphs) == num_graphs
    assert tokens(llm) == tokens(LLM(b, **ENGINE_ARGS))
