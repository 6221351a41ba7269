"""Every user mistake is a ValueError naming the field and what it allows, raised before anything runs;
the engine keeps serving afterwards."""

from __future__ import annotations

import math
import shutil
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem import LLM, BeamSearchParams, SamplingParams

MAX_LEN = 32
GOOD_PROMPT = "The quick brown fox"
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(make_tiny) -> Path:
    return make_tiny("qwen3")  # its tokenizer adds no BOS, so "" encodes to no tokens


@pytest.fixture(scope="module")
def llm(folder) -> LLM:
    return LLM(str(folder), max_model_len=MAX_LEN, block_size=8)


@cache
def transformers_greedy(folder: Path, prompt_ids: tuple[int, ...], max_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        folder,
        dtype=torch.float32,
        attn_implementation="eager",  # Gemma 2's soft cap
    ).eval()
    out = model.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        max_new_tokens=max_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt_ids) :].tolist()


def assert_names(error: pytest.ExceptionInfo[ValueError], *words: str) -> None:
    message = str(error.value)
    assert all(word in message for word in words), f"{message!r} lacks one of {words}"


def assert_still_serving(llm: LLM, folder: Path) -> None:
    """Nothing of the rejected call was queued, and a good call gives transformers' greedy tokens."""
    assert not llm.engine.has_unfinished()
    assert llm.engine.requests == {}
    [out] = llm.generate(GOOD_PROMPT, GREEDY, use_tqdm=False)
    prompt_ids = tuple(llm.get_tokenizer().encode(GOOD_PROMPT))
    assert out.outputs[0].token_ids == transformers_greedy(folder, prompt_ids, GREEDY.max_tokens)
    assert not llm.engine.has_unfinished()
    assert llm.engine.allocator.num_free == llm.engine.num_blocks


def vocab_size(llm: LLM) -> int:
    return llm.engine.model_config.vocab_size


# ---- sampling parameters ------------------------------------------------------------------------

