"""Chat messages as vLLM reads them, offline (`LLM.chat`) and served (/tokenize,
/v1/chat/completions): what reaches the chat template is checked against transformers'
rendering of the messages vLLM's parser makes of them (chat_utils.parse_chat_messages); what
vLLM refuses, or takes from the template, is checked by its error."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tandem import LLM, SamplingParams
from tandem.async_llm import AsyncLLM
from tandem.server.app import build_app
from tandem.server.options import ServerOptions
from tandem.tokenizer import Tokenizer, content_format

# writes the documents, then each message's role, tool call id, content (added to text, as
# Llama 3's template adds it: a None or a missing content fails there) and tool calls
TEMPLATE = (
    "{% for d in documents or [] %}<doc {{ d.title }}: {{ d.text }}>{% endfor %}"
    "{% for m in messages %}<{{ m.role }}{% if m.tool_call_id %} {{ m.tool_call_id }}{% endif %}"
    "{{ '>' + m.content }}{% for c in m.tool_calls or [] %}"
    "[{{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}</{{ m.role }}>"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)
USER = {"role": "user", "content": "Hi"}
CALL = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{city"}}
GREEDY = SamplingParams(max_tokens=1, temperature=0)

# a chat vLLM takes, and the messages its parser gives the template
ACCEPTED = {
    "custom_role": (
        [USER, {"role": "ipython", "content": "4"}],
        [USER, {"role": "ipython", "content": "4"}],
    ),
    "developer_role_to_a_template_that_never_names_it": (  # vLLM's renderer makes it a system
        [{"role": "developer", "content": "Be brief.", "name": "d"}, USER],
        [{"role": "system", "content": "Be brief.", "name": "d"}, USER],
    ),
    "tool_without_call_id": (
        [USER, {"role": "tool", "name": "weather", "content": "20C"}],
        [USER, {"role": "tool", "name": "weather", "content": "20C"}],
    ),
    "content_null": (
        [{"role": "user", "content": None}, {"role": "assistant", "content": None}],
        [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}],
    ),
    "content_missing": ([{"role": "user"}], [{"role": "user", "content": ""}]),
    "text_parts_of_every_kind": (
        [{"role": "user", "content": [
            "Hi", {"type": "input_text", "text": "there"}, {"type": "output_text", "text": "again"}
        ]}],
        [{"role": "user", "content": "Hi\nthere\nagain"}],
    ),
    "refusal_part": (
        [USER, {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]}, USER],
        [USER, {"role": "assistant", "content": "No."}, USER],
    ),
    "thinking_part": (
        [USER, {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Greet.", "closed": True}, {"type": "text", "text": "Hi"}
        ]}, USER],
        [USER, {"role": "assistant", "content": "Greet.\nHi"}, USER],
    ),
    "tool_reference_part": (
        [{"role": "user", "content": [{"type": "tool_reference", "name": "weather"}, "Hi"]}],
        [{"role": "user", "content": "weather\nHi"}],
    ),
    "empty_text_parts": (
        [{"role": "user", "content": ["a", {"type": "text", "text": ""}, "", "b"]}],
        [{"role": "user", "content": "a\nb"}],
    ),
    "custom_role_parts_without_text": (
        [USER, {"role": "ipython", "content": [
            {"type": "text", "text": None}, {"type": "text"}, {"type": "refusal", "refusal": None},
            {"type": "thinking"}, {"type": "input_text", "text": None}, "4",
        ]}],
        [USER, {"role": "ipython", "content": "4"}],
    ),
    "tool_call_arguments_json_scalar_and_null": (
        [USER, {"role": "assistant", "content": None, "tool_calls": [
            {**CALL, "function": {"name": "weather", "arguments": "5"}},
            {**CALL, "function": {"name": "weather", "arguments": "null"}},
        ]}],
        [USER, {"role": "assistant", "content": "", "tool_calls": [
            {**CALL, "function": {"name": "weather", "arguments": 5}},
            {**CALL, "function": {"name": "weather", "arguments": {}}},
        ]}],
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def folder(make_tiny) -> Path:
    return make_tiny("llama")


@pytest.fixture(scope="module")
def offline(folder) -> LLM:
    return LLM(str(folder), max_model_len=512, block_size=8)


@pytest.fixture(scope="module")
def served(folder):
    llm = AsyncLLM.from_model(str(folder), max_model_len=512, block_size=8)
    yield llm
    llm.shutdown()


def client_of(llm: AsyncLLM, **options) -> TestClient:
    return TestClient(build_app(llm, "tiny", options=ServerOptions(**options)))


def transformers_text(folder: Path, template: str, messages, **variables) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder).apply_chat_template(
        messages, chat_template=template, add_generation_prompt=True, tokenize=False, **variables
    )


def ids_of(folder: Path, text: str) -> list[int]:
    return Tokenizer.from_dir(folder).encode(text, add_special_tokens=False)


def assert_renders(offline, served, folder: Path, template: str, messages, want: str) -> None:
    """`LLM.chat` renders `messages` with `template` as `want`; the server's /tokenize gives
    its ids."""
    [out] = offline.chat(messages, GREEDY, use_tqdm=False, chat_template=template)
    assert out.prompt == want
    with client_of(served, chat_template=template) as client:
        tokens = client.post("/tokenize", json={"messages": messages}).json()["tokens"]
    assert tokens == ids_of(folder, want)


@pytest.mark.parametrize(("messages", "parsed"), ACCEPTED.values(), ids=ACCEPTED)
def test_chats_vllm_takes_reach_the_template_as_its_parser_gives_them(
    folder, offline, served, messages, parsed
):
    want = transformers_text(folder, TEMPLATE, parsed)
    [out] = offline.chat(messages, GREEDY, use_tqdm=False, chat_template=TEMPLATE)
    assert out.prompt == want
    with client_of(served, chat_template=TEMPLATE) as client:
        tokens = client.post("/tokenize", json={"messages": messages})
        assert tokens.status_code == 200, tokens.text
        assert tokens.json()["tokens"] == ids_of(folder, want)
        chat = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["prompt_tokens"] == len(ids_of(folder, want))


def test_a_content_of_none_is_no_parts_to_a_template_of_parts(folder, offline, served):
    """vLLM reads None as an empty list of parts: [] to a template that loops over parts."""
    template = (
        "{% for m in messages %}{% for p in m.content %}{% endfor %}"
        "{{ m.role }}={{ m.content | tojson }}|{% endfor %}"
    )
    messages = [{"role": "user", "content": None}, {"role": "assistant", "content": "Hi"}]
    want = transformers_text(folder, template, [
        {"role": "user", "content": []},
        {"role": "assistant", "content": [{"type": "text", "text": "Hi"}]},
    ])  # fmt: skip
    assert want == 'user=[]|assistant=[{"type": "text", "text": "Hi"}]|'
    assert_renders(offline, served, folder, template, messages, want)


def test_parts_reach_a_template_of_parts_as_vllm_s_parser_gives_them(folder, offline, served):
    """As parts, vLLM's parser makes a thinking part a text part, keeps a tool_reference part,
    gives a custom role's input_text part without text a None text (and skips its text part
    without text), and joins a tool's text parts, empty ones too."""
    template = (
        "{% for m in messages %}{% for p in m.content %}{% endfor %}"
        "{{ m.role }}={{ m.content | tojson }}|{% endfor %}"
    )
    messages = [
        {"role": "user", "content": [{"type": "tool_reference", "name": "w"}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "A"}]},
        {"role": "tool", "content": ["1", "", "2"]},
        {"role": "ipython", "content": [
            {"type": "input_text", "text": None}, {"type": "text", "text": None}
        ]},
    ]  # fmt: skip
    parsed = [
        {"role": "user", "content": [{"type": "tool_reference", "name": "w"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A"}]},
        {"role": "tool", "content": "1\n\n2"},
        {"role": "ipython", "content": [{"type": "text", "text": None}]},
    ]  # fmt: skip
    want = transformers_text(folder, template, parsed)
    assert 'tool="1\\n\\n2"|ipython=[{"type": "text", "text": null}]|' in want
    assert_renders(offline, served, folder, template, messages, want)


def test_a_text_part_without_text_is_skipped_offline_and_a_400_on_openai_roles_served(
    folder, offline, served
):
    """vLLM's parser skips a text part whose text is null (LLM.chat takes the chat); its
    server's request validation refuses such a part on a message of OpenAI's roles first."""
    messages = [{"role": "user", "content": [{"type": "text", "text": None}, "Hi"]}]
    [out] = offline.chat(messages, GREEDY, use_tqdm=False, chat_template=TEMPLATE)
    assert out.prompt == transformers_text(folder, TEMPLATE, [USER])
    with client_of(served, chat_template=TEMPLATE) as client:
        for path, body in (
            ("/tokenize", {"messages": messages}),
            ("/v1/chat/completions", {"messages": messages, "max_tokens": 1}),
        ):
            answer = client.post(path, json=body)
            assert answer.status_code == 400, answer.text
            assert answer.json()["error"]["param"] == "messages.0"
            assert "text part of a user message needs its text" in answer.text


def test_tool_calls_of_messages_not_the_assistants_are_dropped_as_vllm_s_parser_drops_them(
    folder, served
):
    """vLLM's parser copies the tool calls of an assistant's message alone: on any other
    role's message they are never read, whatever their shape."""
    messages = [
        {"role": "system", "content": "Be brief.", "tool_calls": [CALL]},
        {**USER, "tool_calls": [{"function": "not a call"}]},
        {"role": "tool", "tool_call_id": "c1", "content": "20C", "tool_calls": [CALL]},
    ]
    parsed = [{k: v for k, v in m.items() if k != "tool_calls"} for m in messages]
    want = ids_of(folder, transformers_text(folder, TEMPLATE, parsed))
    with client_of(served, chat_template=TEMPLATE) as client:
        tokens = client.post("/tokenize", json={"messages": messages})
        assert tokens.status_code == 200, tokens.text
        assert tokens.json()["tokens"] == want
        chat = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["prompt_tokens"] == len(want)


# writes each message's keys in order, each with its value (nested keys sorted)
KEYS_TEMPLATE = (
    "{% for m in messages %}{% for key, value in m.items() %}"
    "{{ key }}={{ value | tojson(sort_keys=true) }};{% endfor %}|{% endfor %}"
)
# the same, naming the developer role: its messages reach it as developer messages
DEVELOPER_KEYS_TEMPLATE = KEYS_TEMPLATE + "{% if messages[0].role == 'developer' %}!{% endif %}"
TOOL = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
JSON_CALL = {
    "id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "P"}'}
}  # fmt: skip


def test_only_the_fields_vllm_s_parser_reads_for_a_role_reach_the_template(folder, offline, served):
    """vLLM's parser gives a template a message's role and content, any role's name, an
    assistant's tool calls (none when empty) and reasoning (under both names), a tool's
    tool_call_id and a developer's tools (None without); a field of another role, or one no
    role has, never reaches it."""
    messages = [
        {"role": "system", "content": "Be brief.", "tool_call_id": "c0", "reasoning": "no"},
        {"role": "user", "content": "Weather?", "name": "ann", "tool_call_id": "c0",
         "reasoning": "no", "tool_calls": [JSON_CALL], "metadata": {"k": "v"}},
        {"role": "assistant", "content": "", "name": "bot", "reasoning": "Ask.",
         "tool_call_id": "c0", "tool_calls": [JSON_CALL], "annotations": []},
        {"role": "tool", "content": "20C", "name": "weather", "tool_call_id": "c1",
         "reasoning": "no"},
        {"role": "assistant", "content": "Sunny.", "tool_calls": []},
        {"role": "ipython", "content": "4", "name": "py", "tool_call_id": "c2"},
        {"role": "developer", "content": "Use tools."},
    ]  # fmt: skip
    call = {**JSON_CALL, "function": {"name": "weather", "arguments": {"city": "P"}}}
    parsed = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?", "name": "ann"},
        {"role": "assistant", "content": "", "tool_calls": [call], "reasoning": "Ask.",
         "reasoning_content": "Ask.", "name": "bot"},
        {"role": "tool", "content": "20C", "tool_call_id": "c1", "name": "weather"},
        {"role": "assistant", "content": "Sunny."},
        {"role": "ipython", "content": "4", "name": "py"},
        {"role": "developer", "content": "Use tools.", "tools": None},
    ]  # fmt: skip
    want = transformers_text(folder, DEVELOPER_KEYS_TEMPLATE, parsed)
    assert 'role="tool";content="20C";tool_call_id="c1";name="weather";|' in want
    assert_renders(offline, served, folder, DEVELOPER_KEYS_TEMPLATE, messages, want)


def test_reasoning_content_is_read_as_reasoning_by_the_server_alone_as_in_vllm(
    folder, offline, served
):
    """vLLM's server renames an assistant's reasoning_content to reasoning where reasoning is
    null; its parser, which LLM.chat calls directly, reads reasoning alone."""
    messages = [
        USER,
        {"role": "assistant", "content": "A", "reasoning_content": "r"},
        USER,
        {"role": "assistant", "content": "B", "reasoning": "s", "reasoning_content": "t"},
    ]
    both = {"reasoning": "s", "reasoning_content": "s"}
    offline_parsed = [
        USER, {"role": "assistant", "content": "A"}, USER, {**messages[3], **both}
    ]  # fmt: skip
    served_parsed = [*offline_parsed]
    served_parsed[1] = {**offline_parsed[1], "reasoning": "r", "reasoning_content": "r"}
    [out] = offline.chat(messages, GREEDY, use_tqdm=False, chat_template=KEYS_TEMPLATE)
    assert out.prompt == transformers_text(folder, KEYS_TEMPLATE, offline_parsed)
    want = transformers_text(folder, KEYS_TEMPLATE, served_parsed)
    with client_of(served, chat_template=KEYS_TEMPLATE) as client:
        tokens = client.post("/tokenize", json={"messages": messages})
    assert tokens.status_code == 200, tokens.text
    assert tokens.json()["tokens"] == ids_of(folder, want)


def test_a_developer_s_tools_and_any_role_s_task_reach_the_template_as_vllm_s_parser_gives_them(
    folder, offline, served
):
    """vLLM's parser gives a developer message its tools, and any message its task (DeepSeek
    V4's marker) and name where they are strings; offline, a name or task of another type is
    left out (the server's validation refuses it)."""
    messages = [
        {"role": "developer", "content": "D", "tools": [TOOL], "task": "plan"},
        {"role": "user", "content": "Hi", "task": "chat"},
    ]
    parsed = [
        {"role": "developer", "content": "D", "task": "plan", "tools": [TOOL]},
        {"role": "user", "content": "Hi", "task": "chat"},
    ]
    want = transformers_text(folder, DEVELOPER_KEYS_TEMPLATE, parsed)
    assert want.endswith("|!")
    assert_renders(offline, served, folder, DEVELOPER_KEYS_TEMPLATE, messages, want)
    not_strings = [{"role": "user", "content": "Hi", "name": 5, "task": 7}]
    [out] = offline.chat(not_strings, GREEDY, use_tqdm=False, chat_template=KEYS_TEMPLATE)
    assert out.prompt == transformers_text(folder, KEYS_TEMPLATE, [USER])


def test_developer_messages_merge_into_the_first_system_message_where_the_template_never_names_the_role(
    folder, offline, served
):
    """vLLM's renderer, for a template without the developer role: each developer message is a
    system message without its tools, and system messages anywhere but first are merged into
    one first message, their texts joined by a blank line (a message of parts by lines)."""
    messages = [
        {"role": "system", "content": "A", "name": "s"},
        {"role": "user", "content": "Hi"},
        {"role": "developer", "content": "B", "tools": [TOOL]},
        {"role": "assistant", "content": "Yes"},
        {"role": "developer", "content": ["C", {"type": "text", "text": "D"}]},
        {"role": "developer", "content": ""},
    ]
    parsed = [
        {"role": "system", "content": "A\n\nB\n\nC\nD"},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Yes"},
    ]
    want = transformers_text(folder, KEYS_TEMPLATE, parsed)
    assert_renders(offline, served, folder, KEYS_TEMPLATE, messages, want)
    # one developer message first: a system message, kept whole but for its tools
    alone = [{"role": "developer", "content": "B", "tools": [TOOL], "task": "plan"}, USER]
    want = transformers_text(
        folder, KEYS_TEMPLATE, [{"role": "system", "content": "B", "task": "plan"}, USER]
    )
    assert_renders(offline, served, folder, KEYS_TEMPLATE, alone, want)


def test_a_text_part_s_unknown_fields_reach_a_template_of_parts_offline_as_in_vllm(
    folder, offline, served
):
    """vLLM's parser keeps the fields of a text part that no part type of its declares
    (cache_control, a thinking part's signature) on the text part it makes; its server's
    request validation drops them first, as tandem's does."""
    template = (
        "{% for m in messages %}{% for p in m.content %}{{ p | tojson(sort_keys=true) }};"
        "{% endfor %}|{% endfor %}"
    )
    cache = {"type": "ephemeral"}
    messages = [
        {"role": "user", "content": [
            {"type": "text", "text": "Hi", "cache_control": cache},
            {"type": "input_text", "text": "there", "prompt_cache_breakpoint": {"mode": "explicit"}},
        ]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "T", "closed": True, "signature": "sig"},
            {"type": "refusal", "refusal": "No.", "cache_control": cache},
        ]},
    ]  # fmt: skip
    parts = [
        [{"type": "text", "text": "Hi", "cache_control": cache}, {"type": "text", "text": "there"}],
        [{"type": "text", "text": "T", "signature": "sig"},
         {"type": "text", "text": "No.", "cache_control": cache}],
    ]  # fmt: skip
    roles = ("user", "assistant")
    parsed = [{"role": r, "content": p} for r, p in zip(roles, parts, strict=True)]
    [out] = offline.chat(messages, GREEDY, use_tqdm=False, chat_template=template)
    assert out.prompt == transformers_text(folder, template, parsed)
    validated = [{"role": r, "content": [{"type": "text", "text": t["text"]} for t in p]}
                 for r, p in zip(roles, parts, strict=True)]  # fmt: skip
    with client_of(served, chat_template=template) as client:
        tokens = client.post("/tokenize", json={"messages": messages})
    assert tokens.status_code == 200, tokens.text
    assert tokens.json()["tokens"] == ids_of(folder, transformers_text(folder, template, validated))


