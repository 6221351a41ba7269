"""The OpenAI-compatible server, over real HTTP on 127.0.0.1, serving the tiny model.

Answers are checked against the offline `LLM` with the same seeds: seeded sampling does not
depend on what else is in the batch, so a server busy with other requests must agree exactly.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import importlib.metadata
import itertools
import json
import logging
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import numpy as np
import openai
import pytest
import transformers
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from conftest import wait_until_healthy
from tandem import LLM, PoolingParams, SamplingParams
from tandem.async_llm import AsyncLLM
from tandem.cli import build_parser, main
from tandem.config import EngineConfig
from tandem.engine import Engine
from tandem.server.app import build_app
from tandem.server.bench import arrival_times
from tandem.server.metrics import buckets_1_2_5
from tandem.server.options import ServerOptions
from tandem.server.protocol import CompletionRequest, OpenAIError
from tandem.server.serving import CompletionFormat, Generation, sampling_params, sse

ENGINE_ARGS = {"max_model_len": 512, "block_size": 8}
MODEL = "tiny-llama"
API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = "Our scheduler reads"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a cache."},
    {"role": "assistant", "content": "KV."},
    {"role": "user", "content": "Another?"},
]


@dataclass
class Server:
    url: str
    llm: AsyncLLM
    model_name: str = MODEL  # the first name it serves

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics by name and labels, e.g. 'x_total{reason="abort"}'; each
        carries the served model's name as vLLM's do (`model_name`, left out of the keys)."""
        text = httpx.get(f"{self.url}/metrics").text
        samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name.startswith("tandem_"):
                    assert s.labels.get("model_name") == self.model_name, s
                labels = ",".join(
                    f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k != "model_name"
                )
                samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return samples

    def wait_until_idle(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        stats = self.llm.stats
        while stats.num_running or stats.num_waiting or stats.num_free_blocks != stats.num_blocks:
            assert time.monotonic() < deadline, f"requests still hold blocks: {stats}"
            time.sleep(0.01)
            stats = self.llm.stats


@pytest.fixture(scope="module")
def folder(make_tiny) -> str:
    return str(make_tiny("llama"))


@contextmanager
def running(app, config: uvicorn.Config | None = None) -> Iterator[str]:
    """Serve `app` with uvicorn on a free port of 127.0.0.1 in a thread (or as `config` says);
    yields its URL (a Unix socket's path under `config.uds`)."""
    config = config or uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    address = server.servers[0].sockets[0].getsockname()
    try:
        yield config.uds or f"http://127.0.0.1:{address[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def server(folder) -> Iterator[Server]:
    llm = AsyncLLM.from_model(folder, **ENGINE_ARGS)
    with running(build_app(llm, MODEL, api_key=API_KEY)) as url:
        assert httpx.get(f"{url}/health").status_code == 200
        yield Server(url, llm)
    llm.shutdown()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def offline(folder) -> LLM:
    return LLM(folder, **ENGINE_ARGS)


def offline_completion(offline: LLM, prompt, **params):
    return offline.generate(prompt, SamplingParams(**params), use_tqdm=False)[0].outputs


# ---- the official client ------------------------------------------------------------------


def test_completion_matches_the_offline_api(client, offline):
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0.7, seed=5
    )
    [want] = offline_completion(offline, PROMPT, max_tokens=12, temperature=0.7, seed=5)
    choice = response.choices[0]
    assert (choice.text, choice.finish_reason) == (want.text, want.finish_reason)
    assert response.object == "text_completion" and response.model == MODEL
    prompt_tokens = len(offline.get_tokenizer().encode(PROMPT))
    assert response.usage.prompt_tokens == prompt_tokens
    assert response.usage.completion_tokens == len(want.token_ids)
    assert response.usage.total_tokens == prompt_tokens + len(want.token_ids)


def test_chat_applies_the_chat_template_to_system_user_and_assistant_messages(client, offline):
    response = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0
    )
    want = offline.chat(MESSAGES, SamplingParams(max_tokens=10, temperature=0), use_tqdm=False)
    message = response.choices[0].message
    assert (message.role, message.content) == ("assistant", want[0].outputs[0].text)
    assert response.object == "chat.completion"
    assert response.usage.prompt_tokens == len(want[0].prompt_token_ids)


def test_chat_continues_the_final_message_as_llm_chat_does(client, offline):
    """vLLM's chat template options: the prompt ends inside the assistant's message (no end of
    message, no new assistant turn), for the chat route and LLM.chat alike."""
    messages = [*MESSAGES[:2], {"role": "assistant", "content": "The KV"}]
    options = {"add_generation_prompt": False, "continue_final_message": True}
    response = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, extra_body=options
    )
    params = SamplingParams(max_tokens=8, temperature=0)
    [want] = offline.chat(messages, params, use_tqdm=False, **options)
    assert response.choices[0].message.content == want.outputs[0].text
    assert response.usage.prompt_tokens == len(want.prompt_token_ids)
    tokenizer = offline.get_tokenizer()
    text = tokenizer.decode(want.prompt_token_ids, skip_special_tokens=False)
    assert text.endswith("assistant\nThe KV")


def test_chat_echo_puts_the_continued_message_before_the_answer_as_vllm(client, offline):
    """vLLM's chat echo: the final message's content leads the answer's when it is of the
    answer's role (the assistant's, or with add_generation_prompt false the final message's),
    in one answer and at the start of a stream; other roles are not echoed."""
    messages = [*MESSAGES[:2], {"role": "assistant", "content": "The KV"}]
    options = {"add_generation_prompt": False, "continue_final_message": True, "echo": True}
    args = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0}
    params = SamplingParams(max_tokens=8, temperature=0)
    [want] = offline.chat(messages, params, use_tqdm=False, add_generation_prompt=False,
                          continue_final_message=True)  # fmt: skip
    answer = client.chat.completions.create(**args, extra_body=options).choices[0].message
    assert answer.content == "The KV" + want.outputs[0].text
    stream = client.chat.completions.create(**args, extra_body=options, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == answer.content
    [plain] = offline.chat(MESSAGES, params, use_tqdm=False)
    user_last = client.chat.completions.create(**{**args, "messages": MESSAGES},
                                               extra_body={"echo": True})  # fmt: skip
    assert user_last.choices[0].message.content == plain.outputs[0].text


def test_chat_without_a_generation_prompt_answers_in_the_final_messages_role(server):
    """vLLM answers with the final message's role when add_generation_prompt is false (the
    model continues that message), in one answer and in a stream's first delta."""
    body = {"messages": MESSAGES, "max_tokens": 2, "add_generation_prompt": False}
    answer = post(server, "/v1/chat/completions", body).json()
    assert answer["choices"][0]["message"]["role"] == MESSAGES[-1]["role"] == "user"
    with httpx.stream(
        "POST", f"{server.url}/v1/chat/completions", json={**body, "stream": True}, headers=AUTH
    ) as response:
        first = next(line for line in response.iter_lines() if line.startswith("data: "))
    assert json.loads(first.removeprefix("data: "))["choices"][0]["delta"]["role"] == "user"
    prompted = post(server, "/v1/chat/completions", {**body, "add_generation_prompt": True})
    assert prompted.json()["choices"][0]["message"]["role"] == "assistant"


def test_text_parts_of_a_message_reach_the_template_joined_by_newlines_as_vllm(server):
    """vLLM renders a content of text parts as their texts joined by newlines."""
    parts = [{"type": "text", "text": "Name a"}, {"type": "text", "text": "cache."}]
    as_parts = [{"role": "user", "content": parts}]
    as_text = [{"role": "user", "content": "Name a\ncache."}]
    tokens = [
        post(server, "/tokenize", {"messages": m}).json()["tokens"] for m in (as_parts, as_text)
    ]
    assert tokens[0] == tokens[1]
    chat = post(server, "/v1/chat/completions", {"messages": as_parts, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == len(tokens[1])


def test_tokenize_takes_the_chat_template_options(server, offline):
    messages = [*MESSAGES[:2], {"role": "assistant", "content": "The KV"}]
    options = {"add_generation_prompt": False, "continue_final_message": True}
    tokens = post(server, "/tokenize", {"messages": messages, **options}).json()["tokens"]
    [want] = offline.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False, **options)
    assert tokens == want.prompt_token_ids


def test_assistant_reasoning_and_tool_calls_reach_the_template_as_llm_chat_gives_them(
    server, offline
):
    """An assistant's `reasoning` is no field ignored, and tool call arguments are read as the
    offline API reads them (test_offline_api.py checks that against transformers), through a
    template that writes both; arguments that are no JSON are a 400, as vLLM's."""
    from test_offline_api import TOOLS_TEMPLATE

    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": ""}}
    messages = [
        MESSAGES[1],
        {"role": "assistant", "content": "", "reasoning": "Ask.", "tool_calls": [call]},
    ]
    no_json = {**call, "function": {"name": "weather", "arguments": "{city"}}
    llm = AsyncLLM.from_model(server.llm.engine.config.model, **ENGINE_ARGS)
    options = ServerOptions(chat_template=TOOLS_TEMPLATE)
    with running(build_app(llm, MODEL, options=options)) as url:
        answer = httpx.post(f"{url}/tokenize", json={"messages": messages})
        unread = [*messages[:1], {**messages[1], "tool_calls": [no_json]}]
        unread_answer = httpx.post(f"{url}/tokenize", json={"messages": unread})
    llm.shutdown()
    [want] = offline.chat(
        messages, SamplingParams(max_tokens=1), use_tqdm=False, chat_template=TOOLS_TEMPLATE
    )
    assert "<think>Ask.</think>" in want.prompt and "[weather {}]" in want.prompt
    assert answer.json()["tokens"] == want.prompt_token_ids
    assert_openai_error(unread_answer, 400, "messages")


def test_chat_template_options_that_cannot_work_are_400s(server):
    for options, param in [
        ({"continue_final_message": True}, "messages"),  # beside add_generation_prompt
        ({"chat_template_kwargs": {"messages": []}}, "messages"),
        ({"chat_template_kwargs": "thinking"}, None),
    ]:
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, **options}
        assert_openai_error(post(server, "/v1/chat/completions", body), 400, param)
    assert post(server, "/v1/chat/completions", {**body, "chat_template_kwargs": {}}).is_success


def test_add_special_tokens_sets_whether_the_prompt_gets_the_tokenizers_bos(
    server, client, offline
):
    """vLLM's field: on by default for a completion's text prompt, off for a chat's rendered
    template (which writes its own); either may be turned the other way."""
    tokenizer = offline.get_tokenizer()
    bare = tokenizer.encode(PROMPT, add_special_tokens=False)
    assert len(bare) < len(tokenizer.encode(PROMPT))  # the tokenizer adds a BOS
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    response = client.completions.create(**body, extra_body={"add_special_tokens": False})
    [want] = offline.generate(
        {"prompt_token_ids": bare}, SamplingParams(max_tokens=6, temperature=0), use_tqdm=False
    )
    assert response.usage.prompt_tokens == len(bare)
    assert response.choices[0].text == want.outputs[0].text
    template = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    for add, ids in ((False, tokenizer.encode(template, add_special_tokens=False)),
                     (True, tokenizer.encode(template))):  # fmt: skip
        chat = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=1, extra_body={"add_special_tokens": add}
        )
        assert chat.usage.prompt_tokens == len(ids)
        body = {"messages": MESSAGES, "add_special_tokens": add}
        assert post(server, "/tokenize", body).json()["tokens"] == ids


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(client, offline, folder):
    """As vLLM's field: the completion reads k prompt tokens (usage counts them), a text's cut
    by the tokenizer with its BOS kept (transformers' truncation on the left), and a chat
    without max_tokens may fill the context left after the cut."""
    from transformers import AutoTokenizer

    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    response = client.completions.create(**body, extra_body={"truncate_prompt_tokens": 2})
    reference = AutoTokenizer.from_pretrained(folder, truncation_side="left")
    ids = reference(PROMPT, truncation=True, max_length=2).input_ids
    assert ids[0] == reference(PROMPT).input_ids[0] != reference(PROMPT).input_ids[-2]  # the BOS
    [want] = offline.generate(
        {"prompt_token_ids": ids}, SamplingParams(max_tokens=6, temperature=0), use_tqdm=False
    )
    assert response.usage.prompt_tokens == 2
    assert response.choices[0].text == want.outputs[0].text
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0,
        extra_body={"ignore_eos": True, "truncate_prompt_tokens": 5},
    )  # fmt: skip
    assert chat.usage.prompt_tokens == 5
    assert chat.usage.total_tokens == ENGINE_ARGS["max_model_len"]