# (fields, the field the message must name, the allowed range it must state)
BAD_SAMPLING = {
    "temperature_negative": ({"temperature": -0.1}, "temperature", "[0, 2]"),
    "temperature_nan": ({"temperature": math.nan}, "temperature", "[0, 2]"),
    "temperature_inf": ({"temperature": math.inf}, "temperature", "[0, 2]"),
    "temperature_past_2": ({"temperature": 2.5}, "temperature", "[0, 2]"),  # vLLM's bound
    "top_p_zero": ({"top_p": 0.0}, "top_p", "(0, 1]"),
    "top_p_above_one": ({"top_p": 1.01}, "top_p", "(0, 1]"),
    "top_p_nan": ({"top_p": math.nan}, "top_p", "(0, 1]"),
    "top_k_below_minus_one": ({"top_k": -2}, "top_k", "-1"),
    "top_k_float": ({"top_k": 2.5}, "top_k", "integer"),
    "top_k_past_int32": ({"top_k": 2**31}, "top_k", str(2**31 - 1)),
    "min_p_negative": ({"min_p": -0.01}, "min_p", "[0, 1]"),
    "min_p_above_one": ({"min_p": 1.5}, "min_p", "[0, 1]"),
    "max_tokens_zero": ({"max_tokens": 0}, "max_tokens", ">= 1"),
    "min_tokens_above_max_tokens": ({"max_tokens": 4, "min_tokens": 5}, "min_tokens", "max_tokens"),
    "min_tokens_negative": ({"min_tokens": -1}, "min_tokens", ">= 0"),
    "seed_below_int64": ({"seed": -(2**63) - 1}, "seed", str(-(2**63))),
    "seed_above_63_bits": ({"seed": 2**63}, "seed", str(2**63 - 1)),
    "logprobs_below_minus_1": ({"logprobs": -2}, "logprobs", ">= -1"),
    "n_zero": ({"n": 0}, "n must", ">= 1"),
    "stop_empty_string": ({"stop": [""]}, "stop", "non-empty"),
    "stop_bare_empty_string": ({"stop": ""}, "stop", "non-empty"),
    "stop_token_ids_negative": ({"stop_token_ids": [-1]}, "stop_token_ids", ">= 0"),
    "stop_not_a_list": ({"stop": 5}, "stop", "a list of strings"),
    "stop_token_ids_not_a_list": ({"stop_token_ids": 5}, "stop_token_ids", "a list of token ids"),
    "stop_token_ids_a_string": ({"stop_token_ids": "5"}, "stop_token_ids", "a list of token ids"),
    "bad_words_not_a_list": ({"bad_words": 5}, "bad_words", "a list of strings"),
    "max_tokens_past_int32": ({"max_tokens": 2**31}, "max_tokens", str(2**31 - 1)),
    "bad_words_past_1024": ({"bad_words": ["a"] * 1025}, "bad_words", "1024"),
    "bad_words_lone_surrogate": ({"bad_words": ["a \udcff"]}, "bad_words", "UTF-8"),
    # past float32: a zero penalty made NaN logits that won every draw
    "repetition_penalty_under_float32": (
        {"repetition_penalty": 1e-50},
        "repetition_penalty",
        "float32",
    ),
    "repetition_penalty_past_float32": (
        {"repetition_penalty": 1e39},
        "repetition_penalty",
        "float32",
    ),
    "skip_special_tokens_not_bool": ({"skip_special_tokens": 0}, "skip_special_tokens", "True"),
    "ignore_eos_not_bool": ({"ignore_eos": "yes"}, "ignore_eos", "False"),
    "spaces_between_special_tokens_not_bool": (
        {"spaces_between_special_tokens": "no"},
        "spaces_between_special_tokens",
        "True",
    ),
    "spaces_between_special_tokens_false_keeping_specials": (
        {"spaces_between_special_tokens": False, "skip_special_tokens": False},
        "spaces_between_special_tokens",
        "skip_special_tokens=True",
    ),
    "detokenize_not_bool": ({"detokenize": 0}, "detokenize", "True"),
    "truncate_prompt_tokens_zero": ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "-1"),
    "truncate_prompt_tokens_below_minus_one": (
        {"truncate_prompt_tokens": -2},
        "truncate_prompt_tokens",
        ">= 1",
    ),
    "truncate_prompt_tokens_bool": (
        {"truncate_prompt_tokens": True},
        "truncate_prompt_tokens",
        "1",
    ),
}


@pytest.mark.parametrize(("fields", "field", "allowed"), BAD_SAMPLING.values(), ids=BAD_SAMPLING)
def test_sampling_params_reject_out_of_range_values_naming_field_and_range(fields, field, allowed):
    with pytest.raises(ValueError, match=field.split()[0]) as error:
        SamplingParams(**fields)
    assert_names(error, field, allowed)


def test_boundary_sampling_values_are_accepted():
    SamplingParams(temperature=0, top_p=1.0, top_k=-1, min_p=0.0, seed=0, logprobs=0)
    SamplingParams(top_p=1e-6, min_p=1.0, min_tokens=3, max_tokens=3, seed=2**63 - 1, logprobs=20)


def test_a_temperature_below_0_01_samples_at_0_01_as_vllm(llm):
    """vLLM raises a temperature in (0, 0.01) to 0.01 (1e-39 is a float32 denormal: logits / T
    overflowed to inf); 0 stays greedy; True asks for 1 logprob, as vLLM's int fields read it."""
    at = SamplingParams(temperature=0.01, max_tokens=6, ignore_eos=True, seed=1)
    [want] = llm.generate(GOOD_PROMPT, at, use_tqdm=False)
    for temperature in (1e-39, 1e-6, 0.005):
        params = SamplingParams(temperature=temperature, max_tokens=6, ignore_eos=True, seed=1)
        assert params.temperature == 0.01
        [out] = llm.generate(GOOD_PROMPT, params, use_tqdm=False)
        assert out.outputs[0].token_ids == want.outputs[0].token_ids
    assert SamplingParams(temperature=0).temperature == 0
    assert (
        SamplingParams(logprobs=True).logprobs,
        SamplingParams(prompt_logprobs=True).prompt_logprobs,
    ) == (1, 1)


