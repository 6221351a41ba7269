"""Custom logits processors on CUDA: decode steps still replay their forward graphs, their
sampling runs eagerly with the processors; async equals sync; clean under the stream
sanitizer."""

from __future__ import annotations

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.runner import Runner
from test_logits_processors import TARGET, TargetToken

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPTS = [list(range(3 + 5 * i, 20 + 7 * i)) for i in range(6)]


class BlindTarget(TargetToken):
    """TargetToken declaring that it reads no output ids: sampling launched with the forward."""

    @classmethod
    def needs_output_token_ids(cls):
        return False


@pytest.mark.parametrize("processor", [TargetToken, BlindTarget])
def test_graphed_steps_with_processors_give_sync_tokens_and_their_targets(
    make_tiny, monkeypatch, processor
):
    """Forward graphs replayed, sampling eager (launched later where the processor reads output
    ids, with the forward pass where it does not), async tokens equal to sync."""
    launched = []
    launch = Runner.launch

    def record(self, batch, timeline):
        launched.append((batch.graphed, batch.sampling_graphed))
        return launch(self, batch, timeline)

    monkeypatch.setattr(Runner, "launch", record)
    params = [
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=1, max_tokens=16, ignore_eos=True,
                       extra_args={"target_token": TARGET}),
    ]  # fmt: skip
    outs = {}
    for async_batching in (False, True):
        llm = LLM(str(make_tiny("llama")), dtype="float32", max_model_len=128,
                  logits_processors=[processor], async_batching=async_batching)  # fmt: skip
        got = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           [params[i % 2] for i in range(len(PROMPTS))], use_tqdm=False)  # fmt: skip
        outs[async_batching] = [o.outputs[0].token_ids for o in got]
        assert all(key[0] != "sample" for key in llm.engine.runner.graphs)  # none captured
        del llm
    assert outs[True] == outs[False]
    assert all(ids == [TARGET] * 16 for ids in outs[True][1::2])
    assert any(graphed for graphed, _ in launched)  # forward graphs replayed
    assert not any(sampling for _, sampling in launched)  # sampling eager, with the processors


def test_processor_steps_are_clean_under_the_stream_sanitizer(run_sanitized):
    run_sanitized(
        """
import sys
import torch
from tandem import LLM, SamplingParams
from tandem.logits_processors import AdapterLogitsProcessor
from tandem.model.tiny import make_tiny_model

class Only5(AdapterLogitsProcessor):
    def is_argmax_invariant(self):
        return False
    def new_req_logits_processor(self, params):
        def only_5(output_ids, row):
            kept = row[5].clone()
            row.fill_(float("-inf"))
            row[5] = kept
            return row
        return only_5

folder = make_tiny_model(sys.argv[1], "llama")
llm = LLM(str(folder), max_model_len=128, max_num_batched_tokens=16, num_blocks=12,
          logits_processors=[Only5])
params = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
prompts = [{"prompt_token_ids": list(range(3 + 7 * i, 20 + 9 * i))} for i in range(6)]
outs = llm.generate(prompts, params, use_tqdm=False)
assert llm.engine.scheduler.num_preemptions > 0
assert all(o.outputs[0].token_ids == [5] * 20 for o in outs)
print(len(outs))
"""
    )


def test_a_step_abandoned_for_a_processor_error_is_clean_under_the_stream_sanitizer(
    run_sanitized,
):
    """A processor raising in an async decode step's sampling: the step is abandoned (its
    slot's events recorded after its forward pass), its requests aborted; the next call on the
    slot is ordered after it and gives the greedy tokens of the call before the failure."""
    run_sanitized(
        """
import sys
import pytest
from tandem import LLM, SamplingParams
from tandem.logits_processors import AdapterLogitsProcessor
from tandem.model.tiny import make_tiny_model

class RaisesLater(AdapterLogitsProcessor):
    def is_argmax_invariant(self):
        return False
    def new_req_logits_processor(self, params):
        if not (params.extra_args or {}).get("raise"):
            return None
        def fn(output_ids, row):
            if len(output_ids) >= 2:
                raise RuntimeError("the processor failed")
            return row
        return fn

folder = make_tiny_model(sys.argv[1], "llama")
llm = LLM(str(folder), max_model_len=128, num_blocks=64, logits_processors=[RaisesLater])
greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
failing = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, extra_args={"raise": 1})
prompts = [{"prompt_token_ids": list(range(3 + 7 * i, 20 + 9 * i))} for i in range(4)]
before = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
with pytest.raises(RuntimeError, match="the processor failed"):
    llm.generate(prompts, [greedy, failing] * 2, use_tqdm=False)
after = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
assert after == before, (before, after)
assert llm.engine.allocator.num_free == llm.engine.num_blocks
print(len(after))
"""
    )


class BanFirstIds(BlindTarget):
    """Sets the first ids of every row to -inf with `index_fill_` on a device index (assigning
    through the index, `logits[:, ids] = -inf`, synchronizes)."""

    def __init__(self, vllm_config, device, is_pin_memory):
        super().__init__(vllm_config, device, is_pin_memory)
        self.banned = torch.arange(100, device=device)

    def apply(self, logits):
        return logits.index_fill_(1, self.banned, float("-inf"))


class BanFirstIdsReadingOutputs(BanFirstIds):
    @classmethod
    def needs_output_token_ids(cls):
        return True


@pytest.mark.parametrize("processor", [BanFirstIds, BanFirstIdsReadingOutputs])
def test_processor_steps_block_only_on_the_d2h_event(make_tiny, counted_waits, processor):
    """Under sync debug mode "error", with a processor that does not synchronize, the step loop
    still waits only on d2h_done: processors add no wait of the engine's own, whether their
    steps' sampling is launched with the forward pass or after the host's read of the step
    before (that read is the step loop's own wait)."""
    llm = LLM(str(make_tiny("llama")), max_model_len=128, logits_processors=[processor])
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=20, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    llm.generate(prompts, params, use_tqdm=False)  # graphs captured, kernels compiled
    counted_waits.clear()
    steps_before = llm.engine.num_steps
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert sorted(counted_waits) == list(range(steps_before, llm.engine.num_steps))
    assert all(min(o.outputs[0].token_ids) >= 100 for o in outs)  # the ban held


class BanFirstIdsByAssignment(BanFirstIds):
    def apply(self, logits):
        logits[:, self.banned] = float("-inf")  # synchronizes
        return logits


def test_a_processor_that_waits_for_the_device_is_named_in_a_warning(make_tiny, caplog):
    """Each processor's first apply is watched under sync debug mode "warn": the assignment
    through an index tensor is named, index_fill_ is not; the tokens are the same."""
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    outs = {}
    for processor in (BanFirstIdsByAssignment, BanFirstIds):
        caplog.clear()
        llm = LLM(str(make_tiny("llama")), max_model_len=128, logits_processors=[processor])
        got = llm.generate(prompts, params, use_tqdm=False)
        outs[processor] = [o.outputs[0].token_ids for o in got]
        named = [r.getMessage() for r in caplog.records if "waits for the device" in r.getMessage()]
        assert len(named) == (processor is BanFirstIdsByAssignment), named
        assert torch.cuda.get_sync_debug_mode() == 0  # set back
        del llm
    assert outs[BanFirstIdsByAssignment] == outs[BanFirstIds]
