"""Tokenizer and IncrementalDetokenizer, checked against transformers' AutoTokenizer."""

from __future__ import annotations

import json
import shutil
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from tandem.model.tiny import CHAT_TEMPLATE, IM_END, IM_START
from tandem.tokenizer import IncrementalDetokenizer, Tokenizer, decode_after

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
TEXTS = [
    "",
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "café naïve Zürich 日本 東京 🙂 ✓",
    "語彙 is not in the corpus, nor is Ελληνικά or русский.",
    "e\u0301 and é look alike but differ before NFC",
    f"{IM_START}user\nHi there!{IM_END}\n{IM_START}assistant\n",
    "<|begin_of_text|> in the middle <|end_of_text|>",
    "  leading spaces\n\n\ttabs\r\nand 1234567 digits, it's we'll THEY'RE",
    "def add(a, b):\n    return a + b  # 3.5% of $1,234.56",
]
CHATS = [
    [{"role": "user", "content": "Hi café"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 日本?"},
        {"role": "assistant", "content": "Japan."},
        {"role": "user", "content": "Thanks"},
    ],
]


@cache
def hf_tokenizer(folder: Path) -> Any:
    return AutoTokenizer.from_pretrained(folder)


def variant(source: Path, dest: Path, drop_template: bool = False, **config: Any) -> Path:
    """Copy a model folder, update its tokenizer_config.json, optionally without the .jinja."""
    shutil.copytree(source, dest)
    config_file = dest / "tokenizer_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **config}))
    if drop_template:
        (dest / "chat_template.jinja").unlink()
    return dest


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(make_tiny, arch, add_special_tokens):
    folder = make_tiny(arch)
    ours, reference = Tokenizer.from_dir(folder), hf_tokenizer(folder)
    for text in TEXTS:
        expected = reference(text, add_special_tokens=add_special_tokens).input_ids
        assert ours.encode(text, add_special_tokens=add_special_tokens) == expected, text


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_llama_style_prepends_bos_and_qwen_style_does_not(make_tiny, arch):
    tokenizer = Tokenizer.from_dir(make_tiny(arch))
    ids = tokenizer.encode("Hello")
    assert (ids[0] == tokenizer.bos_token_id) == (arch == "llama")
    assert tokenizer.encode("Hello", add_special_tokens=False) == ids[(arch == "llama") :]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_transformers(make_tiny, arch, skip_special_tokens):
    folder = make_tiny(arch)
    ours, reference = Tokenizer.from_dir(folder), hf_tokenizer(folder)
    for text in TEXTS:
        ids = ours.encode(text)
        expected = reference.decode(ids, skip_special_tokens=skip_special_tokens)
        assert ours.decode(ids, skip_special_tokens=skip_special_tokens) == expected


@pytest.mark.parametrize("arch", ARCHS)
def test_vocab_size_and_special_ids_match_transformers(make_tiny, arch):
    folder = make_tiny(arch)
    ours, reference = Tokenizer.from_dir(folder), hf_tokenizer(folder)
    assert ours.vocab_size == reference.vocab_size < len(ours)
    assert ours.bos_token_id == reference.bos_token_id
    assert ours.eos_token_id == reference.eos_token_id
    assert set(reference.all_special_ids) <= set(ours.all_special_ids)
    for token_id in ours.all_special_ids:
        assert ours.decode([token_id], skip_special_tokens=True) == ""


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_calling_the_tokenizer_gives_what_transformers_gives(make_tiny, arch, add_special_tokens):
    folder = make_tiny(arch)
    ours, reference = Tokenizer.from_dir(folder), hf_tokenizer(folder)
    for text in (TEXTS[2], TEXTS[:4]):
        expected = reference(text, add_special_tokens=add_special_tokens)
        encoding = ours(text, add_special_tokens=add_special_tokens)
        assert encoding == dict(expected)
        assert encoding.input_ids == expected.input_ids
        assert encoding.attention_mask == expected.attention_mask


def test_calling_the_tokenizer_on_what_is_not_text_raises_type_error(make_tiny):
    tokenizer = Tokenizer.from_dir(make_tiny("qwen2"))
    for text in (None, 42, [1, 2], ["a", None]):
        with pytest.raises(TypeError, match="text must be"):
            tokenizer(text)
    with pytest.raises(AttributeError):
        _ = tokenizer("a").token_type_ids


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_keeps_special_tokens_by_default_and_takes_one_id_as_transformers(make_tiny, arch):
    folder = make_tiny(arch)
    ours, reference = Tokenizer.from_dir(folder), hf_tokenizer(folder)
    batch = [ours.encode(text) for text in TEXTS]
    assert [ours.decode(ids) for ids in batch] == [reference.decode(ids) for ids in batch]
    assert ours.batch_decode(batch) == reference.batch_decode(batch)
    expected = reference.batch_decode(batch, skip_special_tokens=True)
    assert ours.batch_decode(batch, skip_special_tokens=True) == expected
    for token_id in (5, ours.eos_token_id, len(ours) + 3):
        assert ours.decode(token_id) == reference.decode(token_id)


@pytest.mark.parametrize("to_array", [np.array, torch.tensor])
def test_decode_takes_arrays_and_tensors_as_transformers(make_tiny, to_array):
    """RL code decodes the sampled ids as they come out of its training framework."""
    folder = make_tiny("llama")
    ours, reference = Tokenizer.from_dir(folder), hf_tokenizer(folder)
    batch = [ours.encode(text)[:5] for text in TEXTS[1:4]]
    assert ours.batch_decode(to_array(batch)) == reference.batch_decode(to_array(batch))
    assert ours.decode(to_array(batch[1])) == reference.decode(to_array(batch[1]))
    assert ours.decode(to_array(batch[1])[0]) == reference.decode(to_array(batch[1])[0])


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenize_and_return_tensors_match_transformers(make_tiny, arch):
    """`tok.tokenize(text)` (scripts count tokens by it) and `tok(text, return_tensors=...)`."""
    folder = make_tiny(arch)
    ours, reference = Tokenizer.from_dir(folder), hf_tokenizer(folder)
    for text in TEXTS:
        assert ours.tokenize(text) == reference.tokenize(text), text
        with_special = reference.tokenize(text, add_special_tokens=True)
        assert ours.tokenize(text, add_special_tokens=True) == with_special, text
    same_length = ["Hello world", "Hello there"]
    assert len(set(map(len, reference(same_length).input_ids))) == 1
    for texts in (TEXTS[2], same_length):
        for kind in ("pt", "np"):
            got, expected = ours(texts, return_tensors=kind), reference(texts, return_tensors=kind)
            for name in ("input_ids", "attention_mask"):
                assert type(got[name]) is type(expected[name])
                assert got[name].dtype == expected[name].dtype
                assert got[name].tolist() == expected[name].tolist()
    with pytest.raises(ValueError, match="texts of one length"):
        ours(TEXTS[1:3], return_tensors="pt")
    with pytest.raises(ValueError, match="return_tensors must be"):
        ours("hi", return_tensors="tf")


@pytest.mark.parametrize("arch", ARCHS)
def test_vocab_and_token_lookups_match_transformers(make_tiny, arch):
    folder = make_tiny(arch)
    ours, reference = Tokenizer.from_dir(folder), hf_tokenizer(folder)
    assert len(ours) == len(reference)
    assert ours.get_vocab() == reference.get_vocab()
    tokens = [*reference.convert_ids_to_tokens(list(range(0, len(ours), 37))), "Hello", "<zz>"]
    assert ours.convert_tokens_to_ids(tokens) == reference.convert_tokens_to_ids(tokens)
    assert ours.convert_tokens_to_ids(tokens[1]) == reference.convert_tokens_to_ids(tokens[1])
    assert ours.convert_ids_to_tokens(ours.eos_token_id) == reference.eos_token


@pytest.mark.parametrize(
    ("arch", "config"),
    [
        ("llama", {}),
        ("qwen3", {}),
        (
            "mistral",
            {"pad_token": "fox", "unk_token": {"__type": "AddedToken", "content": "<unk>"}},
        ),
    ],
)
def test_pad_unk_and_special_tokens_match_transformers(make_tiny, tmp_path, arch, config):
    folder = variant(make_tiny(arch), tmp_path / "m", **config)
    ours, reference = Tokenizer.from_dir(folder), AutoTokenizer.from_pretrained(folder)
    for name in ("pad_token", "pad_token_id", "unk_token", "unk_token_id", "eos_token"):
        assert getattr(ours, name) == getattr(reference, name), name
    assert set(reference.all_special_tokens) <= set(ours.all_special_tokens)
    assert ours.convert_tokens_to_ids(ours.all_special_tokens) == ours.all_special_ids
    assert ours.convert_tokens_to_ids("<zz>") == reference.convert_tokens_to_ids("<zz>")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(make_tiny, arch, add_generation_prompt):
    folder = make_tiny(arch)
    ours, reference = Tokenizer.from_dir(folder), hf_tokenizer(folder)
    for chat in CHATS:
        expected = reference.apply_chat_template(
            chat, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        ours_text = ours.apply_chat_template(
            chat, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        assert ours_text == expected


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"add_generation_prompt": True},
        {"return_dict": False},
        {"tokenize": False},
        {"add_generation_prompt": True, "tokenize": False, "return_dict": False},
    ],
)
def test_chat_template_defaults_and_batches_match_transformers(make_tiny, arch, options):
    """Code written for vLLM's get_tokenizer() calls apply_chat_template(messages) for ids."""
    folder = make_tiny(arch)
    ours, reference = Tokenizer.from_dir(folder), hf_tokenizer(folder)
    for conversation in (CHATS[1], CHATS):
        expected = reference.apply_chat_template(conversation, **options)
        rendered = ours.apply_chat_template(conversation, **options)
        if isinstance(expected, str) or not hasattr(expected, "keys"):
            assert rendered == expected
        else:
            assert rendered == dict(expected)
            assert rendered.input_ids == expected.input_ids