@pytest.mark.parametrize(
    "call",
    [CALL, "weather", {**CALL, "type": "code"}, {**CALL, "function": "weather"}],
    ids=["arguments_no_json", "no_object", "not_a_function", "function_no_object"],
)
def test_tool_calls_vllm_s_parser_refuses_are_a_value_error_and_a_400(offline, served, call):
    """vLLM's _postprocess_messages: arguments of no JSON, a call that is no function call."""
    messages = [USER, {"role": "assistant", "content": "", "tool_calls": [call]}]
    with pytest.raises(ValueError, match=r"tool.call"):
        offline.chat(messages, GREEDY, use_tqdm=False, chat_template=TEMPLATE)
    with client_of(served, chat_template=TEMPLATE) as client:
        answer = client.post("/tokenize", json={"messages": messages})
    assert answer.status_code == 400, answer.text


def test_an_assistant_s_tool_calls_that_are_no_list_are_a_type_error(offline):
    messages = [USER, {"role": "assistant", "content": "", "tool_calls": JSON_CALL}]
    with pytest.raises(TypeError, match="tool_calls must be a list of tool calls"):
        offline.chat(messages, GREEDY, use_tqdm=False, chat_template=KEYS_TEMPLATE)


def test_documents_reach_the_template_over_a_template_variable_of_that_name(folder, served):
    """vLLM's `documents` field is the template's `documents`, as transformers passes them;
    without it the template reads None, as from transformers."""
    documents = [{"title": "Caches", "text": "KV blocks."}]
    want = transformers_text(folder, TEMPLATE, [USER], documents=documents)
    assert "<doc Caches: KV blocks.>" in want
    with client_of(served, chat_template=TEMPLATE) as client:
        body = {"messages": [USER], "max_tokens": 1, "documents": documents}
        chat = client.post("/v1/chat/completions", json=body)
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["prompt_tokens"] == len(ids_of(folder, want))
        other = {"documents": [{"title": "Other", "text": "Text."}]}
        chat = client.post("/v1/chat/completions", json={**body, "chat_template_kwargs": other})
        assert chat.json()["usage"]["prompt_tokens"] == len(ids_of(folder, want))
    unset = "{{ documents is none }}"
    rendered = Tokenizer.from_dir(folder).apply_chat_template(
        [USER], chat_template=unset, tokenize=False
    )
    assert rendered == transformers_text(folder, unset, [USER]) == "True"