def test_largest_top_k_keeps_the_whole_vocabulary(llm):
    params = SamplingParams(top_k=2**31 - 1, seed=3, max_tokens=4)
    [out] = llm.generate(GOOD_PROMPT, params, use_tqdm=False)
    [unfiltered] = llm.generate(GOOD_PROMPT, SamplingParams(seed=3, max_tokens=4), use_tqdm=False)
    assert out.outputs[0].token_ids == unfiltered.outputs[0].token_ids


def test_largest_seed_is_accepted_with_several_samples_per_prompt(llm):
    params = SamplingParams(n=2, seed=2**63 - 1, max_tokens=3)
    [out] = llm.generate(GOOD_PROMPT, params, use_tqdm=False)
    assert [len(o.token_ids) for o in out.outputs] == [3, 3]


def test_top_k_minus_one_disables_top_k_even_when_set_after_construction(llm, folder):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    params.top_k = -1  # the documented "off" value, so the engine's re-validation must allow it
    [out] = llm.generate(GOOD_PROMPT, params, use_tqdm=False)
    prompt_ids = tuple(llm.get_tokenizer().encode(GOOD_PROMPT))
    assert out.outputs[0].token_ids == transformers_greedy(folder, prompt_ids, 6)


# ---- a rejected generate call queues nothing and the engine keeps serving -----------------------


def too_long(llm: LLM) -> dict[str, Any]:
    return {"prompt_token_ids": [5] * MAX_LEN}  # exactly max_model_len: no room for one token


BAD_PROMPTS = {
    "exactly_max_model_len": (too_long, "max_model_len"),
    "longer_than_max_model_len": (
        lambda llm: {"prompt_token_ids": [5] * (3 * MAX_LEN)},
        "max_model_len",
    ),
    "long_text": (lambda llm: "the cat reads the tokens " * 20, "max_model_len"),
    "empty_text": (lambda llm: "", "empty"),
    "empty_token_list": (lambda llm: {"prompt_token_ids": []}, "empty"),
    "negative_token_id": (lambda llm: {"prompt_token_ids": [1, -1, 2]}, "prompt_token_ids"),
    "token_id_equal_to_vocab": (
        lambda llm: {"prompt_token_ids": [1, vocab_size(llm)]},
        "prompt_token_ids",
    ),
    "float_token_id": (lambda llm: {"prompt_token_ids": [1, 2.0]}, "prompt_token_ids"),
    "string_token_id": (lambda llm: {"prompt_token_ids": [1, "2"]}, "prompt_token_ids"),
    "bool_token_id": (lambda llm: {"prompt_token_ids": [1, True]}, "prompt_token_ids"),
    "dict_without_token_ids": (lambda llm: {"text": "hello"}, "prompt_token_ids"),
    # vLLM's keys tandem has nothing for: dropped, an image would go unseen by the model
    "multi_modal_data": (
        lambda llm: {"prompt": "What is in the picture?", "multi_modal_data": {"image": [0]}},
        "'multi_modal_data', which tandem does not read",
    ),
    "token_type_ids": (
        lambda llm: {"prompt_token_ids": [1, 2], "token_type_ids": [0, 1]},
        "'token_type_ids'",
    ),
}


@pytest.mark.parametrize(("make_prompt", "field"), BAD_PROMPTS.values(), ids=BAD_PROMPTS)
def test_bad_prompt_rejects_the_whole_call_and_the_engine_keeps_serving(
    llm, folder, make_prompt, field
):
    with pytest.raises(ValueError, match=field):
        llm.generate([GOOD_PROMPT, make_prompt(llm)], GREEDY, use_tqdm=False)
    assert_still_serving(llm, folder)


BYTES_CALLS = {
    "generate": lambda llm: llm.generate(b"hi", use_tqdm=False),
    "embed": lambda llm: llm.embed(b"hi", use_tqdm=False),
    "beam_search": lambda llm: llm.beam_search(b"hi", BeamSearchParams(beam_width=2, max_tokens=2)),
}


@pytest.mark.parametrize("call", BYTES_CALLS.values(), ids=BYTES_CALLS)
def test_a_bytes_prompt_is_refused_as_one_prompt_not_read_as_token_ids(llm, folder, call):
    with pytest.raises(ValueError, match="got b'hi'"):
        call(llm)
    assert_still_serving(llm, folder)