def test_chat_template_refuses_what_is_not_a_conversation(make_tiny):
    tokenizer = Tokenizer.from_dir(make_tiny("qwen3"))
    with pytest.raises(TypeError, match="conversation must be"):
        tokenizer.apply_chat_template("Hi")
    with pytest.raises(TypeError, match="conversation"):
        tokenizer.apply_chat_template(messages=CHATS[0])


CONTINUED = [
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "  spaced out \n"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hi"}],  # twice
    [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
    # the content's text recurs in the template's own closing text, or is empty
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "assistant"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ">"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}],
]
# a template that renders list content and reads a variable of chat_template_kwargs
THINKING_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{% if m.content is string %}{{ m.content }}{% else %}"
    "{% for p in m.content %}{{ p.text }}{% endfor %}{% endif %}</{{ m.role }}>\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% if not enable_thinking | default(true) %}"
    "<think></think>{% endif %}{% endif %}"
)


@pytest.mark.parametrize("chat", CONTINUED)
def test_continue_final_message_cuts_as_transformers_does(make_tiny, tmp_path, chat):
    folder = variant(
        make_tiny("qwen2"), tmp_path / "m", drop_template=True, chat_template=THINKING_TEMPLATE
    )
    expected = hf_tokenizer(folder).apply_chat_template(
        chat, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    ours = Tokenizer.from_dir(folder).apply_chat_template(
        chat, continue_final_message=True, tokenize=False
    )
    assert ours == expected
    assert not ours.endswith(f"</{chat[-1]['role']}>\n")


def test_templates_read_every_named_special_token_as_transformers_gives_them(make_tiny, tmp_path):
    """transformers hands templates its whole special_tokens_map: sep, cls and mask too."""
    template = "{{ cls_token }}{% for m in messages %}{{ m.content }}{{ sep_token }}{% endfor %}[{{ mask_token }}]"
    folder = variant(
        make_tiny("qwen2"), tmp_path / "m", drop_template=True, chat_template=template,
        sep_token="<|im_end|>", cls_token="<|im_start|>", mask_token="<|endoftext|>",
    )  # fmt: skip
    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    want = hf_tokenizer(folder).apply_chat_template(chat, tokenize=False)
    assert Tokenizer.from_dir(folder).apply_chat_template(chat, tokenize=False) == want
    assert want.startswith("<|im_start|>a<|im_end|>")


def test_named_chat_templates_are_picked_as_transformers_picks_them(make_tiny, tmp_path):
    """tokenizer_config.json's list of named templates (Hermes-2-Pro's, Command-R's): "tool_use"
    where tools are given, "default" otherwise, any by its name; none without a default."""
    named = [
        {"name": "default", "template": "{% for m in messages %}D:{{ m.content }}{% endfor %}"},
        {"name": "tool_use", "template": "{{ tools | length }} tools:{{ messages[0].content }}"},
    ]
    folder = variant(make_tiny("qwen2"), tmp_path / "m", drop_template=True, chat_template=named)
    ours, theirs = Tokenizer.from_dir(folder), hf_tokenizer(folder)
    chat, tools = [{"role": "user", "content": "Hi"}], [{"type": "function", "function": {}}]
    for kwargs in ({}, {"tools": tools}, {"chat_template": "tool_use", "tools": tools},
                   {"chat_template": "default", "tools": tools}):  # fmt: skip
        want = theirs.apply_chat_template(chat, tokenize=False, **kwargs)
        assert ours.apply_chat_template(chat, tokenize=False, **kwargs) == want
    folder = variant(
        make_tiny("qwen2"), tmp_path / "n", drop_template=True, chat_template=named[1:]
    )
    with pytest.raises(ValueError, match="no default"):
        Tokenizer.from_dir(folder).apply_chat_template(chat, tokenize=False)
    with pytest.raises(ValueError):  # transformers refuses it too
        hf_tokenizer(folder).apply_chat_template(chat, tokenize=False)
    folder = variant(
        make_tiny("qwen2"), tmp_path / "o", drop_template=True, chat_template=[{"name": 1}]
    )  # a list of no named template loads, and has none
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_dir(folder).apply_chat_template(chat, tokenize=False)


@pytest.mark.parametrize("kwargs", [None, {"enable_thinking": False}, {"enable_thinking": True}])
def test_chat_template_kwargs_reach_the_template_as_in_transformers(make_tiny, tmp_path, kwargs):
    folder = variant(
        make_tiny("qwen2"), tmp_path / "m", drop_template=True, chat_template=THINKING_TEMPLATE
    )
    expected = hf_tokenizer(folder).apply_chat_template(
        CHATS[1], tokenize=False, add_generation_prompt=True, **(kwargs or {})
    )
    ours = Tokenizer.from_dir(folder).apply_chat_template(
        CHATS[1], add_generation_prompt=True, tokenize=False, chat_template_kwargs=kwargs
    )
    assert ours == expected
    assert ours.endswith("<think></think>") == (kwargs == {"enable_thinking": False})
    as_arguments = Tokenizer.from_dir(folder).apply_chat_template(
        CHATS[1], add_generation_prompt=True, tokenize=False, **(kwargs or {})
    )
    assert as_arguments == expected


def test_tokenize_true_gives_the_ids_transformers_gives(make_tiny):
    folder = make_tiny("qwen3")
    ours, reference = Tokenizer.from_dir(folder), hf_tokenizer(folder)
    expected = reference.apply_chat_template(CHATS[1], tokenize=True, add_generation_prompt=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected  # BatchEncoding
    ids = ours.apply_chat_template(CHATS[1], add_generation_prompt=True, return_dict=False)
    assert ids == list(expected)


def test_chat_template_options_refuse_what_cannot_work(make_tiny, tmp_path):
    tokenizer = Tokenizer.from_dir(make_tiny("qwen2"))
    chat = CONTINUED[0]
    with pytest.raises(ValueError, match="cannot both be true"):
        tokenizer.apply_chat_template(chat, add_generation_prompt=True, continue_final_message=True)
    for kwargs in ({"messages": []}, {"add_generation_prompt": False}, {1: 2}, ["x"]):
        with pytest.raises(ValueError, match="chat_template_kwargs"):
            tokenizer.apply_chat_template(chat, chat_template_kwargs=kwargs)
    folder = variant(
        make_tiny("qwen2"), tmp_path / "a", drop_template=True, chat_template=THINKING_TEMPLATE
    )
    with pytest.raises(ValueError, match="no text to continue"):
        Tokenizer.from_dir(folder).apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}]}], continue_final_message=True
        )
    template = "{% for m in messages[:-1] %}{{ m.content }}{% endfor %}"  # drops the last one
    folder = variant(make_tiny("qwen2"), tmp_path / "b", drop_template=True, chat_template=template)
    with pytest.raises(ValueError, match="does not contain"):
        Tokenizer.from_dir(folder).apply_chat_template(chat, continue_final_message=True)