def test_truncate_prompt_tokens_out_of_range_is_a_400_on_both_routes(server):
    for value in (0, -2):
        body = {"prompt": PROMPT, "max_tokens": 2, "truncate_prompt_tokens": value}
        assert_openai_error(post(server, "/v1/completions", body), 400, "truncate_prompt_tokens")
        body = {"messages": MESSAGES, "max_tokens": 2, "truncate_prompt_tokens": value}
        response = post(server, "/v1/chat/completions", body)
        assert_openai_error(response, 400, "truncate_prompt_tokens")


def test_an_embedding_prompt_may_fill_the_context_and_minus_one_keeps_that_much(server):
    """vLLM's pooling requests: -1 keeps max_model_len tokens (a generation's keeps one fewer),
    and a prompt of exactly max_model_len is embedded."""
    limit = ENGINE_ARGS["max_model_len"]
    for body in (
        {"input": [5] * (limit + 10), "truncate_prompt_tokens": -1},
        {"input": [5] * limit},
    ):
        response = post(server, "/v1/embeddings", body)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["prompt_tokens"] == limit
    too_long = post(server, "/v1/embeddings", {"input": [5] * (limit + 1)})
    assert "max_model_len" in assert_openai_error(too_long, 400, "input")
    # vLLM's priority and request_id: taken (a priority under "fcfs" is the engine's 400)
    tagged = post(server, "/v1/embeddings", {"input": "hi", "priority": 0, "request_id": "abc"})
    assert tagged.status_code == 200 and tagged.json()["id"] == "embd-abc"
    ranked = post(server, "/v1/embeddings", {"input": "hi", "priority": 3})
    assert "scheduling_policy" in assert_openai_error(ranked, 400, "input")


def test_cache_salt_shares_cached_prompt_tokens_only_within_a_salt_on_both_routes(server):
    """vLLM's cache_salt: usage.prompt_tokens_details.cached_tokens counts only blocks cached
    under the request's own salt (none: shared with unsalted requests only); its
    created_cache_tokens, the prompt's other tokens in full blocks (written to the cache)."""
    ids = list(range(300, 340))  # 40 token ids: 5 full blocks of 8, in no other test
    messages = [{"role": "user", "content": "Salted tenants keep their prefixes apart. " * 4}]
    for path, body in [
        ("/v1/completions", {"prompt": ids, "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": messages, "max_tokens": 2}),
    ]:
        cached, created = [], []
        for salt in ("tenant-a", "tenant-a", "tenant-b", None):
            response = post(server, path, {**body, "cache_salt": salt}).json()
            details = response["usage"]["prompt_tokens_details"]
            cached.append(details["cached_tokens"])
            created.append(details["created_cache_tokens"])
        assert cached[0] == 0 and cached[1] >= 16 and cached[2:] == [0, 0], (path, cached)
        full = response["usage"]["prompt_tokens"] // 8 * 8  # in full blocks of 8
        assert [c + k for c, k in zip(cached, created, strict=True)] == [full] * 4, (path, created)


@pytest.mark.parametrize("salt", ["", 5, ["a"]], ids=["empty", "int", "list"])
def test_a_cache_salt_that_is_not_a_non_empty_string_is_a_400_naming_it(server, salt):
    for path, body in [
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "cache_salt": salt}),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "cache_salt": salt}),
    ]:
        message = assert_openai_error(post(server, path, body), 400, "cache_salt")
        assert "string" in message.lower()  # what a salt must be, not that there is none


def test_chat_without_max_tokens_may_fill_the_context(client):
    response = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, extra_body={"ignore_eos": True}
    )
    usage = response.usage
    assert usage.total_tokens == ENGINE_ARGS["max_model_len"]
    assert response.choices[0].finish_reason == "length"


def test_a_completion_without_max_tokens_asks_for_16_and_the_context_must_hold_them(server):
    """vLLM's /v1/completions reads a left-out or null max_tokens as 16 (its
    normalize_null_max_tokens), and, as for one given, a prompt that leaves fewer than 16
    tokens of the context is a 400 naming it."""
    body = {"prompt": PROMPT, "temperature": 0, "ignore_eos": True}
    for given in ({}, {"max_tokens": None}):
        answer = post(server, "/v1/completions", {**body, **given}).json()
        assert answer["usage"]["completion_tokens"] == 16
    long = {"prompt": [5] * (ENGINE_ARGS["max_model_len"] - 10), "temperature": 0}
    for given in ({}, {"max_tokens": None}):
        refused = post(server, "/v1/completions", {**long, **given})
        assert "16" in assert_openai_error(refused, 400, param="max_tokens")
    assert post(server, "/v1/completions", {**long, "max_tokens": 10}).status_code == 200
    kept = post(server, "/v1/completions", {**long, "truncate_prompt_tokens": -1}).json()
    assert kept["usage"]["prompt_tokens"] == ENGINE_ARGS["max_model_len"] - 16


def test_streamed_completion_joins_to_the_full_completion_and_reports_usage(client):
    args = {"model": MODEL, "prompt": PROMPT, "max_tokens": 20, "temperature": 1.0, "seed": 11}
    full = client.completions.create(**args)
    chunks = list(
        client.completions.create(**args, stream=True, stream_options={"include_usage": True})
    )
    assert "".join(c.choices[0].text for c in chunks[:-1]) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert all(c.usage is None for c in chunks[:-1])


def test_continuous_usage_stats_give_every_chunk_the_usage_so_far(client):
    """vLLM's stream option: completion tokens count up chunk by chunk to the final usage."""
    args = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client.completions.create(**args, stream=True, stream_options=options))
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 12 and counts[0] >= 1
    assert all(c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for c in chunks)
    text = "".join(c.choices[0].text for c in chunks[:-1])
    assert text == client.completions.create(**args).choices[0].text


def test_continuous_usage_counts_the_chunks_own_prompt_and_choice_as_vllm(client):
    """With several prompts and n, vLLM's chunk usage is its choice's: its prompt's tokens and
    the tokens that choice has made so far; the last chunk's usage is the whole call's."""
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14]]
    args = {"model": MODEL, "prompt": prompts, "max_tokens": 5, "n": 2, "seed": 1}
    options = {"include_usage": True, "continuous_usage_stats": True}
    extra = {"return_token_ids": True, "ignore_eos": True}
    stream = client.completions.create(
        **args, stream=True, stream_options=options, extra_body=extra
    )
    chunks = list(stream)
    made = [0] * 4
    for chunk in chunks[:-1]:
        [choice] = chunk.choices
        made[choice.index] += len(choice.model_extra["token_ids"])
        prompt = prompts[choice.index // 2]
        assert (chunk.usage.prompt_tokens, chunk.usage.completion_tokens) == (
            len(prompt),
            made[choice.index],
        )
    assert chunks[-1].usage.completion_tokens == sum(made) == 20


def test_return_token_ids_returns_the_prompt_token_ids_too(client, offline):
    """vLLM's: in each completion choice and a stream's first chunk of each; a chat's once,
    beside its choices (and in its first chunk)."""
    extra = {"return_token_ids": True}
    prompts = [PROMPT, "Paged attention"]
    want = [offline.engine.tokenizer.encode(p) for p in prompts]
    args = {"model": MODEL, "prompt": prompts, "max_tokens": 3, "n": 2, "extra_body": extra}
    answer = client.completions.create(**args)
    assert [c.model_extra["prompt_token_ids"] for c in answer.choices] == [
        want[0],
        want[0],
        want[1],
        want[1],
    ]
    firsts = {}
    for chunk in client.completions.create(**args, stream=True):
        for choice in chunk.choices:
            ids = choice.model_extra.get("prompt_token_ids")
            assert (ids is not None) == (choice.index not in firsts)
            firsts.setdefault(choice.index, ids)
    assert [firsts[i] for i in range(4)] == [want[0], want[0], want[1], want[1]]
    chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 3, "extra_body": extra}
    response = client.chat.completions.create(**chat)
    tokenizer = offline.get_tokenizer()
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"]
    assert response.model_extra["prompt_token_ids"] == rendered
    chunks = list(client.chat.completions.create(**chat, stream=True))
    assert chunks[0].model_extra["prompt_token_ids"] == rendered
    assert all("prompt_token_ids" not in c.model_extra for c in chunks[1:])


