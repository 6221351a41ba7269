"""The offline API as a vLLM user's script calls it: prompt forms, SamplingParams and outputs
behave as vLLM documents them, checked against transformers on the same tiny checkpoint."""

from __future__ import annotations

import gc
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tandem import LLM, SamplingParams
from tandem import llm as llm_module
from tandem.sampling import fold_seed
from test_bad_input import transformers_greedy

MAX_LEN = 32
PROMPT = "The quick brown fox"
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(make_tiny) -> Path:
    return make_tiny("qwen3")


@pytest.fixture(scope="module")
def llm(folder) -> LLM:
    return LLM(str(folder), max_model_len=MAX_LEN, block_size=8)


def hf_encode(folder: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)(text)["input_ids"]


def test_a_text_prompt_dict_is_generated_like_its_text(llm, folder):
    [out] = llm.generate({"prompt": PROMPT}, GREEDY, use_tqdm=False)
    prompt_ids = hf_encode(folder, PROMPT)
    assert out.prompt == PROMPT
    assert out.prompt_token_ids == prompt_ids
    assert out.outputs[0].token_ids == transformers_greedy(
        folder, tuple(prompt_ids), GREEDY.max_tokens
    )


def test_vllm_s_top_level_names_are_tandem_s():
    import tandem

    vllm_names = {
        "LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineArgs",
        "AsyncEngineArgs", "AsyncLLMEngine", "TextPrompt", "TokensPrompt", "PromptType",
        "PoolingParams", "BeamSearchParams", "LoRARequest", "StructuredOutputsParams",
    }  # fmt: skip
    assert vllm_names <= set(tandem.__all__)
    assert all(getattr(tandem, name) is not None for name in tandem.__all__)
    with pytest.raises(AttributeError, match="no attribute 'LLMEngine'"):
        tandem.LLMEngine  # noqa: B018


def test_vllm_s_prompt_dicts_and_their_keys_at_nothing_generate_as_plain_prompts(llm):
    from tandem import TextPrompt, TokensPrompt

    [want] = llm.generate(PROMPT, GREEDY, use_tqdm=False)
    ids = want.prompt_token_ids
    prompts = [
        TextPrompt(prompt=PROMPT),
        TokensPrompt(prompt_token_ids=ids),
        {"prompt": PROMPT, "multi_modal_data": None, "mm_processor_kwargs": {}},
        {"prompt_token_ids": ids, "multi_modal_data": {}, "token_type_ids": None},
    ]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [want.outputs[0].token_ids] * 4


def test_text_and_token_prompt_dicts_mix_in_one_call_in_input_order(llm, folder):
    other = "Paged attention"
    other_ids = hf_encode(folder, other)
    prompts = [{"prompt": PROMPT}, {"prompt_token_ids": other_ids}, other]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    expected = [hf_encode(folder, PROMPT), other_ids, other_ids]
    assert [o.prompt_token_ids for o in outs] == expected
    assert [o.outputs[0].token_ids for o in outs] == [
        transformers_greedy(folder, tuple(ids), GREEDY.max_tokens) for ids in expected
    ]


def test_lists_of_token_ids_are_prompts_as_vllm_takes_them(llm, folder):
    """vLLM takes a list of ints as one prompt of token ids, a list of such lists as several."""
    ids = [hf_encode(folder, PROMPT), hf_encode(folder, "Paged attention")]
    want = [transformers_greedy(folder, tuple(i), GREEDY.max_tokens) for i in ids]
    several = llm.generate(ids, GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in several] == ids
    assert [o.outputs[0].token_ids for o in several] == want
    [one] = llm.generate(tuple(ids[1]), GREEDY, use_tqdm=False)
    assert one.outputs[0].token_ids == want[1]
    with pytest.raises(ValueError, match="a list of token ids"):
        llm.generate([[1, "2"]], GREEDY, use_tqdm=False)


@pytest.mark.parametrize("prompt", [{"text": PROMPT}, {"prompt": 3}, 7, None])
def test_a_prompt_of_no_known_form_is_a_value_error_naming_the_forms(llm, prompt):
    with pytest.raises(ValueError, match="prompt_token_ids") as error:
        llm.generate(prompt, GREEDY, use_tqdm=False)
    assert "'prompt'" in str(error.value)
    assert not llm.engine.has_unfinished()


def test_max_tokens_none_generates_until_the_context_is_full_as_in_vllm(llm, folder):
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    [out] = llm.generate(PROMPT, params, use_tqdm=False)
    prompt_ids = hf_encode(folder, PROMPT)
    room = MAX_LEN - len(prompt_ids)
    completion = out.outputs[0]
    assert completion.finish_reason == "length"
    assert completion.token_ids == transformers_greedy(folder, tuple(prompt_ids), room)


