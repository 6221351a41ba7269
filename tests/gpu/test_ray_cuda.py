"""Ray Data over two GPUs: one engine per GPU, answering as one engine does (run with 2+ GPUs)."""

from __future__ import annotations

import sys

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]
pytest.importorskip("ray.data")

import ray  # noqa: E402
import ray.data  # noqa: E402
from ray import cloudpickle  # noqa: E402

from tandem import LLM, SamplingParams  # noqa: E402
from tandem.ray import LLMPredictor, generate  # noqa: E402

# float32 and the torch attention: a batch's composition cannot flip a near-tie, so the two
# engines' greedy tokens must equal the single engine's exactly
ENGINE_ARGS = {"device": "cuda", "dtype": "float32", "attention_backend": "torch",
               "max_model_len": 256, "max_num_seqs": 16, "gpu_memory_utilization": 0.3}  # fmt: skip
PARAMS = {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True}


class GpuOfRow(LLMPredictor):
    """The predictor, adding the Ray GPU id its actor holds to each row."""

    async def __call__(self, batch):
        out = await super().__call__(batch)
        out["gpu"] = [ray.get_gpu_ids()[0]] * len(out["error"])
        return out


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_gpus=2, include_dashboard=False)
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # GpuOfRow, in the actors
    yield
    ray.shutdown()


def test_two_engines_take_one_gpu_each_and_answer_as_one_engine(local_ray, make_tiny):
    folder = str(make_tiny("llama"))
    prompts = [list(range(10 + 7 * i, 40 + 7 * i)) for i in range(24)]
    rows = [{"prompt_token_ids": p, "sampling_params": PARAMS} for p in prompts]
    ds = ray.data.from_items(rows, override_num_blocks=8)
    out = ds.map_batches(
        GpuOfRow,
        fn_constructor_kwargs={"model": folder, **ENGINE_ARGS},
        batch_size=3,
        compute=ray.data.ActorPoolStrategy(size=2),
        num_gpus=1,
    ).take_all()
    assert {row["gpu"] for row in out} == {0, 1}
    llm = LLM(folder, **ENGINE_ARGS)
    want = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(**PARAMS), use_tqdm=False
    )
    got = {tuple(row["prompt_token_ids"]): list(row["generated_token_ids"]) for row in out}
    assert [got[tuple(p)] for p in prompts] == [w.outputs[0].token_ids for w in want]


def test_generate_reserves_one_gpu_per_engine(local_ray, make_tiny):
    folder = str(make_tiny("llama"))
    rows = [{"prompt": "Hello", "sampling_params": PARAMS}] * 4
    out = generate(ray.data.from_items(rows), folder, concurrency=2, **ENGINE_ARGS).take_all()
    assert all(row["error"] is None and len(row["generated_token_ids"]) == 16 for row in out)
