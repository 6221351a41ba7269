"""examples/grpo_loop.py on the tiny model: the policy learns, the engine follows its weights."""

from __future__ import annotations

import importlib.util
from pathlib import Path

EXAMPLE = Path(__file__).parent.parent / "examples" / "grpo_loop.py"


def load_example():
    spec = importlib.util.spec_from_file_location("grpo_loop", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_grpo_rollouts_follow_the_pushed_weights_and_match_a_fresh_engine(make_tiny):
    example = load_example()
    result = example.main(str(make_tiny("llama")), steps=2)
    assert result["fresh_equal"]
    assert result["max_logprob_gap"] < 1e-3  # the engine's logprobs are the policy's own
    # the pushed weights changed the engine: the rollouts differ from the step-0 weights'
    first = example.rollouts(example.LLM(str(make_tiny("llama")), dtype="float32",
                                         max_model_len=64, block_size=8), 2)  # fmt: skip
    assert first != result["updated"]