def test_chat_template_from_tokenizer_config_with_tojson_and_strftime(make_tiny, tmp_path):
    template = (
        "{{ bos_token }}{% for m in messages %}{{ m | tojson }}{% endfor %}"
        "{{ strftime_now('%Y') | length }}"
    )
    folder = variant(make_tiny("llama"), tmp_path / "m", drop_template=True, chat_template=template)
    chat = [{"role": "user", "content": "<b>café</b> & 日本"}]
    expected = hf_tokenizer(folder).apply_chat_template(chat, tokenize=False)
    assert Tokenizer.from_dir(folder).apply_chat_template(chat, tokenize=False) == expected
    assert "<b>café</b>" in expected


def test_generation_tags_and_every_special_token_render_as_in_transformers(make_tiny, tmp_path):
    """Templates trained with an assistant-only loss wrap the assistant's text in
    {% generation %}; templates may name pad_token and unk_token."""
    template = (
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
        "A:{{ m.content }}{{ eos_token }}{% endgeneration %}{% else %}U:{{ m.content }}"
        "{% endif %}{% endfor %}|{{ pad_token }}|{{ unk_token }}"
    )
    folder = variant(
        make_tiny("llama"), tmp_path / "m", drop_template=True, chat_template=template,
        pad_token="<|pad|>", unk_token="<|unk|>",
    )  # fmt: skip
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    expected = hf_tokenizer(folder).apply_chat_template(chat, tokenize=False)
    assert "A:Yo" in expected and expected.endswith("|<|pad|>|<|unk|>")
    assert Tokenizer.from_dir(folder).apply_chat_template(chat, tokenize=False) == expected