def test_clone_is_an_equal_deep_copy_as_vllms():
    params = SamplingParams(stop=["\n"], logit_bias={5: 1.0}, structured_outputs={"regex": "a+"})
    copy = params.clone()
    assert copy == params and copy is not params
    copy.stop.append("!")
    copy.logit_bias[6] = -1.0
    copy.structured_outputs.regex = "b+"
    assert params.stop == ["\n"]
    assert params.logit_bias == {5: 1.0}
    assert params.structured_outputs.regex == "a+"


def test_clone_with_skip_clone_is_a_shallow_copy_as_vllms():
    params = SamplingParams(stop=["\n"], logit_bias={5: 1.0}, skip_clone=True)
    copy = params.clone()
    assert copy == params and copy is not params
    copy.max_tokens = 3  # its own fields
    assert params.max_tokens == 16
    assert copy.stop is params.stop and copy.logit_bias is params.logit_bias  # shared
    with pytest.raises(ValueError, match="skip_clone must be True or False"):
        SamplingParams(skip_clone="yes")


def test_a_completion_output_says_whether_it_finished_as_vllms(llm):
    [out] = llm.generate("Hi", SamplingParams(max_tokens=3), use_tqdm=False)
    assert out.outputs[0].finished() is True
    assert replace(out.outputs[0], finish_reason=None).finished() is False


def test_from_optional_leaves_nones_at_their_defaults_as_vllms():
    params = SamplingParams.from_optional(temperature=None, top_p=0.5, logit_bias={"7": 2.0})
    assert params == SamplingParams(top_p=0.5, logit_bias={7: 2.0})
    assert params.max_tokens == 16
    # vLLM's from_optional passes max_tokens=None on: what the context leaves
    assert SamplingParams.from_optional(max_tokens=None) == SamplingParams(max_tokens=None)


def test_spaces_between_special_tokens_false_skipping_them_changes_nothing_as_in_vllm(llm):
    """vLLM's detokenizer reads the flag only where special tokens are kept."""
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    [want] = llm.generate(PROMPT, params, use_tqdm=False)
    unspaced = SamplingParams(
        temperature=0, max_tokens=5, ignore_eos=True, spaces_between_special_tokens=False
    )
    [out] = llm.generate(PROMPT, unspaced, use_tqdm=False)
    assert out.outputs[0].text == want.outputs[0].text


def test_tokenization_kwargs_truncate_prompts_as_vllm_moved_the_argument_there(llm):
    """vLLM's `tokenization_kwargs={"truncate_prompt_tokens": k}`: the prompt's last k tokens,
    as SamplingParams(truncate_prompt_tokens=k) keeps them; other keys, or two different cuts,
    are ValueErrors."""
    prompt = {"prompt_token_ids": list(range(10, 30))}
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    kwargs = {"tokenization_kwargs": {"truncate_prompt_tokens": 5}}
    [cut] = llm.generate(prompt, greedy, use_tqdm=False, **kwargs)
    [last] = llm.generate({"prompt_token_ids": list(range(25, 30))}, greedy, use_tqdm=False)
    assert cut.prompt_token_ids == list(range(25, 30))
    assert cut.outputs[0].token_ids == last.outputs[0].token_ids
    [chat] = llm.chat([{"role": "user", "content": "hello " * 20}], greedy, use_tqdm=False,
                      **kwargs)  # fmt: skip
    assert len(chat.prompt_token_ids) == 5
    with pytest.raises(ValueError, match="tokenization_kwargs takes truncate_prompt_tokens"):
        llm.generate(prompt, greedy, use_tqdm=False, tokenization_kwargs={"padding": True})
    twice = replace(greedy, truncate_prompt_tokens=3)
    with pytest.raises(ValueError, match="give one"):
        llm.generate(prompt, twice, use_tqdm=False, **kwargs)


def test_detokenize_false_returns_the_same_tokens_and_no_text_as_in_vllm(llm, folder):
    params = SamplingParams(
        temperature=0, max_tokens=5, ignore_eos=True, detokenize=False, logprobs=1
    )
    [out] = llm.generate(PROMPT, params, use_tqdm=False)
    prompt_ids = hf_encode(folder, PROMPT)
    assert out.outputs[0].token_ids == transformers_greedy(folder, tuple(prompt_ids), 5)
    assert out.outputs[0].text == ""
    assert {lp.decoded_token for entry in out.outputs[0].logprobs for lp in entry.values()} == {
        None
    }