def test_streamed_chat_sends_the_role_first_then_content_deltas(client):
    args = {"model": MODEL, "messages": MESSAGES, "max_tokens": 16, "temperature": 0}
    full = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert content == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_n_choices_are_seed_plus_k_like_the_offline_api(client, offline):
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=21, n=3
    )
    want = offline_completion(offline, PROMPT, max_tokens=8, temperature=1.0, seed=21, n=3)
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert [c.text for c in response.choices] == [w.text for w in want]
    assert len({c.text for c in response.choices}) > 1
    assert response.usage.completion_tokens == sum(len(w.token_ids) for w in want)
    streamed = ["", "", ""]
    for chunk in client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=21, n=3, stream=True
    ):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == [w.text for w in want]


def test_a_batch_of_prompts_gets_n_choices_each(client, offline):
    prompts = [PROMPT, "Hello there"]
    response = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, n=2, seed=5)
    params = SamplingParams(max_tokens=5, n=2, seed=5)
    want = offline.generate(prompts, params, use_tqdm=False)
    texts = [c.text for c in response.choices]
    assert texts == [o.text for w in want for o in w.outputs]
    with pytest.raises(openai.BadRequestError, match="n must be 1 when using greedy sampling"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, n=2)


def test_stop_string_cuts_the_text_and_streaming_never_shows_what_is_cut(client, offline):
    [greedy] = offline_completion(offline, PROMPT, max_tokens=30, temperature=0, ignore_eos=True)
    stop = greedy.text[12:16]
    assert stop.strip() and greedy.text.find(stop) == 12
    args = {"model": MODEL, "prompt": PROMPT, "max_tokens": 30, "temperature": 0, "stop": [stop]}
    full = client.completions.create(**args)
    streamed = "".join(c.choices[0].text for c in client.completions.create(**args, stream=True))
    assert full.choices[0].text == streamed == greedy.text[:12]
    assert full.choices[0].finish_reason == "stop"
    assert full.choices[0].model_extra["stop_reason"] == stop  # vLLM's field
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3)
    assert chat.choices[0].model_extra["stop_reason"] is None  # cut by max_tokens


def test_legacy_top_logprobs_keep_the_likeliest_of_ids_that_share_a_text(server):
    """Lone bytes of a character all decode to "\ufffd": keyed by text, the top-1 must not be
    overwritten by the token after it in the entry (lm-eval's is_greedy reads the max)."""
    tokenizer = server.llm.engine.tokenizer
    lone = [i for i in range(len(tokenizer)) if tokenizer.decode([i]) == "\ufffd"][:3]
    assert len(lone) == 3
    generation = Generation("cmpl", 0, [], [], num_top_logprobs=2, return_token_ids=False)
    fmt = CompletionFormat(MODEL, tokenizer, generation)
    # as entries are written: the top ids by rank, then the token itself
    entry = {lone[0]: -0.1, 5: -2.0, lone[1]: -19.7}
    assert fmt._by_text(entry) == {"\ufffd": -0.1, tokenizer.decode([5]): -2.0}


def test_a_seed_reproduces_the_same_sample(client):
    def sample(seed: int) -> str:
        args = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 1.0}
        return client.completions.create(**args, seed=seed).choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(seed) for seed in range(4)}) > 1


def test_logprobs_the_filters_removed_are_minus_9999_as_vllm(folder):
    """Under processed logprobs, top-k 2 leaves the rest of a top 5 at -inf: sent as -9999.0,
    vLLM's stand-in (JSON has no -inf: the completion was a 500, the stream not JSON)."""
    llm = AsyncLLM.from_model(folder, **ENGINE_ARGS, logprobs_mode="processed_logprobs")
    args = {"model": MODEL, "max_tokens": 3, "temperature": 1.0, "top_k": 2, "seed": 1}
    with running(build_app(llm, MODEL)) as url:
        completion = httpx.post(
            f"{url}/v1/completions", json={**args, "prompt": PROMPT, "logprobs": 5}
        )
        chat = {**args, "messages": MESSAGES, "logprobs": True, "top_logprobs": 5}
        answer = httpx.post(f"{url}/v1/chat/completions", json=chat)
        with httpx.stream("POST", f"{url}/v1/chat/completions", json={**chat, "stream": True}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line[6:].startswith("{")]
    llm.shutdown()
    assert completion.status_code == answer.status_code == 200, completion.text + answer.text
    for top in completion.json()["choices"][0]["logprobs"]["top_logprobs"]:
        assert sorted(top.values())[:3] == [-9999.0] * 3 and max(top.values()) > -9999.0
    streamed = [t for c in chunks for t in c["choices"][0]["logprobs"]["content"] if c["choices"]]
    for content in (answer.json()["choices"][0]["logprobs"]["content"], streamed):
        assert len(content) == 3
        for token in content:
            tops = [t["logprob"] for t in token["top_logprobs"]]
            assert tops[2:] == [-9999.0] * 3 and token["logprob"] > -9999.0


def test_logprobs_cover_every_generated_token(client):
    completion = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2
    )
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 6
    assert "".join(logprobs.tokens) == completion.choices[0].text
    assert all(
        max(top.values()) == lp
        for top, lp in zip(logprobs.top_logprobs, logprobs.token_logprobs, strict=True)
    )
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 6 and all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.top_logprobs[0].logprob == t.logprob for t in content)  # greedy takes the top


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id_as_vllm(client):
    """vLLM's field: every token in logprobs is "token_id:<id>", its ids those generated."""
    extra = {"return_tokens_as_token_ids": True, "return_token_ids": True}
    args = {"model": MODEL, "max_tokens": 5, "temperature": 1.0, "seed": 3, "extra_body": extra}
    completion = client.completions.create(prompt=PROMPT, logprobs=2, **args).choices[0]
    named = [f"token_id:{t}" for t in completion.model_extra["token_ids"]]
    assert completion.logprobs.tokens == named
    for token, top in zip(named, completion.logprobs.top_logprobs, strict=True):
        assert token in top and all(re.fullmatch(r"token_id:\d+", key) for key in top)
    chat = client.chat.completions.create(
        messages=MESSAGES, logprobs=True, top_logprobs=2, **args
    ).choices[0]
    content = chat.logprobs.content
    assert [t.token for t in content] == [f"token_id:{t}" for t in chat.model_extra["token_ids"]]
    for entry in content:
        assert entry.bytes == list(entry.token.encode())
        assert all(re.fullmatch(r"token_id:\d+", top.token) for top in entry.top_logprobs)


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_several_served_names_are_each_answered_as_the_first(server):
    """vLLM's --served-model-name a b: either name in a request; answers carry the first."""
    with running(build_app(server.llm, ["first-name", "second-name"])) as url:
        cards = httpx.get(f"{url}/v1/models").json()["data"]
        assert [card["id"] for card in cards] == ["first-name", "second-name"]
        body = {"model": "second-name", "prompt": "Hello", "max_tokens": 2}
        response = httpx.post(f"{url}/v1/completions", json=body)
        assert response.status_code == 200 and response.json()["model"] == "first-name"
        response = httpx.post(f"{url}/v1/completions", json={**body, "model": MODEL})
        message = assert_openai_error(response, 404, param="model")
        assert "'first-name' or 'second-name'" in message
    for bad in ([], [""], ["a", 3]):
        with pytest.raises(ValueError, match="served model names"):
            build_app(server.llm, bad)
    args = build_parser().parse_args(["serve", "m", "--served-model-name", "a", "b"])
    assert args.served_model_name == ["a", "b"]


def test_embeddings_equal_the_offline_api_s(client, server, offline):
    """The OpenAI client (which asks for base64 and decodes it), then floats by hand."""
    inputs = ["Hello there", "Paged attention is neat"]
    want = [o.outputs.embedding for o in offline.embed(inputs, use_tqdm=False)]
    answer = client.embeddings.create(model=MODEL, input=inputs)
    assert [d.index for d in answer.data] == [0, 1]
    for got, expected in zip(answer.data, want, strict=True):
        np.testing.assert_allclose(got.embedding, expected, atol=1e-6)
    ids = [offline.engine.tokenizer.encode(text) for text in inputs]
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == sum(map(len, ids))
    body = {"input": ids[1], "encoding_format": "float", "dimensions": 16}
    response = httpx.post(f"{server.url}/v1/embeddings", json=body, headers=AUTH)
    assert "does not support Matryoshka" in response.json()["error"]["message"]  # as vLLM
    bare = {"input": inputs[0], "encoding_format": "float", "add_special_tokens": False}
    response = post(server, "/v1/embeddings", bare)  # vLLM's: the text's tokens alone, no BOS
    plain = offline.engine.tokenizer.encode(inputs[0], add_special_tokens=False)
    assert plain != ids[0] and response.json()["usage"]["prompt_tokens"] == len(plain)
    want = offline.embed({"prompt_token_ids": plain}, use_tqdm=False)[0].outputs.embedding
    np.testing.assert_allclose(response.json()["data"][0]["embedding"], want, atol=1e-6)
    for field in ("use_activation", "normalize"):  # vLLM's name, and its older one
        raw = {"input": inputs[0], "encoding_format": "float", field: False}
        response = httpx.post(f"{server.url}/v1/embeddings", json=raw, headers=AUTH)
        unnormalized = offline.embed(inputs[0], pooling_params=PoolingParams(use_activation=False))
        np.testing.assert_allclose(
            response.json()["data"][0]["embedding"], unnormalized[0].outputs.embedding, atol=1e-6
        )


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": []}, 400, "input"),
        ({"input": [[]]}, 400, "input"),
        ({"input": "Hi", "dimensions": 100000}, 400, "input"),
        ({"input": [10**6]}, 400, "input"),  # past the vocabulary
        ({"input": "Hi", "encoding_format": "int8"}, 400, None),
        ({"input": "Hi", "model": "other"}, 404, "model"),
    ],
)
def test_bad_embedding_requests_are_openai_errors(server, body, status, param):
    response = httpx.post(f"{server.url}/v1/embeddings", json=body, headers=AUTH)
    assert_openai_error(response, status, param)
    assert not server.llm.engine.has_unfinished()