@pytest.mark.parametrize("arch", ARCHS)
def test_offsets_mapping_matches_transformers(make_tiny, arch):
    """`tok(text, return_offsets_mapping=True)`: each token's characters, as lists and arrays."""
    folder = make_tiny(arch)
    ours, reference = Tokenizer.from_dir(folder), hf_tokenizer(folder)
    for add in (False, True):
        for text in TEXTS:
            got = ours(text, add_special_tokens=add, return_offsets_mapping=True)
            expected = reference(text, add_special_tokens=add, return_offsets_mapping=True)
            assert got["offset_mapping"] == expected["offset_mapping"], text
            assert got.input_ids == expected.input_ids
        batch = ours(TEXTS, add_special_tokens=add, return_offsets_mapping=True)
        want = reference(TEXTS, add_special_tokens=add, return_offsets_mapping=True)
        assert batch["offset_mapping"] == want["offset_mapping"]
    got = ours("Hello world", return_tensors="pt", return_offsets_mapping=True)
    expected = reference("Hello world", return_tensors="pt", return_offsets_mapping=True)
    assert got["offset_mapping"].tolist() == expected["offset_mapping"].tolist()
    assert "offset_mapping" not in ours("Hello world")


# an assistant-loss template: the assistant's text in {% generation %}, once inline and once
# inside a macro (placed as transformers places it), with a loop and a namespace around them
GENERATION_TEMPLATE = (
    "{%- macro say(m) %}{% generation %}{{ m.content | trim }}{% endgeneration %}{% endmacro -%}"
    "{{ bos_token }}{% set ns = namespace(turns=0) %}{% for m in messages %}"
    "{% if m.role == 'assistant' %}{% set ns.turns = ns.turns + 1 %}<a{{ ns.turns }}>"
    "{% if loop.last %}{{ say(m) }}{% else %}{% generation %}{{ m.content }}{{ eos_token }}"
    "{% endgeneration %}{% endif %}{% else %}<{{ m.role }}>{{ m.content }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
)