SURROGATE_CALLS = {  # each text reaches the tokenizer, whose own error was a TypeError
    "generate": lambda llm: llm.generate([GOOD_PROMPT, "a\ud800b"], GREEDY, use_tqdm=False),
    "chat": lambda llm: llm.chat([{"role": "user", "content": "a\ud800b"}], use_tqdm=False),
    "embed": lambda llm: llm.embed("a\ud800b", use_tqdm=False),
    "score": lambda llm: llm.score("a\ud800b", "c", use_tqdm=False),
    "loglikelihood": lambda llm: llm.loglikelihood(["a\ud800b"], ["c"], use_tqdm=False),
}


@pytest.mark.parametrize("call", SURROGATE_CALLS.values(), ids=SURROGATE_CALLS)
def test_a_lone_surrogate_in_a_text_is_a_value_error_saying_where(llm, folder, call):
    with pytest.raises(ValueError, match=r"holds '\\ud800' at \d+, a lone surrogate"):
        call(llm)
    assert_still_serving(llm, folder)


def test_prompt_too_long_message_says_how_long_a_prompt_may_be(llm):
    with pytest.raises(ValueError, match="max_model_len") as error:
        llm.generate(too_long(llm), GREEDY, use_tqdm=False)
    assert_names(error, f"max_model_len is {MAX_LEN}", f"at most {MAX_LEN - 1} tokens")


def test_numpy_token_ids_are_taken_as_python_ints(llm):
    """Ids of any integer type pass (checked one by one, as Python ints are in bulk) and give
    what the same Python ints give."""
    import numpy as np

    ids = [3, 17, 0, vocab_size(llm) - 1, 42]
    [plain] = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    [typed] = llm.generate({"prompt_token_ids": list(np.array(ids))}, GREEDY, use_tqdm=False)
    assert typed.prompt_token_ids == ids and {type(t) for t in typed.prompt_token_ids} == {int}
    assert typed.outputs[0].token_ids == plain.outputs[0].token_ids