def test_the_model_card_has_vllms_fields(server, folder):
    """vLLM's card: root is the model as given to the server, parent null (no adapters),
    max_model_len, and one model_permission entry."""
    [card] = httpx.get(f"{server.url}/v1/models", headers=AUTH).json()["data"]
    assert (card["root"], card["parent"], card["max_model_len"]) == (
        folder,
        None,
        ENGINE_ARGS["max_model_len"],
    )
    [permission] = card["permission"]
    assert permission["object"] == "model_permission" and permission["id"].startswith("modelperm-")
    assert (permission["allow_sampling"], permission["allow_logprobs"]) == (True, True)
    assert (permission["organization"], permission["group"]) == ("*", None)


def test_version_answers_the_installed_package_version_as_vllm_does(server):
    response = httpx.get(f"{server.url}/version", headers=AUTH)
    assert response.status_code == 200
    assert response.json() == {"version": importlib.metadata.version("tandem")}


# ---- raw HTTP: tokenizer endpoints, SSE framing, errors -------------------------------------


def test_tokenize_and_detokenize_round_trip(server, offline):
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT}, headers=AUTH).json()
    assert tokens["tokens"] == offline.get_tokenizer().encode(PROMPT)
    assert tokens["count"] == len(tokens["tokens"])
    text = httpx.post(
        f"{server.url}/detokenize", json={"tokens": tokens["tokens"]}, headers=AUTH
    ).json()
    bos = offline.get_tokenizer().decode(tokens["tokens"][:1], skip_special_tokens=False)
    assert text["prompt"] == bos + PROMPT
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES}, headers=AUTH).json()
    tokenizer = offline.get_tokenizer()
    template = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert chat["tokens"] == tokenizer.encode(template, add_special_tokens=False)


def test_detokenize_keeps_special_tokens_as_vllm(server, folder):
    """vLLM decodes as Hugging Face's decode does by default: the chat template's special tokens
    stay in the text, so a rendered chat prompt comes back whole."""
    tokens = post(server, "/tokenize", {"messages": MESSAGES}).json()["tokens"]
    text = post(server, "/detokenize", {"tokens": tokens}).json()["prompt"]
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    assert text == reference.decode(tokens)
    assert text == reference.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )


def test_tokenize_returns_the_vocabularys_token_strings_when_asked_as_vllm(server, folder):
    """vLLM's return_token_strs: token_strs are the ids' entries in the vocabulary (Hugging
    Face's convert_ids_to_tokens), null unless asked for."""
    body = {"prompt": PROMPT + " \u00e9t\u00e9"}
    assert post(server, "/tokenize", body).json()["token_strs"] is None
    tokenized = post(server, "/tokenize", {**body, "return_token_strs": True}).json()
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    assert tokenized["token_strs"] == reference.convert_ids_to_tokens(tokenized["tokens"])


def test_the_response_id_carries_the_x_request_id_header_or_the_request_id_field_as_vllm(
    server,
):
    """vLLM's response id is "cmpl-" or "chatcmpl-" and the X-Request-Id header, else the body's
    request_id; calls that share one still run side by side."""
    body = {"prompt": PROMPT, "max_tokens": 30, "ignore_eos": True, "request_id": "from-body"}
    with ThreadPoolExecutor(2) as pool:
        both = list(pool.map(lambda _: post(server, "/v1/completions", body), range(2)))
    assert [r.json()["id"] for r in both] == ["cmpl-from-body"] * 2
    header = {**AUTH, "X-Request-Id": "from-header"}
    chat = {"messages": MESSAGES, "max_tokens": 2, "request_id": "from-body"}
    response = post(server, "/v1/chat/completions", chat, headers=header)
    assert response.json()["id"] == "chatcmpl-from-header"
    stream = {"prompt": PROMPT, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=stream, headers=header) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line[6:7] == "{"]
    assert {e["id"] for e in events} == {"cmpl-from-header"}


def test_a_stream_is_server_sent_events_ending_with_done(server):
    body = {"prompt": PROMPT, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert all(json.loads(e[6:])["object"] == "text_completion" for e in events[:-1])


def test_a_stream_event_stays_one_line_for_clients_that_split_on_unicode_line_breaks():
    text = "line\u2028separator, next\x85line"  # httpx's iter_lines splits at both
    lines = sse({"choices": [{"text": text}]}).splitlines()
    assert lines[1:] == [""]
    assert json.loads(lines[0].removeprefix("data: "))["choices"][0]["text"] == text


def post(server: Server, path: str, body, headers=AUTH) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(
            f"{server.url}{path}",
            content=body,
            headers={**headers, "Content-Type": "application/json"},
        )
    return httpx.post(f"{server.url}{path}", json=body, headers=headers)


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param, error
    return error["message"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -1),
        ("top_p", 0),
        ("top_k", -2),
        ("min_p", 1.5),
        ("n", 0),
        ("n", 16385),
        ("max_tokens", 0),
        ("min_tokens", 99),
        ("seed", 2**63),
        ("stop", [""]),
        ("stop_token_ids", [10**6]),
        ("logprobs", 50),
        ("max_tokens", "many"),
        ("stream", "sometimes"),
    ],
)
def test_an_invalid_value_is_a_400_naming_the_field(server, field, value):
    body = {"model": MODEL, "prompt": PROMPT, field: value}
    message = assert_openai_error(post(server, "/v1/completions", body), 400, param=field)
    assert field in message


def test_an_unknown_model_is_a_404_model_not_found(server):
    body = {"model": "gpt-4", "prompt": PROMPT}
    response = post(server, "/v1/completions", body)
    assert MODEL in assert_openai_error(response, 404, param="model")
    assert response.json()["error"]["code"] == "model_not_found"
    chat = {"model": "gpt-4", "messages": MESSAGES}
    assert_openai_error(post(server, "/v1/chat/completions", chat), 404, param="model")


def test_an_empty_model_name_asks_for_the_served_model_as_in_vllm(server):
    body = {"model": "", "prompt": PROMPT, "max_tokens": 2}
    assert post(server, "/v1/completions", body).json()["model"] == MODEL
    assert post(server, "/tokenize", {"model": "", "prompt": PROMPT}).status_code == 200


@pytest.mark.parametrize("prompt", ["", [], [[]]])
def test_an_empty_prompt_is_a_400(server, prompt):
    """vLLM's: a text prompt of nothing is refused, not run as the BOS alone."""
    response = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 2})
    assert_openai_error(response, 400, param="prompt")


def test_a_prompt_longer_than_the_context_is_a_400(server):
    body = {"prompt": [5] * ENGINE_ARGS["max_model_len"]}
    message = assert_openai_error(post(server, "/v1/completions", body), 400, param="prompt")
    assert "max_model_len" in message
    long_chat = {"messages": [{"role": "user", "content": "cache " * 600}]}
    assert "max_model_len" in assert_openai_error(
        post(server, "/v1/chat/completions", long_chat), 400
    )


def test_max_tokens_past_the_context_left_by_the_prompt_is_a_400_naming_it_as_vllm(server):
    """vLLM refuses a prompt of P tokens with max_tokens past max_model_len - P; up to it runs."""
    limit, prompt = ENGINE_ARGS["max_model_len"], [5] * 500
    body = {"prompt": prompt, "max_tokens": limit - len(prompt) + 1}
    message = assert_openai_error(post(server, "/v1/completions", body), 400, param="max_tokens")
    assert str(limit - len(prompt)) in message
    fits = {"prompt": prompt, "max_tokens": limit - len(prompt), "ignore_eos": True}
    assert post(server, "/v1/completions", fits).json()["usage"]["total_tokens"] == limit
    for field in ("max_tokens", "max_completion_tokens"):
        chat = {"messages": MESSAGES, field: limit}
        assert_openai_error(post(server, "/v1/chat/completions", chat), 400, param=field)
    server.wait_until_idle()


def test_a_chat_max_tokens_below_1_is_a_400_naming_the_field_the_request_gave(server):
    for field in ("max_tokens", "max_completion_tokens"):
        for value in (0, -1):
            chat = {"messages": MESSAGES, field: value}
            message = assert_openai_error(post(server, "/v1/chat/completions", chat), 400, field)
            assert message.startswith(f"{field} must be >= 1")


def test_truncate_prompt_tokens_minus_1_keeps_room_for_max_tokens(server):
    """vLLM's -1 keeps the prompt's last max_model_len - max_tokens tokens."""
    limit = ENGINE_ARGS["max_model_len"]
    body = {"prompt": [5] * 600, "max_tokens": 20, "truncate_prompt_tokens": -1}
    usage = post(server, "/v1/completions", body).json()["usage"]
    assert usage["prompt_tokens"] == limit - 20


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", b'{"prompt": "unterminated'),
        ("/v1/completions", b"[1, 2"),
        ("/v1/chat/completions", b"not json at all"),
    ],
)
def test_malformed_json_is_a_400(server, path, body):
    assert "JSON" in assert_openai_error(post(server, path, body), 400)


@pytest.mark.parametrize(
    ("body", "content_type"),
    [
        (b"[1, 2]", "application/json"),
        (b"", "application/json"),
        (b'{"prompt": "hi"}', "application/x-www-form-urlencoded"),  # curl -d without -H
    ],
)
def test_a_body_that_is_not_a_json_object_is_a_400_saying_so(server, body, content_type):
    headers = {**AUTH, "Content-Type": content_type}
    response = httpx.post(f"{server.url}/v1/completions", content=body, headers=headers)
    message = assert_openai_error(response, 400)
    assert "JSON object" in message and "Content-Type" in message


def test_malformed_requests_are_400s(server):
    assert_openai_error(post(server, "/v1/completions", {"max_tokens": 3}), 400, param="prompt")
    bad_role = {"messages": [{"role": "robot", "content": "hi"}]}
    assert_openai_error(post(server, "/v1/chat/completions", bad_role), 400)
    assert_openai_error(post(server, "/tokenize", {}), 400)


def test_a_top_k_past_the_samplers_int32_range_is_a_400_and_the_engine_keeps_serving(server):
    body = {"prompt": PROMPT, "max_tokens": 2, "ignore_eos": True, "top_k": 2**31}
    assert_openai_error(post(server, "/v1/completions", body), 400, param="top_k")
    assert httpx.get(f"{server.url}/health").status_code == 200
    largest = post(server, "/v1/completions", {**body, "top_k": 2**31 - 1})
    assert largest.status_code == 200 and largest.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("best_of", 3),
        ("suffix", " end"),
        ("max_token", 50),  # a misspelt field must not fall back to the default silently
    ],
)
def test_a_field_the_server_does_not_implement_is_a_400_naming_it(server, field, value):
    body = {"prompt": PROMPT, "max_tokens": 2, field: value}
    message = assert_openai_error(post(server, "/v1/completions", body), 400, param=field)
    assert field in message