@pytest.mark.parametrize("arch", ARCHS)
def test_assistant_tokens_mask_matches_transformers(make_tiny, tmp_path, arch):
    """apply_chat_template(return_assistant_tokens_mask=True): `assistant_masks` marks the
    tokens of the text inside {% generation %}, one list per chat, as transformers marks them;
    a template without the tags marks none."""
    folder = variant(
        make_tiny(arch), tmp_path / "m", drop_template=True, chat_template=GENERATION_TEMPLATE
    )
    ours, reference = Tokenizer.from_dir(folder), AutoTokenizer.from_pretrained(folder)
    chats = [
        CHATS[1] + [{"role": "assistant", "content": " 東京 is big. "}],
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo café"}] * 2,
        CHATS[0],
    ]
    for chat in chats:
        for prompt in (False, True):
            args = dict(add_generation_prompt=prompt, return_assistant_tokens_mask=True)
            got = ours.apply_chat_template(chat, **args)
            expected = reference.apply_chat_template(chat, return_dict=True, **args)
            assert got.input_ids == expected["input_ids"]
            assert got["assistant_masks"] == expected["assistant_masks"], chat
    assert any(
        ours.apply_chat_template(chats[0], return_assistant_tokens_mask=True).assistant_masks
    )
    batch = ours.apply_chat_template(chats, return_assistant_tokens_mask=True)
    want = reference.apply_chat_template(chats, return_dict=True, return_assistant_tokens_mask=True)
    assert batch["assistant_masks"] == want["assistant_masks"]
    plain = Tokenizer.from_dir(make_tiny(arch))
    unmarked = plain.apply_chat_template(chats[0], return_assistant_tokens_mask=True)
    assert unmarked.assistant_masks == [0] * len(unmarked.input_ids)
    with pytest.raises(ValueError, match="tokenize=True and return_dict=True"):
        ours.apply_chat_template(chats[0], tokenize=False, return_assistant_tokens_mask=True)
    with pytest.raises(ValueError, match="continued final message"):
        ours.apply_chat_template(
            chats[0], continue_final_message=True, return_assistant_tokens_mask=True
        )