FAILING_TEMPLATES = {
    "KeyError": "{{ '{a}'.format(b=1) }}",
    "IndexError": "{{ '{0}{1}'.format(messages[0].content) }}",
    "RecursionError": "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
}


@pytest.mark.parametrize(("error", "template"), FAILING_TEMPLATES.items(), ids=FAILING_TEMPLATES)
def test_any_exception_of_a_template_is_a_value_error_and_a_400(
    folder, offline, served, error, template
):
    """vLLM's safe_apply_chat_template: whatever the template raises is a ValueError, a 400."""
    message = f"chat template failed on the messages: {error}"
    with pytest.raises(ValueError, match=message):
        Tokenizer.from_dir(folder).apply_chat_template([USER], chat_template=template)
    with pytest.raises(ValueError, match=message):
        offline.chat([USER], GREEDY, use_tqdm=False, chat_template=template)
    with client_of(served, trust_request_chat_template=True) as client:
        body = {"messages": [USER], "chat_template": template}
        for path, request in (
            ("/v1/chat/completions", {**body, "max_tokens": 1}),
            ("/tokenize", body),
        ):
            answer = client.post(path, json=request)
            assert answer.status_code == 400, answer.text
            assert answer.json()["error"]["param"] == "messages"
            assert message in answer.json()["error"]["message"]
        assert client.get("/health").status_code == 200