def test_from_engine_args_builds_the_llm_the_keywords_build_as_in_vllm(folder):
    from tandem import EngineArgs

    args = EngineArgs(model=str(folder), max_model_len=MAX_LEN, block_size=4)
    llm = LLM.from_engine_args(args)
    assert (llm.engine.config.max_model_len, llm.engine.config.block_size) == (MAX_LEN, 4)
    [out] = llm.generate(PROMPT, GREEDY, use_tqdm=False)
    want = transformers_greedy(folder, tuple(hf_encode(folder, PROMPT)), GREEDY.max_tokens)
    assert out.outputs[0].token_ids == want
    llm.shutdown()
    with pytest.raises(TypeError, match="max_num_seq"):
        EngineArgs(model=str(folder), max_num_seq=8)  # a misspelt setting, as a keyword to LLM
    with pytest.raises(ValueError, match="block_size"):
        LLM.from_engine_args(EngineArgs(model=str(folder), block_size=0))


def test_vllm_s_spaces_between_special_tokens_at_its_default_changes_nothing(llm):
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, skip_special_tokens=False)
    [want] = llm.generate(PROMPT, params, use_tqdm=False)
    params = SamplingParams(
        temperature=0, max_tokens=5, ignore_eos=True, skip_special_tokens=False,
        spaces_between_special_tokens=True,
    )  # fmt: skip
    [out] = llm.generate(PROMPT, params, use_tqdm=False)
    assert (out.outputs[0].token_ids, out.outputs[0].text) == (
        want.outputs[0].token_ids, want.outputs[0].text
    )  # fmt: skip


def test_use_tqdm_takes_a_progress_bar_factory_as_vllm_s(llm):
    import functools
    import io

    from tqdm import tqdm

    shown = io.StringIO()
    bar = functools.partial(tqdm, file=shown, leave=True, mininterval=0)
    outs = llm.generate([PROMPT, PROMPT + " again"], GREEDY, use_tqdm=bar)
    want = llm.generate([PROMPT, PROMPT + " again"], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]
    assert "2/2" in shown.getvalue()  # the factory's bar counted both requests


def test_stop_strings_without_detokenize_are_a_value_error_naming_both():
    with pytest.raises(ValueError, match="detokenize") as error:
        SamplingParams(stop=["\n"], detokenize=False)
    assert "stop" in str(error.value)


def test_chat_joins_openai_text_parts_with_newlines_as_vllm_does(llm, folder):
    """vLLM renders a message whose content is OpenAI's list of text parts as their texts joined
    by newlines; transformers renders that string here as the reference."""
    from transformers import AutoTokenizer

    parts = [{"type": "text", "text": "Red?"}, {"type": "text", "text": "Blue."}]
    [out] = llm.chat([{"role": "user", "content": parts}], GREEDY, use_tqdm=False)
    joined = [{"role": "user", "content": "Red?\nBlue."}]
    expected = AutoTokenizer.from_pretrained(folder).apply_chat_template(
        joined, add_generation_prompt=True, tokenize=True
    )
    if not isinstance(expected, list):  # a BatchEncoding in newer transformers
        expected = expected["input_ids"]
    assert out.prompt_token_ids == expected
    assert out.outputs[0].token_ids == transformers_greedy(folder, tuple(expected), 5)


TOOLS_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m.content or '' }}{% for c in m.tool_calls or [] %}"
    "[{{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}</{{ m.role }}>"
    "{% endfor %}"
)
# iterates the content's parts: OpenAI's content format
PARTS_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'tool' %}T:{{ m.content }}{% else %}"
    "{% for p in m.content %}{{ p.text }}{% endfor %}{% endif %}|{% endfor %}"
)


