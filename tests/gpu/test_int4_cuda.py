"""Int4 weights on CUDA: the W4A16 kernel in the engine's steps (split-K partials handed to the
norm, CUDA graphs, async batching) against transformers on the dequantized weights, and under
the stream sanitizer."""

from __future__ import annotations

import pytest
import torch
from test_cuda_engine import MAX_TOKENS, assert_tokens_match_transformers, generate, prompts

from test_int4 import write_int4

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("arch,fmt", [("llama", "gptq"), ("qwen2", "awq"), ("llama", "gptq_act")])
def test_int4_greedy_matches_transformers_on_the_dequantized_weights(
    make_tiny, tmp_path, arch, fmt
):
    transformers = pytest.importorskip("transformers")
    int4, dequantized = write_int4(make_tiny(arch), tmp_path, fmt)
    ours = generate(int4, cuda_graphs=True, async_batching=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(dequantized), dtype=torch.float32, attn_implementation="eager"
    ).cuda()
    for p, n, tokens in zip(prompts(model.config.vocab_size), MAX_TOKENS, ours, strict=True):
        assert_tokens_match_transformers(model, p["prompt_token_ids"], n, tokens)


def test_int4_graphs_equal_eager_and_async_equals_sync(make_tiny, tmp_path):
    int4, _ = write_int4(make_tiny("llama"), tmp_path, "gptq")
    eager = generate(int4, cuda_graphs=False)
    assert generate(int4, cuda_graphs=True) == eager
    sync = generate(int4, "bfloat16", 1.0, async_batching=False)
    assert generate(int4, "bfloat16", 1.0, async_batching=True) == sync


def test_int4_steps_under_the_stream_sanitizer(run_sanitized):
    out = run_sanitized(
        """
import sys
from tandem import LLM, SamplingParams
from tandem.model.tiny import make_tiny_model
folder = make_tiny_model(sys.argv[1], "llama")
llm = LLM(str(folder), dtype="bfloat16", load_format="dummy", quantization="gptq",
          max_model_len=128, max_num_batched_tokens=16, num_blocks=12)
prompts = [{"prompt_token_ids": list(range(3 + 7 * i, 20 + 9 * i))} for i in range(6)]
outs = llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True), use_tqdm=False)
print("ok", sum(len(o.outputs[0].token_ids) for o in outs))
"""
    )
    assert "ok 144" in out