@pytest.mark.parametrize(
    ("field", "value", "key"),
    [("guided_regex", "[ab]+", "regex"), ("guided_json", {"type": "object"}, "json"),
     ("guided_choice", ["a", "b"], "choice")],
)  # fmt: skip
def test_vllm_s_removed_guided_fields_are_a_400_naming_their_structured_outputs_key(
    server, field, value, key
):  # never an unconstrained answer, as vLLM gives since it dropped them
    body = {"messages": MESSAGES, "max_tokens": 2, field: value}
    message = assert_openai_error(post(server, "/v1/chat/completions", body), 400, param=field)
    assert f'structured_outputs: {{"{key}": ...}}' in message


@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": MESSAGES}),
     ("/v1/completions", {"prompt": PROMPT, "use_beam_search": True, "n": 2})],
)  # fmt: skip
def test_a_priority_under_fcfs_is_a_400_naming_the_policy(server, path, body):
    response = post(server, path, {**body, "max_tokens": 2, "priority": -1})
    assert "scheduling-policy priority" in assert_openai_error(response, 400, param="priority")


def test_penalties_bias_and_token_lists_reach_the_engine_as_the_offline_api_applies_them(
    client, offline
):
    fields = dict(presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"7": 100})
    extra = dict(repetition_penalty=1.1, allowed_token_ids=[7, 8, 9], bad_words=["scheduler"])
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, extra_body=extra, **fields
    )
    [want] = offline_completion(
        offline, PROMPT, max_tokens=6, temperature=0, **{**fields, "logit_bias": {7: 100}}, **extra
    )
    assert response.choices[0].text == want.text
    assert set(want.token_ids) == {7}  # a bias of 100 wins among the allowed ids


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("repetition_penalty", 0),
        ("logit_bias", {"five": 1}),
        ("logit_bias", {"99999999": 1}),
        ("allowed_token_ids", []),
        ("allowed_token_ids", [99999999]),
        ("bad_words", [""]),
    ],
)
def test_out_of_range_penalties_and_unknown_token_ids_are_400s_naming_the_field(
    server, field, value
):
    body = {"prompt": PROMPT, "max_tokens": 2, field: value}
    message = assert_openai_error(post(server, "/v1/completions", body), 400, param=field)
    assert field in message
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_vllm_xargs_reach_the_request_as_extra_args_and_change_no_token(server, offline):
    """vLLM's vllm_xargs (for custom sampling code) become SamplingParams.extra_args; the
    engine's own sampling ignores them, as vLLM's does; anything but a dict is a 400."""
    xargs = {"tag": "a", "weights": [1, 2.5]}
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "vllm_xargs": xargs}
    for path, request in (
        ("/v1/completions", body),
        ("/v1/chat/completions", {**body, "prompt": None, "messages": MESSAGES}),
    ):
        response = post(server, path, {k: v for k, v in request.items() if v is not None})
        assert response.status_code == 200, response.text
    [want] = offline_completion(offline, PROMPT, max_tokens=4, temperature=0)
    assert post(server, "/v1/completions", body).json()["choices"][0]["text"] == want.text
    params = sampling_params(CompletionRequest(**body), {}, 4, None)
    assert params.extra_args == xargs
    assert_openai_error(post(server, "/v1/completions", {**body, "vllm_xargs": [1]}), 400)


def test_unimplemented_fields_at_values_that_ask_for_nothing_are_accepted(server):
    neutral = {
        "echo": False,
        "best_of": 1,
        "suffix": None,
        "skip_special_tokens": True,
        "user": "alice",
        # vLLM's fields at their defaults, which clients written for it may send every time
        "use_beam_search": False,
        "length_penalty": 1.0,
        "priority": 0,
        "spaces_between_special_tokens": True,
    }
    body = {"prompt": PROMPT, "max_tokens": 2, "ignore_eos": True, **neutral}
    completion = post(server, "/v1/completions", body)
    assert completion.status_code == 200, completion.text
    assert completion.json()["usage"]["completion_tokens"] == 2
    chat = {"messages": MESSAGES, "max_tokens": 2, "tools": [], "tool_choice": "none"}
    chat |= {"response_format": {"type": "text"}, "parallel_tool_calls": False}
    # OpenAI's labels (safety_identifier replaces user) and its default modalities
    chat |= {"safety_identifier": "u1", "prompt_cache_key": "k1", "modalities": ["text"]}
    assert post(server, "/v1/chat/completions", chat).status_code == 200
    audio = post(server, "/v1/chat/completions", {**chat, "modalities": ["text", "audio"]})
    assert_openai_error(audio, 400, param="modalities")


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (  # a misspelt schema would otherwise leave any JSON object allowed
            "/v1/chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"schmea": {}}}},
            "response_format.json_schema.schmea",
        ),
        (
            "/v1/chat/completions",
            {"stream": True, "stream_options": {"include_usgae": True}},
            "stream_options.include_usgae",
        ),
        (
            "/v1/chat/completions",
            {"tools": [{"type": "function", "function": {"name": "f", "parameter": {}}}]},
            "tools.0.function.parameter",
        ),
        ("/tokenize", {"prompt": PROMPT, "return_token_str": True}, "return_token_str"),
        ("/detokenize", {"tokens": [5], "skip_special": True}, "skip_special"),
    ],
)
def test_a_nested_option_the_server_does_not_declare_is_a_400_naming_it(server, path, body, param):
    if path == "/v1/chat/completions":
        body = {"messages": MESSAGES, "max_tokens": 2, **body}
    message = assert_openai_error(post(server, path, body), 400, param=param)
    assert param.rsplit(".", 1)[-1] in message
    nulls = {"response_format": {"type": "text", "json_schema": None, "x": None}}
    accepted = post(
        server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, **nulls}
    )
    assert accepted.status_code == 200, accepted.text


def test_fields_clients_echo_back_with_messages_are_ignored_with_a_warning(server, offline):
    """OpenAI's client returns an assistant message with "refusal" and "annotations"; sent back in
    the next request they change nothing, and the server's log names them."""
    echoed = {"role": "assistant", "content": "KV.", "refusal": None, "annotations": []}
    messages = [*MESSAGES[:2], echoed, {**MESSAGES[3], "cache_control": {"type": "ephemeral"}}]
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("uvicorn.error")
    log.addHandler(handler)
    try:
        body = {"messages": messages, "max_tokens": 4, "temperature": 0}
        response = post(server, "/v1/chat/completions", body)
    finally:
        log.removeHandler(handler)
    assert response.status_code == 200, response.text
    [want] = offline.chat(MESSAGES, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert response.json()["choices"][0]["message"]["content"] == want.outputs[0].text
    warned = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert "ignored the fields annotations of a ChatMessage" in warned
    assert "ignored the fields cache_control of a ChatMessage" in warned
    assert not any("refusal" in line for line in warned)  # null: nothing to ignore


def test_special_tokens_and_stop_strings_in_the_text_as_the_offline_llm(client, offline):
    """vLLM's skip_special_tokens and include_stop_str_in_output: with only a special token
    allowed the text is empty, or that token's text; a stop string ends the text, or is kept."""
    tokenizer = offline.get_tokenizer()
    special = tokenizer.eos_token_id
    for skip in (True, False):
        fields = {"allowed_token_ids": [special], "ignore_eos": True, "skip_special_tokens": skip}
        response = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=3, extra_body=fields
        )
        params = SamplingParams(max_tokens=3, **fields)
        [want] = offline.generate(PROMPT, params, use_tqdm=False)[0].outputs
        assert response.choices[0].text == want.text
        assert (want.text == "") == skip
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    stop = plain.choices[0].text[4:6]
    assert stop.strip()
    for keep in (False, True):
        response = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop],
            extra_body={"include_stop_str_in_output": keep},
        )  # fmt: skip
        params = SamplingParams(
            max_tokens=12, temperature=0, stop=[stop], include_stop_str_in_output=keep
        )
        [want] = offline.generate(PROMPT, params, use_tqdm=False)[0].outputs
        assert response.choices[0].text == want.text
        assert want.text.endswith(stop) == keep


def test_chat_top_logprobs_needs_logprobs_and_is_at_most_max_logprobs(server):
    body = {"messages": MESSAGES, "max_tokens": 2}
    without_logprobs = {**body, "top_logprobs": 3}
    assert_openai_error(post(server, "/v1/chat/completions", without_logprobs), 400, "top_logprobs")
    too_many = {**body, "logprobs": True, "top_logprobs": 21}
    assert_openai_error(post(server, "/v1/chat/completions", too_many), 400, "top_logprobs")
    # as vLLM's: 0 asks for nothing, so it needs no logprobs
    zero = post(server, "/v1/chat/completions", {**body, "top_logprobs": 0})
    assert zero.status_code == 200 and zero.json()["choices"][0]["logprobs"] is None


def test_chat_without_messages_is_a_400(server):
    assert_openai_error(post(server, "/v1/chat/completions", {"messages": []}), 400, "messages")


def test_a_chat_template_that_fails_on_the_messages_is_a_400_and_the_engine_keeps_serving(
    folder, tmp_path
):
    # like real templates that read messages[0]["role"] unguarded: jinja raises UndefinedError
    model = shutil.copytree(folder, tmp_path / "model")
    (model / "chat_template.jinja").write_text("{{ messages[1]['role'] }}", encoding="utf-8")
    llm = AsyncLLM.from_model(str(model), **ENGINE_ARGS)
    with running(build_app(llm, MODEL)) as url:
        one_message = {"messages": MESSAGES[1:2], "max_tokens": 2}
        response = httpx.post(f"{url}/v1/chat/completions", json=one_message)
        assert "chat template" in assert_openai_error(response, 400, param="messages")
        response = httpx.post(f"{url}/tokenize", json={"messages": MESSAGES[1:2]})
        assert_openai_error(response, 400, param="messages")
        two_or_more = {**one_message, "messages": MESSAGES}
        assert httpx.post(f"{url}/v1/chat/completions", json=two_or_more).status_code == 200
        assert httpx.get(f"{url}/health").status_code == 200
    llm.shutdown()