def test_chat_template_jinja_file_takes_precedence_over_config(make_tiny, tmp_path):
    folder = variant(make_tiny("qwen2"), tmp_path / "m", chat_template="IGNORED")
    assert Tokenizer.from_dir(folder).chat_template == CHAT_TEMPLATE


def test_named_default_template_is_picked_from_a_template_list(make_tiny, tmp_path):
    templates = [
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": "{{ messages[0]['content'] }}"},
    ]
    folder = variant(
        make_tiny("qwen2"), tmp_path / "m", drop_template=True, chat_template=templates
    )
    assert (
        Tokenizer.from_dir(folder).apply_chat_template(
            [{"role": "user", "content": "hi"}], tokenize=False
        )
        == "hi"
    )


def test_chat_template_rejects_unknown_role_with_value_error(make_tiny):
    tokenizer = Tokenizer.from_dir(make_tiny("llama"))
    with pytest.raises(ValueError, match="unknown role tool"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "42"}])


def test_model_without_chat_template_raises_value_error(make_tiny, tmp_path):
    folder = variant(make_tiny("mistral"), tmp_path / "m", drop_template=True)
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_dir(folder).apply_chat_template(CHATS[0])


def test_missing_tokenizer_json_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize(
    ("arch", "config"),
    [
        ("llama", {"add_bos_token": False}),
        ("llama", {"add_bos_token": True, "add_eos_token": True}),
        ("qwen2", {"bos_token": "<|begin_of_text|>", "add_bos_token": True}),
        ("qwen3", {"add_eos_token": True, "eos_token": "<|new_eos|>"}),
        (
            "mistral",
            {"pad_token": "fox", "unk_token": {"__type": "AddedToken", "content": "<unk>"}},
        ),
    ],
)
def test_tokenizer_config_variants_encode_like_transformers(make_tiny, tmp_path, arch, config):
    folder = variant(make_tiny(arch), tmp_path / "m", **config)
    ours, reference = Tokenizer.from_dir(folder), AutoTokenizer.from_pretrained(folder)
    assert (len(ours), ours.vocab_size) == (len(reference), reference.vocab_size)
    assert ours.eos_token_id == reference.eos_token_id
    for text in [*TEXTS, "the fox <unk> <|new_eos|>"]:
        assert ours.encode(text) == reference(text).input_ids
        ids = reference(text).input_ids
        expected = reference.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=True) == expected