def test_chat_gives_templates_tool_calls_reasoning_and_tool_results_as_vllm(folder):
    """vLLM hands templates a tool call's JSON arguments as an object ({} for none or for
    text that is no JSON), an
    assistant's `reasoning` as `reasoning_content` too, and a tool's result as text even to a
    template of content parts; transformers renders so prepared messages as the reference."""
    from transformers import AutoTokenizer

    call = {"id": "c1", "type": "function", "function": {"name": "weather"}}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning": "Ask the tool.", "tool_calls": [
            {**call, "function": {"name": "weather", "arguments": '{"city": "Paris"}'}},
            {**call, "function": {"name": "time", "arguments": ""}},
        ]},
        {"role": "tool", "content": "20C", "tool_call_id": "c1"},
    ]  # fmt: skip
    prepared = [
        messages[0],
        {**messages[1], "reasoning_content": "Ask the tool.", "tool_calls": [
            {**call, "function": {"name": "weather", "arguments": {"city": "Paris"}}},
            {**call, "function": {"name": "time", "arguments": {}}},
        ]},
        messages[2],
    ]  # fmt: skip
    hf = AutoTokenizer.from_pretrained(folder)
    llm = LLM(str(folder), max_model_len=256, block_size=8)
    for template, given, want_messages in (
        (TOOLS_TEMPLATE, messages, prepared),
        (PARTS_TEMPLATE, [messages[0], messages[2]], [
            {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
            {"role": "tool", "content": "20C"},
        ]),
    ):  # fmt: skip
        expected = hf.apply_chat_template(
            want_messages, chat_template=template, tokenize=False, add_generation_prompt=False
        )
        [out] = llm.chat(
            given, GREEDY, use_tqdm=False, chat_template=template, add_generation_prompt=False
        )
        assert out.prompt == expected
    no_json = [*messages[:1], {**messages[1], "tool_calls": [
        {**call, "function": {"name": "weather", "arguments": "{city"}}
    ]}]  # fmt: skip
    with pytest.raises(ValueError, match="arguments must be JSON text"):  # vLLM's json.loads
        llm.chat(no_json, GREEDY, use_tqdm=False, chat_template=TOOLS_TEMPLATE)


def test_outputs_built_positionally_read_as_vllms():
    """vLLM's field order: RequestOutput(request_id, prompt, prompt_token_ids, prompt_logprobs,
    outputs, finished, metrics, lora_request, ...), PoolingRequestOutput(request_id, outputs,
    prompt_token_ids, num_cached_tokens, finished)."""
    from tandem.outputs import CompletionOutput, PoolingOutput, PoolingRequestOutput, RequestOutput

    completion = CompletionOutput(0, "a", [5], None, None, "length")
    out = RequestOutput("0", "p", [1, 2], None, [completion], False)
    assert (out.outputs, out.finished, out.prompt_logprobs) == ([completion], False, None)
    assert out.metrics is None and out.kv_transfer_params is None and out.num_cached_tokens == 0
    assert completion.finish_reason == "length" and completion.lora_request is None
    pooled = PoolingRequestOutput("0", PoolingOutput(None), [1], 4, False)
    assert (pooled.num_cached_tokens, pooled.finished) == (4, False)


def test_get_world_size_counts_one_process_without_tensor_parallelism_as_vllm(llm):
    assert llm.get_world_size() == llm.get_world_size(include_dp=False) == 1


def test_get_tokenizer_serves_an_rl_loop_as_transformers_tokenizer_does(llm, folder):
    """A GRPO script renders the prompt with the tokenizer vLLM hands out, generates from its ids
    and decodes the completion; each step gives what transformers' tokenizer gives."""
    from transformers import AutoTokenizer

    reference, tokenizer = AutoTokenizer.from_pretrained(folder), llm.get_tokenizer()
    messages = [{"role": "user", "content": "Hi"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert ids == reference.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    [out] = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    [chat] = llm.chat(messages, GREEDY, use_tqdm=False)
    completion = out.outputs[0].token_ids
    assert completion == chat.outputs[0].token_ids
    for skip in (True, False):
        expected = reference.batch_decode([completion], skip_special_tokens=skip)
        assert tokenizer.batch_decode([completion], skip_special_tokens=skip) == expected
    assert (len(tokenizer), tokenizer.pad_token_id) == (len(reference), reference.pad_token_id)


def test_chat_content_parts_other_than_text_are_a_value_error_naming_the_type(llm):
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    with pytest.raises(ValueError, match="image_url"):
        llm.chat([{"role": "user", "content": [image]}], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize(
    "messages",
    [
        {"role": "user", "content": "Hi"},
        "Hi",
        [[{"role": "user"}], "Hi"],
        [{"role": "user"}, "x"],
        3,
    ],
)
def test_chat_messages_that_are_no_conversation_are_a_type_error(llm, messages):
    with pytest.raises(TypeError, match="messages must be a conversation"):
        llm.chat(messages, GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished()


BAD_MESSAGES = {
    "role_not_a_string": ([{"role": 5, "content": "Hi"}], "role must be a string"),
    "content_a_number": ([{"role": "user", "content": 5}], "content must be a string"),
    "content_a_dict": ([{"role": "user", "content": {"text": "Hi"}}], "content must be a string"),
}


@pytest.mark.parametrize(("messages", "message"), BAD_MESSAGES.values(), ids=BAD_MESSAGES)
def test_chat_message_of_the_wrong_type_is_a_type_error_naming_the_field(llm, messages, message):
    with pytest.raises(TypeError, match=message):
        llm.chat(messages, GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize(
    ("template", "error", "message"),
    [
        ("{% for i in range(10**9) %}x{% endfor %}", ValueError,
         "failed on the messages: OverflowError: Range"),
        ("{{ 1 // 0 }}", ValueError, "failed on the messages: ZeroDivisionError: integer division"),
        (5, TypeError, "chat_template must be Jinja source or None, got 5"),
    ],
    ids=["sandbox_range", "division_by_zero", "not_text"],
)  # fmt: skip
def test_a_chat_template_that_fails_is_a_typed_error_naming_it(llm, template, error, message):
    with pytest.raises(error, match=message):
        llm.chat(
            [{"role": "user", "content": "Hi"}], GREEDY, use_tqdm=False, chat_template=template
        )
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize(
    "tools", ["search", [{"type": "function"}, "search"], {"type": "function"}]
)
def test_chat_tools_that_are_no_list_of_dicts_are_a_type_error(llm, tools):
    with pytest.raises(TypeError, match="tools must be a list of tool dicts"):
        llm.chat([{"role": "user", "content": "Hi"}], GREEDY, use_tqdm=False, tools=tools)


def test_chat_takes_one_conversation_or_a_list_of_them(llm):
    one = [{"role": "user", "content": "Hi"}]
    other = [{"role": "user", "content": "Name a cache."}]
    [single] = llm.chat(one, GREEDY, use_tqdm=False)
    both = llm.chat([one, tuple(other)], GREEDY, use_tqdm=False)
    assert [o.prompt for o in both] == [single.prompt, llm.chat(other, GREEDY, False)[0].prompt]
    assert both[0].outputs[0].token_ids == single.outputs[0].token_ids
    assert llm.chat([], GREEDY, use_tqdm=False) == []


PLAIN_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def test_chat_template_argument_replaces_the_models_as_in_vllm(llm, folder):
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "Hi"}]
    [out] = llm.chat(messages, GREEDY, use_tqdm=False, chat_template=PLAIN_TEMPLATE)
    expected = AutoTokenizer.from_pretrained(folder).apply_chat_template(
        messages, chat_template=PLAIN_TEMPLATE, add_generation_prompt=True, tokenize=False
    )
    assert out.prompt == expected
    assert out.prompt_token_ids == hf_encode(folder, expected)
    # vLLM's order of the arguments: chat_template fifth, its content format sixth
    [positional] = llm.chat(messages, GREEDY, False, None, PLAIN_TEMPLATE, "string")
    assert positional.prompt == expected


def test_a_chat_template_that_does_not_compile_is_a_value_error(llm):
    with pytest.raises(ValueError, match="chat template"):
        llm.chat([{"role": "user", "content": "Hi"}], GREEDY, chat_template="{% for %}")
    assert not llm.engine.has_unfinished()


def test_seed_minus_one_is_no_seed_and_other_negative_seeds_seed_as_in_vllm(llm):
    assert SamplingParams(seed=-1).seed is None
    seeded = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=-7)
    [alone] = llm.generate(PROMPT, seeded, use_tqdm=False)
    beside = llm.generate([PROMPT, "Another prompt"], [seeded, GREEDY], use_tqdm=False)
    assert alone.outputs[0].token_ids == beside[0].outputs[0].token_ids
    assert {fold_seed(-1 - k) for k in range(64)}.isdisjoint(fold_seed(k) for k in range(64))
    assert [fold_seed(k) for k in (0, 7, 2**31 - 1, 2**31)] == [0, 7, 2**31 - 1, -(2**31)]


def test_request_ids_stay_unique_when_several_threads_make_requests(llm):
    """Each generate call takes its ids from one counter; threads switching every microsecond
    (as a server's workers may call generate) never draw the same id twice."""
    import sys
    import threading

    params = [SamplingParams(max_tokens=1)]
    ids: list[str] = []

    def make() -> None:
        for _ in range(300):
            [(base, _group)] = llm._make_requests([{"prompt_token_ids": [1, 2, 3]}], params)
            ids.append(base)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=make) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert len(ids) == 2400 and len(set(ids)) == 2400


def test_extra_args_ride_with_the_request_as_in_vllm(llm):
    """vLLM's SamplingParams.extra_args, for custom sampling code: kept as given (not used by
    the engine's own sampling); anything but a dict is a ValueError naming the field."""
    params = SamplingParams(temperature=0, max_tokens=2, extra_args={"tag": "a", "k": [1, 2]})
    [out] = llm.generate(PROMPT, params, use_tqdm=False)
    [plain] = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    assert params.clone().extra_args == {"tag": "a", "k": [1, 2]}
    with pytest.raises(ValueError, match=r"^extra_args must be a dict"):
        SamplingParams(extra_args=["tag"])


def test_enqueue_then_wait_for_completion_gives_generates_outputs_in_queued_order(llm):
    """vLLM's enqueue / wait_for_completion: enqueue queues without running and returns the
    request ids; wait_for_completion runs everything queued and returns the outputs in the
    order queued, the same tokens as generate; a generate in between runs them too and
    loses none; a bad prompt queues nothing."""
    prompts = [PROMPT, {"prompt_token_ids": [5, 6, 7]}, "Paged attention"]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    sampled = SamplingParams(max_tokens=4, n=2, seed=9, ignore_eos=True)
    [two] = llm.generate(prompts[2], sampled, use_tqdm=False)
    assert llm.wait_for_completion(use_tqdm=False) == []
    steps = llm.engine.num_steps
    first = llm.enqueue(prompts[:2], params)
    assert llm.engine.num_steps == steps and len(first) == 2
    assert all(not r.output_token_ids for r in llm.engine.requests.values())
    second = llm.enqueue(prompts[2], sampled)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.enqueue([PROMPT, {"text": PROMPT}], params)
    [between] = llm.generate(PROMPT, params, use_tqdm=False)  # runs the queued ones too
    assert llm.engine.num_steps > steps and between.outputs[0].token_ids == want[0]
    outs = llm.wait_for_completion(use_tqdm=False)
    assert [o.request_id for o in outs] == first + second
    assert [o.outputs[0].token_ids for o in outs[:2]] == want[:2]
    assert [c.token_ids for c in outs[2].outputs] == [c.token_ids for c in two.outputs]
    assert not llm.engine.has_unfinished() and llm.wait_for_completion(use_tqdm=False) == []
    with pytest.raises(TypeError, match="RequestOutput"):
        llm.wait_for_completion(int)


def test_enqueue_chat_queues_conversations_that_wait_for_completion_answers_as_chat(llm):
    conversations = [[{"role": "user", "content": "Red?"}], [{"role": "user", "content": "Blue"}]]
    want = llm.chat(conversations, GREEDY, use_tqdm=False)
    steps = llm.engine.num_steps
    ids = llm.enqueue_chat(conversations, GREEDY)
    assert len(ids) == 2 and llm.engine.num_steps == steps  # queued, not run
    outs = llm.wait_for_completion(use_tqdm=False)
    assert [o.request_id for o in outs] == ids
    assert [o.prompt_token_ids for o in outs] == [o.prompt_token_ids for o in want]
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]


def test_enqueue_and_enqueue_chat_take_vllm_s_positional_order(llm):
    """vLLM's orders, which are not generate's: enqueue(prompts, sampling_params, lora_request,
    priority, use_tqdm, ...) and enqueue_chat(messages, sampling_params, use_tqdm,
    lora_request, priority, chat_template, ...); a positional priority is the priority."""
    import inspect

    assert list(inspect.signature(llm.enqueue).parameters)[:5] == [
        "prompts", "sampling_params", "lora_request", "priority", "use_tqdm"
    ]  # fmt: skip
    assert list(inspect.signature(llm.enqueue_chat).parameters)[:6] == [
        "messages", "sampling_params", "use_tqdm", "lora_request", "priority", "chat_template"
    ]  # fmt: skip
    with pytest.raises(ValueError, match="1 priorities for 2 prompts"):
        llm.enqueue([PROMPT, PROMPT], GREEDY, None, [0])  # one priority for two prompts
    chat = [[{"role": "user", "content": "Red?"}]] * 2
    with pytest.raises(ValueError, match="1 priorities for 2 prompts"):
        llm.enqueue_chat(chat, GREEDY, False, None, [0])
    assert llm.wait_for_completion(use_tqdm=False) == []  # nothing was queued


def test_a_groups_output_is_built_when_it_finishes_not_when_the_run_ends(llm, monkeypatch):
    """generate builds each prompt's RequestOutput (its Logprob objects) once its samples have
    finished, while the device runs the next step, so the end of a run builds only the last."""
    import tandem.llm

    built_at, original = {}, tandem.llm._request_output

    def recording(request_id, group, text, logprobs_of):
        built_at[request_id] = llm.engine.num_steps
        return original(request_id, group, text, logprobs_of)

    monkeypatch.setattr(tandem.llm, "_request_output", recording)
    lengths = [2, 9, 4, 15]
    params = [SamplingParams(max_tokens=n, ignore_eos=True, n=2, logprobs=1) for n in lengths]
    prompts = [{"prompt_token_ids": [5 + i, 6, 7]} for i in range(4)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[1].token_ids) for o in outs] == lengths  # in input order, whole
    steps = [built_at[o.request_id] for o in outs]
    assert steps[0] < steps[2] < steps[1] < steps[3] == llm.engine.num_steps