def test_detokenize_rejects_ids_past_32_bits_with_a_400(server):
    assert_openai_error(post(server, "/detokenize", {"tokens": [1, 2**32]}), 400, "tokens.1")


def test_an_unexpected_failure_is_still_a_500_in_openai_error_json(server, monkeypatch):
    def explode(*args, **kwargs):
        raise RuntimeError("tokenizer exploded")

    server.wait_until_idle()
    monkeypatch.setattr(server.llm.tokenizer, "decode", explode)
    with httpx.Client(base_url=server.url, headers=AUTH) as http:  # one kept-alive connection
        response = http.post("/detokenize", json={"tokens": [1, 2]})
        assert "tokenizer exploded" in assert_openai_error(response, 500)
        assert response.json()["error"]["type"] == "server_error"
        assert response.headers["connection"] == "close"  # the client opens a new one next
        monkeypatch.undo()
        assert http.post("/detokenize", json={"tokens": [1, 2]}).status_code == 200


def test_a_missing_or_wrong_api_key_is_a_401(server):
    body = {"prompt": PROMPT, "max_tokens": 2}
    assert_openai_error(post(server, "/v1/completions", body, headers={}), 401)
    wrong = {"Authorization": "Bearer nope"}
    assert_openai_error(post(server, "/v1/completions", body, headers=wrong), 401)
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200


# ---- disconnects, concurrency, metrics ----------------------------------------------------


def test_a_client_that_disconnects_mid_stream_aborts_and_frees_its_blocks(server):
    server.wait_until_idle()
    aborted = server.metrics().get('tandem_request_success_total{finished_reason="abort"}', 0)
    body = {"prompt": PROMPT, "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        assert server.llm.stats.num_running == 1
    server.wait_until_idle()
    metrics = server.metrics()
    assert metrics['tandem_request_success_total{finished_reason="abort"}'] == aborted + 1
    assert metrics["tandem_kv_cache_usage_perc"] == 0.0


def test_load_counts_the_generation_calls_being_answered(server):
    server.wait_until_idle()
    load = f"{server.url}/load"
    assert httpx.get(load, headers=AUTH).json() == {"server_load": 0}
    body = {"prompt": PROMPT, "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        assert httpx.get(load, headers=AUTH).json() == {"server_load": 1}
    server.wait_until_idle()
    assert httpx.get(load, headers=AUTH).json() == {"server_load": 0}


def test_a_client_that_leaves_a_non_streaming_request_aborts_it(server):
    server.wait_until_idle()
    aborted = server.metrics().get('tandem_request_success_total{finished_reason="abort"}', 0)
    body = {"prompt": PROMPT, "max_tokens": 480, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        timeout = httpx.Timeout(10.0, read=0.1)  # 480 tokens take far longer than 0.1 s
        httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=timeout)
    server.wait_until_idle()
    metrics = server.metrics()
    assert metrics['tandem_request_success_total{finished_reason="abort"}'] == aborted + 1


def test_a_hundred_concurrent_streams_get_the_offline_tokens_for_their_seeds(server, offline):
    num_requests, max_tokens = 100, 12
    prompts = [f"{PROMPT} {i}" for i in range(num_requests)]

    async def stream(client: httpx.AsyncClient, i: int) -> tuple[list[int], str, dict]:
        body = {
            "prompt": prompts[i],
            "max_tokens": max_tokens,
            "temperature": 0.9,
            "seed": 1000 + i,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
        }
        tokens, text, usage = [], "", {}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                usage = chunk["usage"] or usage
                for choice in chunk["choices"]:
                    tokens += choice["token_ids"]
                    text += choice["text"]
        return tokens, text, usage

    async def main():
        limits = httpx.Limits(max_connections=num_requests)
        async with httpx.AsyncClient(
            base_url=server.url, headers=AUTH, limits=limits, timeout=60
        ) as client:
            return await asyncio.gather(*(stream(client, i) for i in range(num_requests)))

    results = asyncio.run(main())
    params = [
        SamplingParams(max_tokens=max_tokens, temperature=0.9, seed=1000 + i, ignore_eos=True)
        for i in range(num_requests)
    ]
    want = offline.generate(prompts, params, use_tqdm=False)
    for (tokens, text, usage), w in zip(results, want, strict=True):
        assert tokens == w.outputs[0].token_ids
        assert text == w.outputs[0].text
        assert usage["completion_tokens"] == max_tokens
    server.wait_until_idle()


def test_metrics_parse_and_count_what_was_served(server, client, offline):
    tokenizer = offline.get_tokenizer()
    server.wait_until_idle()
    before = server.metrics()
    client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, extra_body={"ignore_eos": True}
    )
    server.wait_until_idle()
    after = server.metrics()
    for name in (
        "tandem_num_requests_running",
        "tandem_num_requests_waiting",
        "tandem_kv_cache_usage_perc",
        "tandem_num_preemptions_total",
    ):
        assert name in after
    grew = {
        "tandem_prompt_tokens_total": len(tokenizer.encode(PROMPT)),
        "tandem_generation_tokens_total": 5,
        "tandem_time_to_first_token_seconds_count": 1,
        "tandem_inter_token_latency_seconds_count": 4,
        "tandem_e2e_request_latency_seconds_count": 1,
        'tandem_request_success_total{finished_reason="length"}': 1,
    }
    for name, delta in grew.items():
        assert after[name] - before.get(name, 0) == delta, name


def test_request_phase_and_size_histograms_add_up_as_vllms(server, client, offline):
    """Each finished request: queued until admitted, prefill until its first token, decode
    until its last (inference = prefill + decode, queue + inference = e2e); its prompt and
    generated tokens and max_tokens (none given: completions' 16); one n per call."""
    num_prompt = len(offline.get_tokenizer().encode(PROMPT))
    server.wait_until_idle()
    before = server.metrics()
    client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, n=2, extra_body={"ignore_eos": True}
    )
    client.completions.create(model=MODEL, prompt=PROMPT, temperature=0)
    server.wait_until_idle()
    after = server.metrics()

    def grew(name: str) -> float:
        return after[f"tandem_{name}"] - before.get(f"tandem_{name}", 0)

    for phase in ("queue", "prefill", "decode", "inference"):
        assert grew(f"request_{phase}_time_seconds_count") == 3
    assert grew("request_time_per_output_token_seconds_count") >= 2  # the third may make one
    prefill, decode = (
        grew("request_prefill_time_seconds_sum"),
        grew("request_decode_time_seconds_sum"),
    )
    inference = grew("request_inference_time_seconds_sum")
    assert prefill > 0 and decode > 0
    assert inference == pytest.approx(prefill + decode)
    e2e = grew("e2e_request_latency_seconds_sum")
    assert grew("request_queue_time_seconds_sum") + inference == pytest.approx(e2e)
    assert grew("request_prompt_tokens_sum") == 3 * num_prompt
    assert 11 <= grew("request_generation_tokens_sum") <= 10 + 16
    assert grew("request_params_max_tokens_sum") == 10 + 16
    assert (grew("request_params_n_count"), grew("request_params_n_sum")) == (2, 3)
    assert grew('request_prompt_tokens_bucket{le="5.0"}') == 3 * (num_prompt <= 5)


def test_token_buckets_run_1_2_5_up_to_the_limit():
    assert buckets_1_2_5(1) == (1,)
    assert buckets_1_2_5(128) == (1, 2, 5, 10, 20, 50, 100)
    assert buckets_1_2_5(500) == (1, 2, 5, 10, 20, 50, 100, 200, 500)


def test_inter_token_latency_counts_every_token_under_stream_interval(folder):
    """vLLM observes one gap per decode step, whatever stream_interval holds back: 9 tokens
    sent 4 at a time are still 8 gaps (they were 2, each 4 tokens long)."""
    llm = AsyncLLM.from_model(folder, **ENGINE_ARGS, stream_interval=4)
    with running(build_app(llm, MODEL)) as url:
        server = Server(url, llm)
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 9, "ignore_eos": True}
        assert httpx.post(f"{url}/v1/completions", json=body).status_code == 200
        server.wait_until_idle()
        got = server.metrics()
    llm.shutdown()
    assert got["tandem_time_to_first_token_seconds_count"] == 1
    assert got["tandem_inter_token_latency_seconds_count"] == 8


def test_a_dead_engine_fails_health_and_requests_with_a_500(folder):
    engine = Engine(EngineConfig(model=folder, **ENGINE_ARGS))
    steps, step = itertools.count(), engine.step

    def failing_step():
        if next(steps) == 3:
            raise RuntimeError("device lost")
        return step()

    engine.step = failing_step
    llm = AsyncLLM(engine)
    with running(build_app(llm, MODEL)) as url:
        body = {"prompt": PROMPT, "max_tokens": 50, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body) as r:
            events = [line for line in r.iter_lines() if line]
        assert "device lost" in json.loads(events[-2][6:])["error"]["message"]
        assert events[-1] == "data: [DONE]"
        assert httpx.get(f"{url}/health").status_code == 503
        response = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT})
        assert_openai_error(response, 500)
    llm.shutdown()


def test_bench_serve_completes_every_request(server, capsys):
    args = f"--base-url {server.url} --api-key {API_KEY} --num-prompts 24 --max-concurrency 8"
    main(["bench", "serve", *args.split(), "--input-len", "16", "--output-len", "6"])
    out = capsys.readouterr().out
    assert "completed 24/24 requests (0 failed)" in out
    assert all(name in out for name in ("TTFT", "TPOT", "ITL", "output tok/s"))
    server.wait_until_idle()


@pytest.mark.parametrize(("rate", "burstiness"), [(50.0, 1.0), (50.0, 4.0), (200.0, 0.5)])
def test_arrivals_are_gamma_gaps_of_the_request_rate_and_burstiness(rate, burstiness):
    """vLLM's arrivals: the first at 0, then gaps of mean 1 / rate whose squared coefficient of
    variation is 1 / burstiness (a gamma distribution of that shape; 1 is Poisson)."""
    args = argparse.Namespace(request_rate=rate, burstiness=burstiness, num_prompts=40001, seed=3)
    times = np.asarray(arrival_times(args))
    gaps = np.diff(times)
    assert times[0] == 0 and (gaps >= 0).all() and len(times) == 40001
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert gaps.var() / gaps.mean() ** 2 == pytest.approx(1 / burstiness, rel=0.06)
    args.request_rate = math.inf
    assert arrival_times(args) == [0.0] * 40001


