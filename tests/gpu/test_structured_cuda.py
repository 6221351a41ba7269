"""Structured outputs on the CUDA path: constrained outputs parse through the captured forward
and sampling graphs, graphs == eager and async == sync, the masked steps block on nothing but
the d2h event, and the stream sanitizer finds the mask copies ordered."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import preempting_run
from tandem import LLM, SamplingParams, StructuredOutputsParams
from tandem.runner import Runner

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "tags", "ok"],
}


def params() -> list[SamplingParams]:
    """Constrained rows between free ones, with filters on some: every sampling variant."""
    constraint = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    out = []
    for i in range(8):
        fields = dict(temperature=1.0, seed=i, max_tokens=120)
        if i % 2 == 0:
            fields |= dict(structured_outputs=constraint)
        else:
            fields |= dict(max_tokens=30, ignore_eos=True)
        if i % 4 == 1 or i == 4:
            fields |= dict(top_p=0.9)
        out.append(SamplingParams(**fields))
    return out


def generate(folder, num_blocks=24, **engine_args):
    llm = LLM(str(folder), max_model_len=192, block_size=8, max_num_batched_tokens=32,
              num_blocks=num_blocks, **engine_args)  # fmt: skip
    prompts = [{"prompt_token_ids": list(range(3 + 5 * i, 20 + 7 * i))} for i in range(8)]
    outs = llm.generate(prompts, params(), use_tqdm=False)
    assert llm.engine.allocator.num_free == llm.engine.num_blocks
    for p, out in zip(params(), outs, strict=True):
        completion = out.outputs[0]
        if p.structured_outputs is not None:
            assert completion.finish_reason == "stop", completion.text
            jsonschema.validate(json.loads(completion.text), SCHEMA)
    return llm, [o.outputs[0].token_ids for o in outs]


def test_graphs_equal_eager_and_async_equals_sync_under_constraints(make_tiny, monkeypatch):
    replayed = []
    original = Runner._sample_step

    def recorded(self, batch):
        replayed.append((batch.graphed, batch.use_mask))
        return original(self, batch)

    monkeypatch.setattr(Runner, "_sample_step", recorded)
    folder = make_tiny("qwen3")
    llm, eager = generate(folder, cuda_graphs=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert generate(folder, cuda_graphs=True)[1] == eager
    assert (True, True) in replayed and (True, False) in replayed
    assert generate(folder, cuda_graphs=True, async_batching=False)[1] == eager


def test_masked_steps_block_only_on_the_d2h_event(make_tiny, counted_waits):
    llm = LLM(str(make_tiny("qwen3")), max_model_len=256, max_num_batched_tokens=32,
              num_blocks=64)  # fmt: skip
    llm.generate(["warm the grammar backend up"], params()[0], use_tqdm=False)
    waits = counted_waits
    waits.clear()
    steps_before = llm.engine.num_steps
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = llm.generate([f"prompt {i}" for i in range(8)], params(), use_tqdm=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert sorted(waits) == list(range(steps_before, llm.engine.num_steps))
    assert all(o.outputs[0].finish_reason for o in outs)


def test_the_traced_run_reports_the_mask_wait(make_tiny, tmp_path):
    from tandem.trace import summarize

    llm = LLM(str(make_tiny("qwen3")), max_model_len=256, num_blocks=64)
    llm.engine.start_trace()
    llm.generate([f"prompt {i}" for i in range(8)], params(), use_tqdm=False)
    timeline = llm.engine.stop_trace()
    summary = summarize(timeline.to_chrome_trace({}))
    waits = summary["mask_wait"]
    assert waits["steps"] > 10
    assert 0 <= waits["pct"] < 100 and summary["gpu_active_pct"] > 0


SANITIZED_RUN = preempting_run(
    "qwen3",
    """
    from tandem import StructuredOutputsParams
    constraint = StructuredOutputsParams(regex=r"[0-9]{2,6}(-[a-z]{1,4})?")
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=40,
                             structured_outputs=constraint if i % 2 else None)
              for i in range(6)]
    """,
)


def test_the_mask_copies_are_clean_under_the_stream_sanitizer(run_sanitized):
    lines = run_sanitized(SANITIZED_RUN).splitlines()
    assert [line.split()[:2] for line in lines] == [["ok", "False"], ["ok", "True"]]