# templates, and the content format vLLM's _detect_content_format reads from them
DETECTED = {
    "filtered_loop": (
        "{% for m in messages %}{% for p in m.content | selectattr('type', 'equalto', 'text') %}"
        "{% endfor %}{% endfor %}",
        "openai",
    ),
    "sliced_loop": (
        "{% for m in messages %}{% for p in m['content'][1:] %}{% endfor %}{% endfor %}",
        "openai",
    ),
    "loop_over_set_messages": (
        "{% set loop_messages = messages | reverse %}{% for m in loop_messages %}"
        "{% for p in m.content %}{% endfor %}{% endfor %}",
        "openai",
    ),
    "loop_over_set_content": (
        "{% for m in messages %}{% set c = m['content'] %}{% for p in c %}{% endfor %}{% endfor %}",
        "string",
    ),
    "loop_over_one_message_s_content": (
        "{% for p in messages[0].content %}{% endfor %}",
        "string",
    ),
    "messages_set_into_a_namespace": (  # vLLM's detection asserts a plain name: its default
        "{% set ns = namespace() %}{% set ns.m = messages %}"
        "{% for m in messages %}{% for p in m.content %}{% endfor %}{% endfor %}",
        "string",
    ),
    "messages_unpacked": (
        "{% for i, m in messages %}{% for p in m.content %}{% endfor %}{% endfor %}",
        "string",
    ),
}