def test_bench_serve_sends_each_request_at_its_arrival(server, tmp_path):
    """--request-rate: each request leaves at its drawn arrival time (vLLM's --host and --port
    name the server here), not before it, and soon after it."""
    host, port = server.url.removeprefix("http://").split(":")
    report = tmp_path / "report.json"
    flags = ["--host", host, "--port", port, "--api-key", API_KEY, "--num-prompts", "6",
             "--request-rate", "8", "--random-input-len", "8", "--random-output-len", "3",
             "--output-json", str(report), "--max-concurrency", "3", "--save-result",
             "--result-dir", str(tmp_path / "results")]  # fmt: skip
    main(["bench", "serve", *flags])
    result = json.loads(report.read_text())
    [saved] = (tmp_path / "results").iterdir()  # vLLM's --save-result name
    assert re.fullmatch(r"tandem-8\.0qps-concurrency3-tiny-llama-\d{8}-\d{6}\.json", saved.name)
    assert json.loads(saved.read_text()) == result
    args = argparse.Namespace(request_rate=8.0, burstiness=1.0, num_prompts=6, seed=0)
    planned = arrival_times(args)
    assert result["completed"] == 6 and result["request_rate"] == 8.0
    for sent, due in zip(result["send_times_s"], planned, strict=True):
        assert due - 0.005 <= sent <= due + 0.25
    server.wait_until_idle()


def test_bench_serve_chats_as_vllm_s_openai_chat_backend(server, tmp_path):
    """--backend openai-chat: each prompt's text as a chat's user message on
    /v1/chat/completions, every request answered with its tokens, its prompt counted by the
    server (the template's tokens with the prompt's)."""
    report = tmp_path / "report.json"
    main(["bench", "serve", "--base-url", server.url, "--api-key", API_KEY, "--backend",
          "openai-chat", "--num-prompts", "4", "--input-len", "8", "--output-len", "4",
          "--output-json", str(report)])  # fmt: skip
    result = json.loads(report.read_text())
    assert (result["completed"], result["backend"]) == (4, "openai-chat")
    assert result["output_tokens_per_s"] * result["duration_s"] == pytest.approx(16)
    assert result["ttft_ms"] and result["itl_ms"]
    server.wait_until_idle()


def test_a_result_file_needs_save_result():
    with pytest.raises(SystemExit, match="--result-dir and --result-filename name --save-result"):
        main(["bench", "serve", "--result-filename", "r.json"])


def test_tandem_serve_starts_a_server_from_the_command_line(folder):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "tandem.cli", "serve", folder, "--port", str(port)]
    command += ["--max-model-len", "128", "--api-key", API_KEY, "--served-model-name", MODEL]
    url = f"http://127.0.0.1:{port}"
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as process:
        try:
            wait_until_healthy(process, url, 60)
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
            response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)
            assert response.usage.completion_tokens <= 3
        finally:
            process.send_signal(signal.SIGINT)
            assert process.wait(timeout=30) == 0


# ---- hardening: limits, text, OpenAI compatibility, health ---------------------------------


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "a \ud800 b"}, "prompt"),
        ("/v1/completions", {"prompt": ["fine", "\udfff"]}, "prompt.1"),
        ("/v1/completions", {"prompt": PROMPT, "stop": "\ud800"}, "stop"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]},
         "messages.0.content"),
        ("/tokenize", {"prompt": "\ud800"}, "prompt"),
    ],
)  # fmt: skip
def test_a_lone_surrogate_is_a_400_naming_the_field_and_the_connection_stays_usable(
    server, path, body, param
):
    raw = json.dumps(body)  # ASCII JSON: the escape \ud800 reaches the server as it is
    assert "\\ud800" in raw or "\\udfff" in raw
    with httpx.Client(base_url=server.url, headers=AUTH) as http:
        response = http.post(path, content=raw, headers={"Content-Type": "application/json"})
        assert "surrogate" in assert_openai_error(response, 400, param=param)
        assert http.get("/v1/models").status_code == 200


def test_a_huge_min_tokens_is_a_400_and_the_engine_keeps_serving(server):
    """min_tokens only has to be <= max_tokens, and max_tokens past the context is cut: a value
    past int64 reached the engine's arrays and stopped its thread."""
    body = {"prompt": PROMPT, "min_tokens": 2**63, "max_tokens": 2**63}
    assert "max_tokens" in assert_openai_error(post(server, "/v1/completions", body), 400)
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize(
    "raw",
    [
        '{"prompt": "a", "bad_words": ["\\ud800"], "max_tokens": 2}',
        '{"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "r", '
        '"tool_call_id": "\\ud800"}], "max_tokens": 2}',
        '{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", '
        '"function": {"name": "f", "description": "\\ud800"}}], "max_tokens": 2}',
    ],
    ids=["bad_words", "tool_call_id", "tool_description"],
)
def test_a_lone_surrogate_in_any_text_field_is_a_400(server, raw):
    """Fields the tokenizer or the chat template reads, beside the prompt and the messages."""
    path = "/v1/completions" if "prompt" in raw else "/v1/chat/completions"
    with httpx.Client(base_url=server.url, headers=AUTH) as http:
        response = http.post(path, content=raw, headers={"Content-Type": "application/json"})
        assert "surrogate" in assert_openai_error(response, 400)
        assert http.get("/health").status_code == 200


def test_a_stream_that_fails_on_our_side_ends_with_an_error_event_and_done(server, monkeypatch):
    """A fault of the server's own mid-stream (here a formatter that raises) ends the stream
    with a 500 error event and [DONE], as vLLM's does, not with a cut connection."""
    from tandem.server import serving

    def broken(*args):
        raise RuntimeError("formatter broke")

    monkeypatch.setattr(serving.CompletionFormat, "delta_choice", broken)
    body = {"prompt": PROMPT, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH) as reply:
        lines = [line for line in reply.iter_lines() if line]
    assert reply.status_code == 200 and lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert error["type"] == "server_error" and "formatter broke" in error["message"]
    monkeypatch.undo()
    assert post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}).status_code == 200


def test_a_body_past_max_request_bytes_is_a_413_by_length_or_as_it_streams(folder):
    llm = AsyncLLM.from_model(folder, **ENGINE_ARGS)
    options = ServerOptions(max_request_bytes=1000)
    big = json.dumps({"prompt": "x" * 2000, "max_tokens": 1})
    try:
        with running(build_app(llm, MODEL, options=options)) as url:
            response = httpx.post(f"{url}/v1/completions", content=big,
                                  headers={"Content-Type": "application/json"})  # fmt: skip
            assert "max-request-bytes" in assert_openai_error(response, 413)

            def chunks():  # no Content-Length: counted as it arrives
                yield big[:600].encode()
                yield big[600:].encode()

            response = httpx.post(f"{url}/v1/completions", content=chunks(),
                                  headers={"Content-Type": "application/json"})  # fmt: skip
            assert_openai_error(response, 413)
            small = {"prompt": PROMPT, "max_tokens": 1}
            assert httpx.post(f"{url}/v1/completions", json=small).status_code == 200
            # Anthropic's Messages API answers in its own shape, by length or as it streams
            for content in (big, chunks()):
                response = httpx.post(f"{url}/v1/messages", content=content,
                                      headers={"Content-Type": "application/json"})  # fmt: skip
                assert response.status_code == 413
                assert response.json()["error"]["type"] == "request_too_large"
    finally:
        llm.shutdown()


def test_prompts_times_n_past_the_cap_is_a_400_and_nothing_is_queued(server):
    server.wait_until_idle()
    body = {"prompt": [PROMPT] * 3, "n": 100, "max_tokens": 1}  # 300 > 256
    message = assert_openai_error(post(server, "/v1/completions", body), 400, param="n")
    assert "300" in message and "256" in message
    assert server.llm.stats.num_waiting == server.llm.stats.num_running == 0


def test_tokenizing_runs_off_the_event_loop(server, monkeypatch):
    """A slow tokenization (a 10 MB prompt) must not hold up other requests."""
    encode = server.llm.tokenizer.encode

    def slow_encode(text, *args, **kwargs):
        if text.startswith("slow"):
            time.sleep(2.0)
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(server.llm.tokenizer, "encode", slow_encode)
    slow = threading.Thread(
        target=post, args=(server, "/v1/completions", {"prompt": "slow one", "max_tokens": 1})
    )
    slow.start()
    time.sleep(0.3)
    start = time.monotonic()
    assert post(server, "/tokenize", {"prompt": PROMPT}).status_code == 200
    assert time.monotonic() - start < 1.0
    slow.join()


def test_the_developer_role_is_the_system_message_to_a_template_that_never_names_it(
    server, offline, folder
):
    """As vLLM's, served and offline: the tiny model's template knows system, user and
    assistant only (another role is its error), so a developer message reaches it as the
    system message."""
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(folder)
    text = reference.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    developer = [{"role": "developer", "content": "You are terse."}, *MESSAGES[1:]]
    [out] = offline.chat(developer, SamplingParams(max_tokens=1), use_tqdm=False)
    assert out.prompt == text
    tokens = post(server, "/tokenize", {"messages": developer}).json()["tokens"]
    assert tokens == reference(text, add_special_tokens=False).input_ids
    body = {"messages": [{"role": "ipython", "content": "4"}], "max_tokens": 2}
    message = assert_openai_error(post(server, "/v1/chat/completions", body), 400, "messages")
    assert "unknown role ipython" in message


def test_the_bearer_scheme_is_case_insensitive(server):
    body = {"prompt": PROMPT, "max_tokens": 1}
    for scheme in ("bearer", "BEARER", "Bearer"):
        headers = {"Authorization": f"{scheme} {API_KEY}"}
        assert post(server, "/v1/completions", body, headers=headers).status_code == 200
    assert_openai_error(post(server, "/v1/completions", body, headers={"Authorization": API_KEY}),
                        401)  # fmt: skip


def test_stream_options_without_stream_is_a_400(server):
    body = {"prompt": PROMPT, "stream_options": {"include_usage": True}}
    assert_openai_error(post(server, "/v1/completions", body), 400, param="stream_options")
    chat = {"messages": MESSAGES, "stream": False, "stream_options": {"include_usage": True}}
    assert_openai_error(post(server, "/v1/chat/completions", chat), 400, param="stream_options")
    unset = {"messages": MESSAGES, "max_tokens": 2, "stream_options": {"include_usage": False}}
    assert_openai_error(post(server, "/v1/chat/completions", unset), 400, param="stream_options")
    empty = {"prompt": PROMPT, "max_tokens": 2, "stream_options": {}}  # vLLM takes it too
    assert post(server, "/v1/completions", empty).json()["usage"]["completion_tokens"] == 2