def test_a_torch_tensor_of_token_ids_is_taken_as_its_ints(llm):
    """A 1-D integer tensor gives what its list gives (its items were 0-d tensors, refused)."""
    ids = [3, 17, 0, vocab_size(llm) - 1, 42]
    [plain] = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    [tensor] = llm.generate({"prompt_token_ids": torch.tensor(ids)}, GREEDY, use_tqdm=False)
    assert tensor.prompt_token_ids == ids and {type(t) for t in tensor.prompt_token_ids} == {int}
    assert tensor.outputs[0].token_ids == plain.outputs[0].token_ids


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        (5, "must be a list of token ids, got 5"),  # "'int' object is not iterable" before
        (torch.tensor(5), "must be a list of token ids, got 5"),
        ("5 6 7", "must be a list of token ids, got '5 6 7'"),
        (torch.tensor([[5, 6, 7]]), r"must be integers in \[0, \d+\), got \[5, 6, 7\]"),
        (torch.tensor([5.0, 6.0]), r"must be integers in \[0, \d+\), got 5.0"),
    ],
    ids=["int", "tensor_0d", "text", "tensor_2d", "tensor_float"],
)
def test_prompt_token_ids_of_no_list_of_ids_are_a_value_error(llm, folder, ids, message):
    with pytest.raises(ValueError, match=f"prompt_token_ids {message}"):
        llm.generate([GOOD_PROMPT, {"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
    assert_still_serving(llm, folder)


def test_token_id_out_of_vocab_message_states_the_vocab_range(llm):
    with pytest.raises(ValueError, match="prompt_token_ids") as error:
        llm.generate({"prompt_token_ids": [vocab_size(llm)]}, GREEDY, use_tqdm=False)
    assert_names(error, f"[0, {vocab_size(llm)})", str(vocab_size(llm)))


@pytest.mark.parametrize("async_batching", [False, True], ids=["sync", "async"])
def test_truncate_prompt_tokens_reads_the_prompts_last_tokens_as_vllm_does(folder, async_batching):
    """The tokens of a prompt cut to its last k equal transformers' greedy continuation of those
    k; -1 keeps max_model_len - 1, so a prompt too long for the model still runs."""
    llm = LLM(str(folder), max_model_len=MAX_LEN, block_size=8, async_batching=async_batching)
    ids = list(range(3, 3 + 2 * MAX_LEN))
    for keep, kept in [(5, ids[-5:]), (-1, ids[-(MAX_LEN - 1) :]), (MAX_LEN, ids[:20])]:
        prompt = ids[:20] if keep == MAX_LEN else ids  # k past the prompt's length keeps it all
        params = SamplingParams(temperature=0, max_tokens=1, truncate_prompt_tokens=keep)
        [out] = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        assert out.prompt_token_ids == kept
        assert out.outputs[0].token_ids == transformers_greedy(folder, tuple(kept), 1)
    with pytest.raises(ValueError, match="max_model_len"):  # no truncation: still too long
        llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    past = SamplingParams(max_tokens=1, truncate_prompt_tokens=MAX_LEN + 1)  # vLLM's check
    with pytest.raises(ValueError, match=rf"truncate_prompt_tokens \({MAX_LEN + 1}\) is greater"):
        llm.generate({"prompt_token_ids": ids[:20]}, past, use_tqdm=False)


def test_prompt_one_token_short_of_max_model_len_gets_exactly_one_token(llm):
    [out] = llm.generate({"prompt_token_ids": [5] * (MAX_LEN - 1)}, GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 1
    assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("async_batching", [False, True], ids=["sync", "async"])
def test_max_tokens_past_max_model_len_is_cut_at_max_model_len_not_rejected(folder, async_batching):
    llm = LLM(str(folder), max_model_len=MAX_LEN, block_size=8, async_batching=async_batching)
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    [out] = llm.generate({"prompt_token_ids": [5] * 10}, params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == MAX_LEN - 10
    assert out.outputs[0].finish_reason == "length"


def bad_after_construction(**fields: Any) -> SamplingParams:
    """Params that were valid when made and were then edited into a bad state."""
    params = SamplingParams(temperature=0, max_tokens=6)
    for name, value in fields.items():
        setattr(params, name, value)
    return params


BAD_PARAMS_IN_CALL = {
    "stop_token_id_equal_to_vocab": (
        lambda llm: SamplingParams(stop_token_ids=[vocab_size(llm)]),
        "stop_token_ids",
    ),
    "stop_token_id_far_out_of_vocab": (
        lambda llm: SamplingParams(stop_token_ids=[1, 10**9]),
        "stop_token_ids",
    ),
    "top_p_edited_to_zero": (lambda llm: bad_after_construction(top_p=0.0), "top_p"),
    "temperature_edited_to_nan": (
        lambda llm: bad_after_construction(temperature=math.nan),
        "temperature",
    ),
    "max_tokens_edited_to_zero": (lambda llm: bad_after_construction(max_tokens=0), "max_tokens"),
    "n_edited_to_zero": (lambda llm: bad_after_construction(n=0), "n must"),
}


@pytest.mark.parametrize(
    ("make_params", "field"), BAD_PARAMS_IN_CALL.values(), ids=BAD_PARAMS_IN_CALL
)
def test_bad_sampling_params_for_one_prompt_reject_the_whole_call(llm, folder, make_params, field):
    with pytest.raises(ValueError, match=field) as error:
        llm.generate([GOOD_PROMPT, GOOD_PROMPT], [GREEDY, make_params(llm)], use_tqdm=False)
    if field == "stop_token_ids":
        assert_names(error, f"[0, {vocab_size(llm)})")
    assert_still_serving(llm, folder)


@pytest.mark.parametrize("num_params", [1, 3])
def test_sampling_params_list_of_the_wrong_length_rejects_the_call(llm, folder, num_params):
    with pytest.raises(ValueError, match="sampling_params") as error:
        llm.generate([GOOD_PROMPT, GOOD_PROMPT], [GREEDY] * num_params, use_tqdm=False)
    assert_names(error, f"{num_params} sampling_params", "2 prompts")
    assert_still_serving(llm, folder)


def test_text_prompt_to_a_model_without_tokenizer_asks_for_token_ids(folder, tmp_path):
    bare = tmp_path / "no-tokenizer"
    bare.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(folder / name, bare / name)
    llm = LLM(str(bare), max_model_len=MAX_LEN, block_size=8)
    with pytest.raises(ValueError, match="tokenizer") as error:
        llm.generate(["hello"], GREEDY, use_tqdm=False)
    assert_names(error, "prompt_token_ids")
    assert not llm.engine.has_unfinished()
    [out] = llm.generate({"prompt_token_ids": [1, 2, 3]}, GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == transformers_greedy(folder, (1, 2, 3), GREEDY.max_tokens)


# ---- engine arguments ---------------------------------------------------------------------------

# (engine args, the field the message must name, the allowed range it must state); checked before
# the model folder is read, so a folder that does not exist still gets the ValueError
BAD_ENGINE_ARGS = {
    "block_size_not_power_of_two": ({"block_size": 24}, "block_size", "power of two"),
    "block_size_zero": ({"block_size": 0}, "block_size", ">= 1"),
    "max_num_seqs_zero": ({"max_num_seqs": 0}, "max_num_seqs", ">= 1"),
    "max_num_batched_tokens_zero": (
        {"max_num_batched_tokens": 0},
        "max_num_batched_tokens",
        ">= 1",
    ),
    "num_blocks_zero": ({"num_blocks": 0}, "num_blocks", ">= 1"),
    "max_model_len_zero": ({"max_model_len": 0}, "max_model_len", ">= 1"),
    "gpu_memory_utilization_zero": (
        {"gpu_memory_utilization": 0.0},
        "gpu_memory_utilization",
        "(0, 1]",
    ),
    "gpu_memory_utilization_above_one": (
        {"gpu_memory_utilization": 1.5},
        "gpu_memory_utilization",
        "(0, 1]",
    ),
    "gpu_memory_utilization_string": (
        {"gpu_memory_utilization": "0.5"},
        "gpu_memory_utilization",
        "number",
    ),
    "seed_past_int64": ({"seed": 2**70}, "seed", "<= 9223372036854775807"),
    "seed_float": ({"seed": 1.0}, "seed", "integer"),
    "swap_space_infinite": ({"swap_space": float("inf")}, "swap_space", "finite number"),
    "unknown_dtype": ({"dtype": "float8"}, "dtype", "bfloat16"),
    "unknown_load_format": ({"load_format": "pt"}, "load_format", "'dummy'"),
    "unknown_device": ({"device": "tpu"}, "device", "'cuda'"),
    "unknown_attention_backend": ({"attention_backend": "flash"}, "attention_backend", "'torch'"),
    "enforce_eager_not_bool": ({"enforce_eager": "yes"}, "enforce_eager", "True or False"),
    "trust_remote_code_not_bool": ({"trust_remote_code": 1}, "trust_remote_code", "True or False"),
    "enforce_eager_with_cuda_graphs": (
        {"enforce_eager": True, "cuda_graphs": True},
        "enforce_eager",
        "cuda_graphs=True",
    ),
}


@pytest.mark.parametrize(
    ("args", "field", "allowed"), BAD_ENGINE_ARGS.values(), ids=BAD_ENGINE_ARGS
)
def test_bad_engine_args_are_rejected_before_the_model_is_read(tmp_path, args, field, allowed):
    with pytest.raises(ValueError, match=field) as error:
        LLM(str(tmp_path / "no-such-model"), **args)
    assert_names(error, field, allowed)


def test_engine_seed_none_is_vllms_default_of_zero(folder):
    """vLLM's `seed=None` (before: a TypeError inside the engine's start) samples as seed 0."""
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    outputs = {
        seed: LLM(str(folder), seed=seed, max_model_len=MAX_LEN).generate(
            ["the sky is", "one two"], params, use_tqdm=False
        )
        for seed in (None, 0, 1)
    }
    tokens = {seed: [o.outputs[0].token_ids for o in out] for seed, out in outputs.items()}
    assert tokens[None] == tokens[0] != tokens[1]


def test_cuda_graphs_on_cpu_are_rejected(folder):
    with pytest.raises(ValueError, match="cuda_graphs") as error:
        LLM(str(folder), device="cpu", cuda_graphs=True, max_model_len=MAX_LEN)
    assert_names(error, "device='cuda'")


def test_enforce_eager_turns_cuda_graphs_off_as_in_vllm(folder, monkeypatch):
    """The decision the engine makes on a CUDA device (faked here: the tests have no GPU); vLLM's
    trust_remote_code is taken too (tandem runs no checkpoint code)."""
    llm = LLM(str(folder), max_model_len=MAX_LEN, trust_remote_code=True)
    monkeypatch.setattr(llm.engine, "device", torch.device("cuda"))
    assert llm.engine._use_cuda_graphs()
    monkeypatch.setattr(llm.engine.config, "enforce_eager", True)
    assert not llm.engine._use_cuda_graphs()


def test_max_model_len_above_max_position_embeddings_is_rejected(folder):
    with pytest.raises(ValueError, match="max_model_len") as error:
        LLM(str(folder), max_model_len=2048)
    assert_names(error, "max_model_len=2048", "max_position_embeddings=1024")


def test_kv_cache_smaller_than_max_model_len_is_rejected(folder):
    with pytest.raises(ValueError, match="max_model_len") as error:
        LLM(str(folder), max_model_len=64, block_size=8, num_blocks=7)  # 56 token slots
    assert_names(error, "56 tokens", "max_model_len=64", "num_blocks")


def test_kv_cache_of_exactly_max_model_len_is_accepted(folder):
    llm = LLM(str(folder), max_model_len=64, block_size=8, num_blocks=8, async_batching=False)
    [out] = llm.generate({"prompt_token_ids": [5] * 60}, GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4


def test_two_requests_made_under_one_id_cannot_both_be_queued(llm, folder):
    engine = llm.engine
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    first = engine.make_request("twin", params, prompt_token_ids=[1, 2, 3])
    second = engine.make_request("twin", params, prompt_token_ids=[4, 5])
    engine.enqueue(first)
    with pytest.raises(ValueError, match="already in use"):
        engine.enqueue(second)
    while engine.has_unfinished():
        engine.step()
    assert first.finished and len(first.output_token_ids) == 3  # the queued one is not lost
    assert_still_serving(llm, folder)


@pytest.mark.parametrize("bad", [{"max_tokens": 4}, "greedy", None, 4])
def test_an_entry_of_a_params_list_that_is_not_sampling_params_is_a_type_error_naming_its_index(
    llm, bad
):
    with pytest.raises(TypeError, match=r"sampling_params\[1\] must be a SamplingParams"):
        llm.generate([GOOD_PROMPT, GOOD_PROMPT], [GREEDY, bad], use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_sampling_params_that_are_not_a_list_are_a_type_error(llm):
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams"):
        llm.generate(GOOD_PROMPT, {"max_tokens": 4}, use_tqdm=False)


def test_n_is_capped_at_vllms_limit():
    assert SamplingParams(n=16384).n == 16384  # vLLM's VLLM_MAX_N_SEQUENCES default
    with pytest.raises(ValueError, match="n must be <= 16384, got 16385"):
        SamplingParams(n=16385)


def test_more_samples_than_running_rows_all_come_back_with_the_prompt_computed_once(folder):
    """n past max_num_seqs (and past OpenAI's 128): the samples run in waves, every one returned
    in order, and all but the first find the prompt's full blocks in the cache."""
    llm = LLM(str(folder), max_model_len=MAX_LEN, block_size=8, max_num_seqs=32, num_blocks=512)
    prompt = {"prompt_token_ids": list(range(3, 28))}  # 25 tokens: 3 full blocks
    params = SamplingParams(n=200, max_tokens=3, seed=7, ignore_eos=True)
    [out] = llm.generate(prompt, params, use_tqdm=False)
    assert [c.index for c in out.outputs] == list(range(200))
    assert all(len(c.token_ids) == 3 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # each sample draws its own
    assert llm.engine.stats().prefix_cache_hits == 199 * 24
    assert not llm.engine.has_unfinished()