def test_sample_logprobs_are_built_step_by_step_each_once(llm, monkeypatch):
    """generate turns each step's new sample logprobs into Logprob objects during the run (while
    the device runs the next step): samples that all end in the last step leave only that
    step's entries to build then; the result equals building all of them at the end."""
    import tandem.llm
    from tandem.outputs import no_text

    built, original = [], tandem.llm.sample_logprobs

    def recording(entries, *args):
        built.append((llm.engine.num_steps, len(entries)))
        return original(entries, *args)

    monkeypatch.setattr(tandem.llm, "sample_logprobs", recording)
    made, make_request = [], llm.engine.make_request

    def keep(*args, **kwargs):
        made.append(make_request(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(llm.engine, "make_request", keep)
    params = SamplingParams(max_tokens=12, ignore_eos=True, n=3, logprobs=2, seed=4)
    outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    assert sum(n for _, n in built) == 3 * 12  # each entry once
    assert len({step for step, _ in built}) >= 10  # step by step, not at the end
    # after the last launch: the last two steps' entries (async: one step in flight)
    assert sum(n for step, n in built if step == llm.engine.num_steps) <= 2 * 3
    for request, sample in zip(made, outs[0].outputs, strict=True):
        whole = original(
            request.logprobs, request.output_token_ids, request.sampled_ranks, 2, no_text
        )
        assert sample.logprobs == whole
        assert [[e.rank for e in d.values()] for d in sample.logprobs] == [
            [e.rank for e in d.values()] for d in whole
        ]


def test_generate_holds_full_garbage_collections_while_it_runs(llm, monkeypatch):
    """A full collection walks every live object (a rollout's logprob entries: pauses longer
    than the step the device has queued): none starts inside generate, however much the
    loop allocates; the young generations are still collected, and the threshold the
    caller set comes back afterwards."""
    collections = []
    gc.callbacks.append(lambda phase, info: phase == "start" and collections.append(info))
    step, kept = llm.engine.step, []

    def allocating_step():
        kept.append([[] for _ in range(20_000)])  # survivors enough for a full collection
        return step()

    monkeypatch.setattr(llm.engine, "step", allocating_step)
    old = gc.get_threshold()
    gc.set_threshold(700, 10, 5)
    try:
        gc.collect()
        collections.clear()
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        llm.generate(["held"] * 2, params, use_tqdm=False)
        during = [c["generation"] for c in collections]
        assert gc.get_threshold() == (700, 10, 5)
        kept.clear()
        collections.clear()
        for _ in range(20):  # the same allocations outside generate do collect in full
            kept.append([[] for _ in range(20_000)])
        after = [c["generation"] for c in collections]
    finally:
        gc.callbacks.pop()
        gc.set_threshold(*old)
    assert 0 in during and 2 not in during
    assert 2 in after


def test_overlapping_generate_loops_restore_the_threshold_when_the_last_ends():
    old = gc.get_threshold()
    gc.set_threshold(700, 10, 7)
    try:
        first, second = llm_module._full_collections_held(), llm_module._full_collections_held()
        first.__enter__()
        second.__enter__()
        first.__exit__(None, None, None)
        assert gc.get_threshold()[2] > 10**6  # the second still runs
        second.__exit__(None, None, None)
        assert gc.get_threshold() == (700, 10, 7)
    finally:
        gc.set_threshold(*old)


def test_generate_leaves_no_cyclic_garbage(llm):
    """What the held full collections rely on: a generate, its steps and its outputs make no
    reference cycles, so nothing waits for a full collection to be freed."""
    params = SamplingParams(n=2, seed=3, max_tokens=24, ignore_eos=True, logprobs=2,
                            prompt_logprobs=1)  # fmt: skip
    llm.generate(["cycles?"] * 3, params, use_tqdm=False)  # warm: first calls may cache things
    gc.collect()
    outputs = llm.generate(["cycles?"] * 3, params, use_tqdm=False)
    del outputs
    assert gc.collect() == 0


def test_vllm_s_sampling_params_module_path_names_the_same_classes():
    """`from vllm.sampling_params import ...` carries over: the classes vLLM's module defines
    that tandem has, the very ones `tandem` exports."""
    import tandem
    from tandem import sampling_params

    for name in ("SamplingParams", "BeamSearchParams", "StructuredOutputsParams"):
        assert getattr(sampling_params, name) is getattr(tandem, name)
    params = sampling_params.SamplingParams(
        max_tokens=2, output_kind=sampling_params.RequestOutputKind.DELTA,
        repetition_detection=sampling_params.RepetitionDetectionParams(
            max_pattern_size=4, min_count=3
        ),
    )  # fmt: skip
    params.validate()


def test_vllm_s_logprobs_and_lora_request_module_paths_name_the_same_classes(llm):
    """`from vllm.logprobs import Logprob` and `from vllm.lora.request import LoRARequest` carry
    over as `tandem.logprobs` and `tandem.lora.request`."""
    import tandem
    from tandem.logprobs import FlatLogprobs, Logprob, LogprobsOnePosition
    from tandem.lora.request import LoRARequest

    assert Logprob is tandem.Logprob and LoRARequest is tandem.LoRARequest
    [out] = llm.generate("Hi", SamplingParams(max_tokens=2, logprobs=1), use_tqdm=False)
    position: LogprobsOnePosition = out.outputs[0].logprobs[0]
    assert all(isinstance(v, Logprob) for v in position.values())
    flat = SamplingParams(max_tokens=2, logprobs=1, flat_logprobs=True)
    [out] = llm.generate("Hi", flat, use_tqdm=False)
    assert isinstance(out.outputs[0].logprobs, FlatLogprobs)


def test_a_lora_request_is_made_without_loading_torch():
    """A client that only builds requests (`tandem.lora.request`, as vLLM's module) stays light."""
    code = (
        "import sys; from tandem.lora.request import LoRARequest; "
        "LoRARequest('a', 1, '/adapters/a'); assert 'torch' not in sys.modules, 'torch loaded'"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


class FinishingRequest:
    """A request as _FinishedGroups reads it, counting the reads of `finished`."""

    reads = 0

    def __init__(self):
        self._finished, self.logprobs = False, None

    @property
    def finished(self) -> bool:
        FinishingRequest.reads += 1
        return self._finished


def test_a_group_of_many_samples_is_built_once_its_last_finishes_in_linear_work(monkeypatch):
    """n up to 16,384: each finished sample is counted once, never the group scanned again (a
    scan per finished sample was n^2: 14.6 s of 8,192 samples' 2-token run on a 2-core CPU)."""
    group = [FinishingRequest() for _ in range(2_000)]
    monkeypatch.setattr(llm_module._FinishedGroups, "_output", lambda self, i: f"group {i}")
    groups = llm_module._FinishedGroups([("r", group)], text=lambda token_id: None)
    for step in range(0, len(group), 100):
        for request in group[step : step + 100]:
            request._finished = True
        groups.add(group[max(0, step - 100) : step + 100])  # the last step's come again
        assert groups.built == ({0: "group 0"} if step + 100 == len(group) else {})
    assert FinishingRequest.reads <= 2 * len(group)  # each read as it comes: no group scans


def test_vllm_s_mm_processor_kwargs_at_nothing_generate_and_others_are_refused(llm):
    """vLLM's per-call mm_processor_kwargs: None or {} generate as without it; options for a
    multi-modal processor a text model lacks are a ValueError naming the argument, on generate,
    chat, enqueue and enqueue_chat alike, and queue nothing. reset_mm_cache() is taken."""
    chat = [{"role": "user", "content": "Red?"}]
    want = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    got = llm.generate(PROMPT, GREEDY, use_tqdm=False, mm_processor_kwargs={})
    assert got[0].outputs[0].token_ids == want
    want_chat = llm.chat(chat, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    got_chat = llm.chat(chat, GREEDY, use_tqdm=False, mm_processor_kwargs=None)
    assert got_chat[0].outputs[0].token_ids == want_chat
    options = {"num_crops": 4}
    for call in (
        lambda: llm.generate(PROMPT, GREEDY, use_tqdm=False, mm_processor_kwargs=options),
        lambda: llm.chat(chat, GREEDY, use_tqdm=False, mm_processor_kwargs=options),
        lambda: llm.enqueue(PROMPT, GREEDY, mm_processor_kwargs=options),
        lambda: llm.enqueue_chat(chat, GREEDY, mm_processor_kwargs=options),
    ):
        with pytest.raises(ValueError, match=r"mm_processor_kwargs=.*num_crops.*text models"):
            call()
    llm.reset_mm_cache()
    assert llm.wait_for_completion(use_tqdm=False) == []