def test_stop_strings_past_the_caps_are_400s_and_the_caps_are_configurable(server, folder):
    too_many = {"prompt": PROMPT, "stop": [f"s{i}" for i in range(17)]}
    assert "16" in assert_openai_error(post(server, "/v1/completions", too_many), 400, "stop")
    too_long = {"prompt": PROMPT, "stop": "x" * 257}
    assert "256" in assert_openai_error(post(server, "/v1/completions", too_long), 400, "stop")
    llm = AsyncLLM.from_model(folder, **ENGINE_ARGS)
    options = ServerOptions(max_stop_strings=2, max_stop_string_length=4)
    try:
        with running(build_app(llm, MODEL, options=options)) as url:
            for stop in (["a", "b", "c"], "abcde"):
                body = {"prompt": PROMPT, "stop": stop, "max_tokens": 1}
                assert_openai_error(httpx.post(f"{url}/v1/completions", json=body), 400, "stop")
            body = {"prompt": PROMPT, "stop": ["a", "abcd"], "max_tokens": 1}
            assert httpx.post(f"{url}/v1/completions", json=body).status_code == 200
    finally:
        llm.shutdown()


def test_health_is_503_while_a_step_does_not_return_and_200_once_it_does(folder):
    engine = Engine(EngineConfig(model=folder, **ENGINE_ARGS))
    release, step = threading.Event(), engine.step

    def stuck_step():
        assert release.wait(timeout=30)
        return step()

    engine.step = stuck_step
    llm = AsyncLLM(engine)
    try:
        options = ServerOptions(health_stall_timeout_s=0.5)
        with running(build_app(llm, MODEL, options=options)) as url:
            time.sleep(1.0)  # idle: waiting for work is no stall
            assert httpx.get(f"{url}/health").status_code == 200
            body = {"prompt": PROMPT, "max_tokens": 2}
            request = threading.Thread(target=httpx.post, args=(f"{url}/v1/completions",),
                                       kwargs={"json": body, "timeout": 30})  # fmt: skip
            request.start()
            time.sleep(1.0)
            assert httpx.get(f"{url}/health").status_code == 503
            release.set()
            request.join(timeout=30)
            assert httpx.get(f"{url}/health").status_code == 200
    finally:
        release.set()
        llm.shutdown()


def test_prompt_logprobs_as_vllm_per_completion_choice_and_once_for_a_chat(server, offline):
    """vLLM's prompt_logprobs field: each completion choice (and a chat response, once) holds,
    per prompt position, None for the first, then {"token id": {"logprob", "rank",
    "decoded_token"}}: the top k in rank order and the prompt token, with the values
    LLM.generate gives; with stream it is a 400 naming the field."""
    ids = offline.get_tokenizer().encode(PROMPT)
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2)
    [want] = offline.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    body = {"prompt": ids, "max_tokens": 2, "seed": 3, "prompt_logprobs": 2, "n": 2}
    choices = post(server, "/v1/completions", body).json()["choices"]
    expected = [None] + [
        {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
         for t, lp in entry.items()}
        for entry in want.prompt_logprobs[1:]
    ]  # fmt: skip
    assert len(choices) == 2
    for choice in choices:
        got = choice["prompt_logprobs"]
        assert len(got) == len(ids) and got[0] is None
        for position, (g, w) in enumerate(zip(got[1:], expected[1:], strict=True), 1):
            assert list(g) == list(w) and str(ids[position]) in g
            for key in w:
                assert g[key]["rank"] == w[key]["rank"]
                assert g[key]["decoded_token"] == w[key]["decoded_token"]
                assert g[key]["logprob"] == pytest.approx(w[key]["logprob"], abs=1e-5)
    plain = post(server, "/v1/completions", {**body, "prompt_logprobs": None}).json()
    assert "prompt_logprobs" not in plain["choices"][0]
    chat = post(server, "/v1/chat/completions",
                {"messages": MESSAGES, "max_tokens": 1, "prompt_logprobs": 1}).json()  # fmt: skip
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 1
    assert all(1 <= len(entry) <= 2 for entry in chat["prompt_logprobs"][1:])
    streamed = post(server, "/v1/completions", {**body, "stream": True})
    assert streamed.status_code == 400
    assert streamed.json()["error"]["param"] == "prompt_logprobs"
    # 0 asks for no more than each prompt token's own: taken in a stream (which shows none)
    streamed = post(server, "/v1/completions", {**body, "prompt_logprobs": 0, "stream": True})
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
    assert "prompt_logprobs" not in streamed.text
    negative = post(server, "/v1/completions", {**body, "prompt_logprobs": -2})
    assert negative.status_code == 400


def test_start_and_stop_profile_write_a_trace_or_say_profiling_is_off(server, folder, tmp_path):
    """vLLM's /start_profile and /stop_profile: with the engine's profiler_config a trace file of
    the requests between them; without it a 400 naming profiler_config."""
    response = httpx.post(f"{server.url}/start_profile", headers=AUTH)
    assert_openai_error(response, 400, "profiler_config")
    config = {"profiler": "torch", "torch_profiler_dir": str(tmp_path)}
    llm = AsyncLLM.from_model(folder, **ENGINE_ARGS, profiler_config=config)
    try:
        with running(build_app(llm, MODEL, api_key=API_KEY)) as url:
            assert httpx.post(f"{url}/start_profile", headers=AUTH).json() == {
                "status": "profiling"
            }
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3}
            assert httpx.post(f"{url}/v1/completions", json=body, headers=AUTH).status_code == 200
            [trace] = httpx.post(f"{url}/stop_profile", headers=AUTH).json()["traces"]
    finally:
        llm.shutdown()
    assert trace.startswith(str(tmp_path)) and os.path.getsize(trace) > 0


def test_an_error_quoting_text_that_utf_8_cannot_hold_is_still_sent():
    """An error message may quote the client's text: a lone surrogate is sent as its escape."""
    response = OpenAIError("no adapter named '\udcff'", param="lora_name").response()
    assert json.loads(response.body)["error"] == {
        "message": "no adapter named '\\udcff'",
        "type": "invalid_request_error",
        "param": "lora_name",
        "code": None,
    }


def test_invocations_answer_as_the_endpoint_the_body_names(server):
    """SageMaker's /invocations: a chat body as /v1/chat/completions answers it, a completion
    body as /v1/completions, an embedding body as /v1/embeddings, token ids as /generate."""
    fixed = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    for path, body in [
        ("/v1/chat/completions", {"messages": MESSAGES, **fixed}),
        ("/v1/completions", {"prompt": PROMPT, **fixed}),
        ("/v1/embeddings", {"input": [PROMPT, "Another"]}),
        ("/inference/v1/generate", {"token_ids": [5, 6, 7], "sampling_params": fixed}),
    ]:
        want, got = post(server, path, body).json(), post(server, "/invocations", body).json()
        for answer in (want, got):  # ids, times and prefix-cache hits differ call to call
            for key in ("id", "created", "request_id"):
                answer.pop(key, None)
            answer.get("usage", {}).pop("prompt_tokens_details", None)
        assert got == want, path
    assert httpx.get(f"{server.url}/ping").status_code == 200  # without the key, as /health
    for body, param in [({"text": "x"}, None), ({"messages": 5}, "messages"), ([PROMPT], None)]:
        answer = post(server, "/invocations", body)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == param
    for content in (b"{", b'{"input": ' + b"[" * 5000 + b"]" * 5000 + b"}"):  # past the parser
        broken = httpx.post(f"{server.url}/invocations", content=content, headers=AUTH)
        assert broken.status_code == 400 and "not valid JSON" in broken.text


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_a_response_aborts_it(server, stream):
    """/v1/responses over the chat machinery: a stream left after its first event, or a
    response whose client stops waiting, ends its request and frees its blocks."""
    server.wait_until_idle()
    aborted = server.metrics().get('tandem_request_success_total{finished_reason="abort"}', 0)
    body = {"input": PROMPT, "max_output_tokens": 480, "ignore_eos": True, "stream": stream}
    url = f"{server.url}/v1/responses"
    if stream:
        with httpx.stream("POST", url, json=body, headers=AUTH) as r:
            # held: a line iterator dropped is closed, and closing it closes the connection
            lines = r.iter_lines()
            next(line for line in lines if "output_text.delta" in line)
            assert server.llm.stats.num_running == 1
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url, json=body, headers=AUTH, timeout=httpx.Timeout(10.0, read=0.1))
    server.wait_until_idle()
    metrics = server.metrics()
    assert metrics['tandem_request_success_total{finished_reason="abort"}'] == aborted + 1
    assert metrics["tandem_kv_cache_usage_perc"] == 0.0


def test_abort_requests_ends_calls_by_their_ids_with_what_they_have(server):
    """vLLM's /abort_requests (RL trainers): a stream ends with finish_reason "abort", a call
    waiting for its whole answer gets it as far as it went; unknown ids are left out."""
    server.wait_until_idle()
    body = {"prompt": PROMPT, "max_tokens": 480, "ignore_eos": True}
    headers = {**AUTH, "X-Request-Id": "rl-7"}
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True},
                      headers=headers) as r:  # fmt: skip
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        answer = post(server, "/abort_requests", {"request_ids": ["cmpl-rl-7", "cmpl-gone"]})
        assert answer.json() == {"aborted": ["cmpl-rl-7"]}
        chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
    server.wait_until_idle()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        headers = {**AUTH, "X-Request-Id": "rl-8"}
        call = pool.submit(httpx.post, f"{server.url}/v1/completions", json=body, headers=headers,
                           timeout=60)  # fmt: skip
        deadline = time.monotonic() + 30
        while server.llm.stats.num_running == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert post(server, "/abort_requests", {"request_ids": ["cmpl-rl-8"]}).status_code == 200
        [choice] = call.result().json()["choices"]
    assert choice["finish_reason"] == "abort" and choice["text"] is not None
    server.wait_until_idle()
    assert post(server, "/abort_requests", {"request_ids": "cmpl-rl-8"}).status_code == 400
