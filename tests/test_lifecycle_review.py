"""Request lifecycle: what a rejected or interrupted call leaves behind, and requests the engine
cannot honour refused up front."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tandem import LLM, SamplingParams

ENGINE_ARGS = {"max_model_len": 64, "block_size": 8}
PROMPT = "The quick brown fox"
SAMPLED = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)  # no seed: drawn
modes = pytest.mark.parametrize("async_batching", [False, True], ids=["sync", "async"])


@pytest.fixture(scope="module")
def folder(make_tiny) -> str:
    return str(make_tiny("llama"))


def token_ids(outputs) -> list[list[int]]:
    return [o.token_ids for out in outputs for o in out.outputs]


def test_a_rejected_call_leaves_the_seeds_of_later_unseeded_requests_unchanged(folder):
    expected = LLM(folder, **ENGINE_ARGS).generate([PROMPT, PROMPT], SAMPLED, use_tqdm=False)
    llm = LLM(folder, **ENGINE_ARGS)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([PROMPT, PROMPT, {"prompt_token_ids": []}], SAMPLED, use_tqdm=False)
    outputs = llm.generate([PROMPT, PROMPT], SAMPLED, use_tqdm=False)
    assert token_ids(outputs) == token_ids(expected)


@modes
def test_an_interrupted_generate_leaves_no_request_to_run_in_the_next_call(
    folder, async_batching, monkeypatch
):
    llm = LLM(folder, async_batching=async_batching, **ENGINE_ARGS)
    step, calls = llm.engine.step, []

    def interrupted_step():
        calls.append(None)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(llm.engine, "step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([PROMPT] * 3, SamplingParams(max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert llm.engine.requests == {} and not llm.engine.scheduler.has_work()
    assert llm.engine.allocator.num_free == llm.engine.num_blocks

    updated_ids = set()

    def recording_step():
        updated = step()
        updated_ids.update(r.request_id for r in updated)
        return updated

    monkeypatch.setattr(llm.engine, "step", recording_step)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    [out] = llm.generate(PROMPT, greedy, use_tqdm=False)
    assert updated_ids == {out.request_id}
    [fresh] = LLM(folder, **ENGINE_ARGS).generate(PROMPT, greedy, use_tqdm=False)
    assert token_ids([out]) == token_ids([fresh])
    assert not llm.engine.has_unfinished()


def test_stop_strings_on_a_model_without_tokenizer_are_rejected_not_ignored(folder, tmp_path):
    bare = tmp_path / "no-tokenizer"
    bare.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(Path(folder) / name, bare / name)
    llm = LLM(str(bare), **ENGINE_ARGS)
    with_stop = SamplingParams(temperature=0, max_tokens=8, stop=["a"])
    with pytest.raises(ValueError, match="stop") as error:
        llm.generate({"prompt_token_ids": [1, 2, 3]}, with_stop, use_tqdm=False)
    assert "stop_token_ids" in str(error.value)
    assert not llm.engine.has_unfinished()


def test_max_model_len_of_one_is_rejected_as_it_leaves_no_room_for_an_output_token(folder):
    with pytest.raises(ValueError, match="max_model_len") as error:
        LLM(folder, max_model_len=1)
    assert ">= 2" in str(error.value)


def test_chat_messages_the_template_cannot_render_are_a_value_error(folder):
    """A message without a role; one without content is "" to the template, as vLLM's parser
    makes it (test_chat_messages.py). A string is no conversation: a TypeError
    (test_offline_api.py)."""
    llm = LLM(folder, **ENGINE_ARGS)
    with pytest.raises(ValueError, match="chat template"):
        llm.chat([{"content": "hello"}], use_tqdm=False)
    assert not llm.engine.has_unfinished()