@cache
def tiny_tokenizer(folder: Path) -> Tokenizer:
    return Tokenizer.from_dir(folder)


def stream(
    detokenizer: IncrementalDetokenizer, ids: list[int], chunk_sizes: list[int]
) -> list[str]:
    deltas, start = [], 0
    for size in chunk_sizes:
        deltas.append(detokenizer.add(ids[start : start + size]))
        start += size
    deltas.append(detokenizer.add(ids[start:]))
    return deltas


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_detokenizer_deltas_concatenate_to_full_decode(make_tiny, arch, data):
    tokenizer = tiny_tokenizer(make_tiny(arch))
    # ids past the tokenizer's size (config.json pads the vocab) decode to nothing
    ids = data.draw(st.lists(st.integers(0, len(tokenizer) + 8), max_size=40))
    prompt = tokenizer.encode(data.draw(st.sampled_from(TEXTS)))
    skip = data.draw(st.booleans())
    chunk_sizes = data.draw(st.lists(st.integers(1, 4), max_size=20))
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    deltas = [*stream(detokenizer, ids, chunk_sizes), detokenizer.flush()]
    assert "".join(deltas) == detokenizer.text == tokenizer.decode(ids, skip_special_tokens=skip)
    assert decode_after(tokenizer, prompt, ids, skip) == detokenizer.text  # the whole at once


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=30), data=st.data())
def test_detokenizer_never_emits_a_partial_character(make_tiny, arch, text, data):
    tokenizer = tiny_tokenizer(make_tiny(arch))
    ids = tokenizer.encode(text, add_special_tokens=False)
    full_text = tokenizer.decode(ids, skip_special_tokens=True)
    chunk_sizes = data.draw(st.lists(st.integers(1, 3), max_size=len(ids)))
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:"))
    deltas = stream(detokenizer, ids, chunk_sizes)
    if "\ufffd" not in full_text:
        assert not any("\ufffd" in delta for delta in deltas)
    # a text that itself ends in U+FFFD looks like a partial character: it comes out at the end
    held = detokenizer.flush()
    assert "".join(deltas) + held == full_text
    assert held == "" or full_text.endswith("\ufffd")


def test_detokenizer_holds_a_split_character_until_it_completes(make_tiny):
    tokenizer = tiny_tokenizer(make_tiny("llama"))
    ids = tokenizer.encode("語", add_special_tokens=False)
    assert len(ids) == 3  # one byte per token: the character is not in the training corpus
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hi"))
    assert [detokenizer.add([token_id]) for token_id in ids] == ["", "", "語"]


def test_detokenizer_output_starting_inside_a_prompt_character_matches_decode(make_tiny):
    tokenizer = tiny_tokenizer(make_tiny("qwen2"))
    split = tokenizer.encode("a語 ok")
    prompt, output = split[:2], split[2:]  # the prompt ends after the first byte of 語
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detokenizer.add([token_id]) for token_id in output]
    assert "".join(deltas) + detokenizer.flush() == tokenizer.decode(
        output, skip_special_tokens=True
    )


def test_detokenizer_decodes_only_a_small_window_per_step(make_tiny):
    tokenizer = tiny_tokenizer(make_tiny("llama"))
    window_sizes = []

    class SpyTokenizer(Tokenizer):
        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            window_sizes.append(len(ids))
            return super().decode(ids, skip_special_tokens)

    spy = SpyTokenizer(tokenizer.backend, tokenizer.bos_token, tokenizer.eos_token)
    ids = tokenizer.encode(" ".join(TEXTS[1:4]) * 20, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(spy, tokenizer.encode("Hello"))
    for token_id in ids:
        detokenizer.add([token_id])
    assert detokenizer.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert max(window_sizes) <= 8