@pytest.mark.parametrize(("source", "expected"), DETECTED.values(), ids=DETECTED)
def test_auto_detects_the_content_format_as_vllm(source, expected):
    assert content_format(source) == expected


def test_a_filtered_loop_over_parts_gets_parts_as_in_vllm(folder, offline, served):
    template = (
        "{% for m in messages %}{% if m.content is string %}S:{{ m.content }}{% else %}"
        "{% for p in m.content | selectattr('type', 'equalto', 'text') %}P:{{ p.text }};"
        "{% endfor %}{% endif %}{% endfor %}"
    )
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    messages = [{"role": "user", "content": parts}]
    want = transformers_text(folder, template, messages)
    assert want == "P:a;P:b;"
    assert_renders(offline, served, folder, template, messages, want)


def test_truncation_side_is_left_or_right_and_any_other_is_a_400(served):
    """vLLM's truncation_side: "left" keeps the prompt's last tokens, "right" its first
    (tests/test_truncation_side.py checks which); another value is a 400 naming it."""
    body = {"messages": [USER], "max_tokens": 1, "truncate_prompt_tokens": 3}
    with client_of(served) as client:
        for side in ("left", "right"):
            kept = client.post("/v1/chat/completions", json={**body, "truncation_side": side})
            assert kept.status_code == 200, kept.text
            assert kept.json()["usage"]["prompt_tokens"] == 3
        middle = client.post("/v1/chat/completions", json={**body, "truncation_side": "middle"})
        assert middle.status_code == 400 and middle.json()["error"]["param"] == "truncation_side"


def test_the_requests_reasoning_effort_wins_over_a_template_variable_of_that_name():
    """As vLLM's: the request field over chat_template_kwargs' key; enable_thinking follows it
    unless chat_template_kwargs sets it."""
    from tandem.server.protocol import ChatCompletionRequest

    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}
    both = ChatCompletionRequest(
        **body, reasoning_effort="high", chat_template_kwargs={"reasoning_effort": "low"}
    )
    assert both.template_kwargs() == {"enable_thinking": True, "reasoning_effort": "high"}
    off = ChatCompletionRequest(
        **body, reasoning_effort="none", chat_template_kwargs={"enable_thinking": True}
    )
    assert off.template_kwargs() == {"enable_thinking": True, "reasoning_effort": "none"}
